"""Random custom training loops, written as TF's tutorial writes them, against TF's own.

Each seed draws a replica count, a data set size and a global batch size (so most last batches
are partial, some leave replicas empty), a small two-layer model, whether the loop's step is
compiled (``tf.function`` / ``jdist.function``) or eager, whether the remainder is dropped, and
a metric each replica returns (the mean of its per-example losses, NaN on an empty replica; its
row count; an all-reduced sum). Two epochs of TF's loop and of its literal port must give the
same losses, metrics and weights (to float32 rounding: TF's matmul and XLA's dot may differ in
the last bit). The seeds are fixed, so a failure reproduces with its seed.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdist

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from _tf_skip import tf_or_skip  # noqa: E402

tf = tf_or_skip()

from _tf_reference import strategies  # noqa: E402

SEEDS = range(16)
EPOCHS, LEARNING_RATE = 2, 0.1


def random_case(seed):
    """``(case, x, y, w1, w2)``: the loop's settings, the data and the initial weights."""
    rng = np.random.default_rng(seed)
    rows, features, hidden, outputs = (int(rng.integers(1, 40)), int(rng.integers(1, 5)),
                                       int(rng.integers(1, 5)), int(rng.integers(1, 3)))
    case = {"n": int(rng.choice([1, 2, 3, 4, 8])), "global_batch": int(rng.integers(1, 17)),
            "compiled": bool(rng.integers(2)), "drop_remainder": bool(rng.integers(4) == 0),
            "metric": ["mean", "rows", "all-reduced"][rng.integers(3)]}
    x = rng.normal(size=(rows, features)).astype(np.float32)
    y = rng.normal(size=(rows, outputs)).astype(np.float32)
    w1 = (rng.normal(size=(features, hidden)) * 0.5).astype(np.float32)
    w2 = (rng.normal(size=(hidden, outputs)) * 0.5).astype(np.float32)
    return case, x, y, w1, w2


def dataset(case, x, y):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(
        case["global_batch"], drop_remainder=case["drop_remainder"])


def tf_loop(strategy, case, x, y, w1, w2):
    """TF's tutorial loop: per-example loss averaged over the global batch, gradients
    all-reduced, SGD on mirrored variables; ``(losses and metrics per step, weights)``."""
    with strategy.scope():
        v1, v2 = tf.Variable(w1), tf.Variable(w2)

    def step(xb, yb):
        ctx = tf.distribute.get_replica_context()
        with tf.GradientTape() as tape:
            per_example = tf.reduce_sum((tf.tanh(xb @ v1) @ v2 - yb) ** 2, axis=1)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=case["global_batch"])
        g1, g2 = ctx.all_reduce("sum", tape.gradient(loss, [v1, v2]))
        v1.assign_sub(LEARNING_RATE * g1)
        v2.assign_sub(LEARNING_RATE * g2)
        metric = {"mean": lambda: tf.reduce_mean(per_example),
                  "rows": lambda: tf.cast(tf.shape(xb)[0], tf.float32),
                  "all-reduced": lambda: ctx.all_reduce("sum", tf.reduce_sum(per_example))}
        return loss, metric[case["metric"]]()

    def train_step(xb, yb):
        loss, metric = strategy.run(step, args=(xb, yb))
        return strategy.reduce("sum", loss, axis=None), strategy.experimental_local_results(metric)
    if case["compiled"]:
        train_step = tf.function(train_step)
    steps = [train_step(xb, yb) for _ in range(EPOCHS)
             for xb, yb in strategy.experimental_distribute_dataset(dataset(case, x, y))]
    return [(float(loss), [np.asarray(m) for m in metric]) for loss, metric in steps], [
        v1.numpy(), v2.numpy()]


def jdist_loop(strategy, case, x, y, w1, w2):
    """`tf_loop` ported: jax.grad for the tape, arrays for the variables."""
    def step(params, xb, yb):
        ctx = jdist.get_replica_context()

        def loss_fn(params):
            per_example = jnp.sum((jnp.tanh(xb @ params[0]) @ params[1] - yb) ** 2, axis=1)
            return jdist.nn.compute_average_loss(
                per_example, global_batch_size=case["global_batch"]), per_example
        (loss, per_example), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        grads = ctx.all_reduce("sum", grads)
        params = [p - LEARNING_RATE * g for p, g in zip(params, grads)]
        metric = {"mean": lambda: jnp.mean(per_example),
                  "rows": lambda: jnp.float32(xb.shape[0]),
                  "all-reduced": lambda: ctx.all_reduce("sum", jnp.sum(per_example))}
        return params, loss, metric[case["metric"]]()

    def train_step(params, xb, yb):
        params, loss, metric = strategy.run(step, args=(params, xb, yb))
        return params, strategy.reduce("sum", loss, axis=None), metric
    if case["compiled"]:
        train_step = jdist.function(train_step)
    params, steps = [jnp.asarray(w1), jnp.asarray(w2)], []
    for _ in range(EPOCHS):
        for xb, yb in strategy.experimental_distribute_dataset(dataset(case, x, y)):
            params, loss, metric = train_step(params, xb, yb)
            steps.append((float(loss), [np.asarray(m)
                                        for m in strategy.experimental_local_results(metric)]))
    return steps, [np.asarray(p) for p in jdist.to_host(params)]


@pytest.mark.parametrize("seed", SEEDS)
def test_random_training_loops_are_tfs(seed):
    case, *data = random_case(seed)
    strategy, tf_strategy = strategies(case["n"])
    if tf_strategy is None:
        pytest.skip("TensorFlow was initialised before its logical CPU devices were configured.")
    steps, weights = jdist_loop(strategy, case, *data)
    tf_steps, tf_weights = tf_loop(tf_strategy, case, *data)
    assert len(steps) == len(tf_steps), case
    for (loss, metric), (tf_loss, tf_metric) in zip(steps, tf_steps):
        np.testing.assert_allclose(loss, tf_loss, rtol=1e-5, atol=1e-6, err_msg=str(case))
        np.testing.assert_allclose(metric, tf_metric, rtol=1e-5, atol=1e-6, equal_nan=True,
                                   err_msg=str(case))
    for w, tf_w in zip(weights, tf_weights):
        np.testing.assert_allclose(w, tf_w, rtol=1e-5, atol=1e-6, err_msg=str(case))
