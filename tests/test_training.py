"""End-to-end training with `strategy.run`: the CPU hang, exactness, scan and jit.

A small MLP regresses onto a random linear teacher, so the loss has a known floor near zero and
every replica count trains on exactly the same global batches.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import jdist
from jdist.testing import mirrored

IN, HIDDEN, OUT = 16, 32, 4
GLOBAL_BATCH = 32  # Divisible by 1, 2, 4 and 8 replicas.
# SGD with momentum, not Adam: Adam divides by the gradient's running magnitude, which turns
# float rounding in near-zero gradients (a unit whose ReLU is mostly off) into full-size steps,
# so trajectories that agree to 1e-7 per step would drift apart by far more than rounding.
OPTIMIZER = optax.sgd(0.02, momentum=0.9)


def init_params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"w1": jax.random.normal(k1, (IN, HIDDEN)) / 4, "b1": jnp.zeros(HIDDEN),
            "w2": jax.random.normal(k2, (HIDDEN, OUT)) / 6, "b2": jnp.zeros(OUT)}


def loss_fn(params, x, y):
    hidden = jax.nn.relu(x @ params["w1"] + params["b1"])
    return jnp.mean((hidden @ params["w2"] + params["b2"] - y) ** 2)


def train_step(params, opt_state, x, y):
    """The replica function: per-replica gradients, averaged, then one optimizer update."""
    ctx = jdist.get_replica_context()
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    grads = ctx.all_reduce("mean", grads)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, ctx.all_reduce("mean", loss)


@jax.jit
def reference_step(params, opt_state, x, y):
    """The same update on one device, from the mean loss over the whole global batch."""
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def global_batches(num, seed=0):
    """``num`` global batches (x, y) of a random linear teacher, as host arrays."""
    rng = np.random.default_rng(seed)
    teacher = (rng.normal(size=(IN, OUT)) / np.sqrt(IN)).astype(np.float32)  # Targets ~ N(0, 1).
    xs = rng.normal(size=(num, GLOBAL_BATCH, IN)).astype(np.float32)
    return xs, xs @ teacher


def distribute(strategy, *arrays, axis=0):
    """Splits every array into contiguous equal blocks along ``axis``, one per replica."""
    n = strategy.num_replicas_in_sync

    def value_fn(ctx):
        return tuple(np.split(a, n, axis=axis)[ctx.replica_id_in_sync_group] for a in arrays)
    return strategy.experimental_distribute_values_from_function(value_fn)


def fetch(tree):
    """``tree`` as NumPy arrays; `Mirrored` leaves become their common value (a PerReplica leaf
    raises: these tests expect every output to be equal on all replicas)."""
    return jax.tree.map(np.asarray, tree, is_leaf=lambda x: isinstance(x, jdist.Mirrored))


def assert_trees_close(actual, expected, rtol=1e-5, atol=1e-6):
    chex.assert_trees_all_close(fetch(actual), fetch(expected), rtol=rtol, atol=atol)


def test_thousands_of_steps_dispatched_back_to_back():
    # The regression test for the CPU runtime hang (shared/notes/cpu_simulated_devices.md):
    # collective programs dispatched back to back, as users write training loops, deadlock
    # there unless the strategy keeps them from overlapping. Nothing here waits between steps.
    strategy = mirrored(8)
    xs, ys = global_batches(4)
    batches = [distribute(strategy, x, y) for x, y in zip(xs, ys)]
    params = init_params()
    opt_state = OPTIMIZER.init(params)
    losses = []
    for i in range(3000):
        x, y = batches[i % len(batches)]
        params, opt_state, loss = strategy.run(train_step, args=(params, opt_state, x, y))
        losses.append(loss)
    assert isinstance(params["w1"], jdist.Mirrored)
    first = float(losses[0])
    last = float(np.mean([float(loss) for loss in losses[-20:]]))
    assert last < first / 100, (first, last)


@pytest.mark.parametrize("replicas", [1, 2, 4, 8])
def test_replicas_match_single_device_reference(replicas):
    # Equal per-replica batch sizes make the mean over replicas of per-replica mean gradients
    # the gradient of the global mean loss, so every replica count follows the same trajectory.
    strategy = mirrored(replicas)
    xs, ys = global_batches(20, seed=1)
    params = ref_params = init_params()
    opt_state = ref_opt_state = OPTIMIZER.init(params)
    for x, y in zip(xs, ys):
        params, opt_state, loss = strategy.run(
            train_step, args=(params, opt_state, *distribute(strategy, x, y)))
        ref_params, ref_opt_state, ref_loss = reference_step(ref_params, ref_opt_state, x, y)
    assert_trees_close(params, ref_params)
    assert_trees_close(opt_state, ref_opt_state)
    assert_trees_close(loss, ref_loss)


@pytest.mark.parametrize("replicas", [1, 8])
def test_scanned_steps_match_separate_runs(replicas):
    # Several steps per execution: one strategy.run that scans over K batches saves K-1
    # dispatches and must train exactly as K separate calls do.
    strategy = mirrored(replicas)
    xs, ys = global_batches(5, seed=2)

    def scanned_steps(params, opt_state, xs, ys):
        def body(carry, batch):
            params, opt_state, loss = train_step(*carry, *batch)
            return (params, opt_state), loss
        (params, opt_state), losses = lax.scan(body, (params, opt_state), (xs, ys))
        return params, opt_state, losses

    params = init_params()
    opt_state = OPTIMIZER.init(params)
    x_steps, y_steps = distribute(strategy, xs, ys, axis=1)  # Per replica: (5, batch, features).
    scan_params, scan_opt_state, scan_losses = strategy.run(
        scanned_steps, args=(params, opt_state, x_steps, y_steps))
    losses = []
    for x, y in zip(xs, ys):
        params, opt_state, loss = strategy.run(
            train_step, args=(params, opt_state, *distribute(strategy, x, y)))
        losses.append(loss)
    assert_trees_close(scan_params, params)
    assert_trees_close(scan_opt_state, opt_state)
    assert_trees_close(scan_losses, jnp.stack([jnp.asarray(loss) for loss in losses]))


def test_run_inside_user_jit_matches_eager():
    # Users wrap their step in their own jit (jdist.function: jax.jit behind the CPU dispatch
    # guard), or trace a whole loop into one program: strategy.run then runs inside an outer trace
    # and must compute what it computes eagerly.
    strategy = mirrored(8)
    xs, ys = global_batches(5, seed=3)
    batches = [distribute(strategy, x, y) for x, y in zip(xs, ys)]

    @jdist.function
    def train(params, opt_state, x, y):
        return strategy.run(train_step, args=(params, opt_state, x, y))

    @jdist.function
    def train_all(params, opt_state, batches):
        """Every step traced into one program: one launch for the whole loop."""
        for x, y in batches:
            params, opt_state, _ = strategy.run(train_step, args=(params, opt_state, x, y))
        return params, opt_state

    # Mirrored parameters (outputs of an eager step) and PerReplica batches go into the jit.
    params = init_params()
    params, opt_state, _ = strategy.run(
        train_step, args=(params, OPTIMIZER.init(params), *batches[0]))
    assert isinstance(params["w1"], jdist.Mirrored)
    eager = fetch(strategy.run(train_step, args=(params, opt_state, *batches[1])))
    jitted = train(params, opt_state, *batches[1])
    assert isinstance(jitted[0]["w1"], jdist.Mirrored)
    assert_trees_close(jitted, eager)

    eager_params, eager_opt_state = params, opt_state
    for x, y in batches:
        eager_params, eager_opt_state, _ = strategy.run(
            train_step, args=(eager_params, eager_opt_state, x, y))
    eager = fetch((eager_params, eager_opt_state))
    assert_trees_close(train_all(params, opt_state, batches), eager)


def test_jitted_and_eager_steps_dispatched_back_to_back_do_not_hang():
    # A user's jit around strategy.run is a collective program jdist does not launch itself:
    # jdist.function sends it through the same CPU guard, so mixing it with eager steps, with no
    # waiting in the loop, finishes (a plain jax.jit here aborts in the all-reduce rendezvous).
    strategy = mirrored(8)

    def step(w, x):
        return w - 0.01 * jdist.get_replica_context().all_reduce("mean", jnp.tanh(x @ w))
    train = jdist.function(lambda w, x: strategy.run(step, args=(w, x)))
    x = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.full((16, 16), ctx.replica_id_in_sync_group / 8, np.float32))
    w = eager = jnp.eye(16)
    for i in range(1500):
        w = train(w, x)
        eager = strategy.run(step, args=(eager, x))
    assert_trees_close(w, eager)
