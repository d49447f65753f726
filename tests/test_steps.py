"""K steps in one program (issue 50): `DistributedIterator.get_next_steps` and a scan inside the
replica function, against K separate `run` calls and NumPy; a scan, vmap, tree_map or index over
a `PerReplica` outside `run` (which would cut across replicas) raises."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jdist
from jdist.testing import REPLICA_COUNTS, mirrored

ROWS, BATCH, LR = 101, 24, 0.1  # Four full batches (even on 1, 2, 3, 4, 8), a partial one.


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(ROWS, 3)).astype(np.float32), rng.normal(size=(ROWS,)).astype(
        np.float32)


def _step(w, x, y):
    def loss(w):
        return jdist.nn.compute_average_loss((x @ w - y) ** 2, global_batch_size=BATCH)
    grads = jdist.get_replica_context().all_reduce("sum", jax.grad(loss)(w))
    return w - LR * grads


def _numpy_reference(x, y):
    w = np.zeros(3, np.float64)
    for start in range(0, ROWS, BATCH):
        xb, yb = x[start:start + BATCH], y[start:start + BATCH]
        w = w - LR * 2 / BATCH * xb.T @ (xb @ w - yb)
    return w


def _iterator(s):
    x, y = _data()
    return iter(s.experimental_distribute_dataset(
        s.experimental_make_numpy_dataset((x, y)).batch(BATCH)))


@pytest.mark.parametrize("n", REPLICA_COUNTS)
@pytest.mark.parametrize("k", [1, 3, 4])
def test_k_steps_in_one_program_are_k_runs(n, k):
    s = mirrored(n)
    k_steps = jdist.function(lambda w, xs, ys: s.run(
        lambda w, xs, ys: lax.scan(lambda w, b: (_step(w, *b), None), w, (xs, ys))[0],
        args=(w, xs, ys)))
    w_group, it, sizes = jdist.mirror(jnp.zeros(3, jnp.float32), s), _iterator(s), []
    while True:
        try:
            xs, ys = it.get_next_steps(k)
        except jdist.errors.OutOfRangeError:
            break
        sizes.append(s.gather(xs, axis=1).shape[:2])  # (steps, rows of the global batch).
        w_group = k_steps(w_group, xs, ys) if sizes[-1][1] == BATCH else s.run(
            lambda w, xs, ys: _step(w, xs[0], ys[0]),  # The partial batch, alone: one step,
            args=(w_group, xs, ys))  # exact, as a scan with collectives cannot run it.
    w_runs = jdist.mirror(jnp.zeros(3, jnp.float32), s)
    for x, y in _iterator(s):
        w_runs = s.run(_step, args=(w_runs, x, y))
    full = ROWS // BATCH
    assert sizes == [(min(k, full - i), BATCH) for i in range(0, full, k)] + [(1, ROWS % BATCH)]
    np.testing.assert_allclose(np.asarray(w_group), np.asarray(w_runs), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(w_group), _numpy_reference(*_data()), rtol=2e-5,
                               atol=1e-6)


@pytest.mark.parametrize("n, k", [(2, 2), (4, 4), (8, 4), (3, 2)])
@pytest.mark.parametrize("how", ["scan", "vmap", "tree_map", "fori_loop", "index"])
def test_slicing_a_per_replica_outside_run_raises(n, k, how):
    # Its stacked array has the replicas first: lax.scan over it ran the replicas as steps
    # (transposed data, no error, when k == n), or failed inside shard_map.
    s = mirrored(n)
    xs = s.experimental_distribute_values_from_function(
        lambda ctx: np.full((k, 2), ctx.replica_id_in_sync_group, np.float32))
    run = lambda x: s.run(lambda v: v * 2, args=(x,))  # noqa: E731
    slicers = {
        "scan": lambda xs: lax.scan(lambda c, x: (c, run(x)), 0.0, xs),
        "vmap": lambda xs: jax.vmap(run)(xs),
        "tree_map": lambda xs: run(jax.tree_util.tree_map(lambda a: a[0], xs)),
        "fori_loop": lambda xs: lax.fori_loop(0, k, lambda i, c: c + 1.0, 0.0) + run(xs[0]),
        "index": lambda xs: run(xs[0]),
    }
    error = (jdist.errors.CrossReplicaArithmeticError if how in ("index", "fori_loop")
             else jdist.errors.InvalidArgumentError)
    with pytest.raises(error, match="get_next_steps"):
        jdist.function(slicers[how])(xs)


def test_get_next_steps_needs_a_step():
    with pytest.raises(jdist.errors.InvalidArgumentError, match="num_steps >= 1"):
        _iterator(mirrored(2)).get_next_steps(0)
