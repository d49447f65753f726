"""Exact uneven values: each replica computes with its own shapes, as tf.distribute does.

The reference for every number is NumPy, per replica, with TF's split rule: a global batch of B
rows gives consecutive chunks of ceil(B / N) rows, trailing replicas getting fewer or none.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jdist
from jdist import errors
from jdist.testing import REPLICA_COUNTS, assert_local_results, count_compiles, mirrored, per_replica
from jdist.testing import mirrored_reducing_to_one_device

GLOBAL_BATCH, FEATURES, CLASSES, LR = 16, 5, 3, 0.5


def tf_split(batch, n):
    rows = -(-len(batch) // n)
    return [batch[min(i * rows, len(batch)):min((i + 1) * rows, len(batch))] for i in range(n)]


# ------------------------------------------- TF's custom training loop, ported literally
def train_step(params, x, y):
    """TF's tutorial step: per-example loss summed and divided by the GLOBAL batch size."""
    def loss_fn(p):
        logits = x @ p["w"] + p["b"]
        per_example = -jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1)[:, 0]
        return jdist.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    grads = jdist.get_replica_context().all_reduce("sum", grads)
    params = jax.tree_util.tree_map(lambda p, g: p - LR * g, params, grads)
    predictions = jnp.argmax(x @ params["w"] + params["b"], axis=-1)
    accuracy = jnp.mean((predictions == y).astype(jnp.float32))  # NaN on an empty replica.
    return params, loss, grads, accuracy, jnp.int32(y.shape[0])  # A tensor, as tf.shape.


def numpy_step(params, x, y, n):
    """The same step computed independently, replica by replica, in float64."""
    losses, grads = [], []
    for xr, yr in zip(tf_split(x, n), tf_split(y, n)):
        logits = xr @ params["w"] + params["b"]
        logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1,
                                                                                 keepdims=True))
        logp -= logits.max(-1, keepdims=True)
        losses.append(-logp[np.arange(len(yr)), yr].sum() / GLOBAL_BATCH)
        delta = (np.exp(logp) - np.eye(CLASSES)[yr]) / GLOBAL_BATCH
        grads.append({"w": xr.T @ delta, "b": delta.sum(0)})
    total = {k: sum(g[k] for g in grads) for k in params}
    params = {k: params[k] - LR * total[k] for k in params}
    accuracy = []
    for xr, yr in zip(tf_split(x, n), tf_split(y, n)):
        correct = np.argmax(xr @ params["w"] + params["b"], -1) == yr
        accuracy.append(correct.mean() if len(yr) else np.nan)
    return params, losses, total, accuracy


@pytest.mark.parametrize("compiled", [False, True], ids=["run", "jdist.function"])
@pytest.mark.parametrize("n", REPLICA_COUNTS)
def test_tf_custom_training_loop_ported_literally_matches_numpy(n, compiled):
    s = mirrored(n)
    step = lambda *args: s.run(train_step, args=args)  # noqa: E731
    if compiled:  # TF's tutorial step is a tf.function; it retraces for the partial batch.
        step = jdist.function(step)
    rng = np.random.default_rng(n)
    rows = 2 * GLOBAL_BATCH + 3  # The last batch has 3 rows: replicas 3.. of 4 or 8 get none.
    x = rng.normal(size=(rows, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=rows).astype(np.int32)
    dataset = s.experimental_distribute_dataset(
        s.experimental_make_numpy_dataset((x, y)).batch(GLOBAL_BATCH))
    params = {"w": jnp.zeros((FEATURES, CLASSES)), "b": jnp.zeros((CLASSES,))}
    reference = {"w": np.zeros((FEATURES, CLASSES)), "b": np.zeros(CLASSES)}
    for i, (xb, yb) in enumerate(dataset):
        rows_i = slice(i * GLOBAL_BATCH, (i + 1) * GLOBAL_BATCH)
        params, loss, grads, accuracy, seen = step(params, xb, yb)
        reference, losses, total, want_accuracy = numpy_step(
            reference, x[rows_i].astype(np.float64), y[rows_i], n)
        assert_local_results(s, loss, losses)
        np.testing.assert_allclose(s.reduce("sum", loss, axis=None), sum(losses), atol=1e-6)
        for key in params:
            np.testing.assert_allclose(np.asarray(grads[key]), total[key], atol=1e-6)
            np.testing.assert_allclose(np.asarray(params[key]), reference[key], atol=1e-6)
        assert_local_results(s, accuracy, want_accuracy)
        assert int(s.reduce("sum", seen, axis=None)) == len(y[rows_i])


# ------------------------------------------------------------------ ragged values in run
@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_each_replica_sees_its_true_shape_and_an_empty_mean_is_nan(n):
    s = mirrored(n)
    comps = [np.arange(i % 3, dtype=np.float32) + i for i in range(n)]  # Sizes 0, 1, 2, 0, ...
    v = per_replica(s, comps)
    rows, mean, doubled = s.run(lambda x: (x.shape[0], jnp.mean(x), x * 2), args=(v,))
    assert_local_results(s, rows, [len(c) for c in comps])
    assert_local_results(s, mean, [c.mean() if len(c) else np.nan for c in comps])
    assert_local_results(s, doubled, [c * 2 for c in comps])


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_an_all_reduce_of_values_computed_from_shapes_alone(n):
    # TF users count the global examples as an all-sum of each replica's row count: a piece
    # that reads no array, only its replica's shape, still runs on its replica's device.
    s = mirrored(n)
    comps = [np.ones((i % 3, 2), np.float32) for i in range(n)]  # Sizes 0, 1, 2, 0, ...

    def step(x):
        ctx = jdist.get_replica_context()
        return (ctx.all_reduce("sum", jnp.float32(x.shape[0])),
                ctx.all_reduce("mean", jnp.full((2,), x.shape[0], jnp.float32)))
    total, mean = s.run(step, args=(per_replica(s, comps),))
    rows = [len(c) for c in comps]
    assert_local_results(s, total, [float(sum(rows))] * n)
    assert_local_results(s, mean, [np.full(2, np.mean(rows), np.float32)] * n)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_reduce_with_an_axis_and_gather_combine_ragged_values(n):
    s = mirrored(n)
    rng = np.random.default_rng(0)
    comps = [rng.normal(size=(i % 3, 2)).astype(np.float32) for i in range(n)]
    v = per_replica(s, comps)
    every = np.concatenate(comps)
    np.testing.assert_allclose(s.reduce("mean", v, axis=0), every.mean(0), rtol=1e-6)
    np.testing.assert_allclose(s.reduce("sum", v, axis=(0, 1)), every.sum(), rtol=1e-5)
    np.testing.assert_array_equal(s.gather(v, 0), every)
    with pytest.raises(errors.ShapeMismatchError):
        s.reduce("sum", v, axis=None)  # Element-wise needs one shape (TF raises too).


def test_ragged_in_any_dimension_gathers_along_axis_1():
    s = mirrored(3)
    v = s.experimental_distribute_values_from_function(
        lambda ctx: np.full((2, ctx.replica_id_in_sync_group + 1), ctx.replica_id_in_sync_group,
                            np.float32))
    assert v.ragged
    want = np.array([[0, 1, 1, 2, 2, 2]] * 2, np.float32)
    np.testing.assert_array_equal(s.gather(v, 1), want)
    gathered = s.run(lambda x: jdist.get_replica_context().all_gather(x, 1), args=(v,))
    assert_local_results(s, gathered, [want] * 3)
    with pytest.raises(errors.ShapeMismatchError):
        s.gather(v, 0)  # Axis 1 differs, so axis 0 cannot be concatenated.


@pytest.mark.parametrize("n", [2, 3, 8])
def test_all_gather_along_axis_0_has_the_true_size(n):
    s = mirrored(n)
    comps = [np.arange(i % 3, dtype=np.float32) + 10 * i for i in range(n)]
    out = s.run(lambda x: jdist.get_replica_context().all_gather(x * 2, 0),
                args=(per_replica(s, comps),))
    assert_local_results(s, out, [np.concatenate(comps) * 2] * n)


@pytest.mark.parametrize("n", REPLICA_COUNTS)
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_all_gather_gradient_is_tfs_all_sum_of_the_upstream_gradients_own_rows(n, axis):
    # TF's all_gather gradient: all_reduce SUM of every replica's upstream gradient, of which a
    # replica takes the rows it contributed (replicas of one shape share a trace, not rows).
    # TF's default ops take no negative gather axis on several devices; ReductionToOneDevice does.
    s = mirrored(n) if axis >= 0 or n == 1 else mirrored_reducing_to_one_device(n)
    rng = np.random.default_rng(n)
    sizes = [(2, 1, 1, 0, 3, 2, 1, 0)[i] for i in range(n)]
    comps = [rng.normal(size=(k, 3) if axis == 0 else (3, k)).astype(np.float32) for k in sizes]
    weights = [rng.normal(size=()).astype(np.float32) for _ in range(n)]

    def step(x, w):
        gathered = lambda x: jdist.get_replica_context().all_gather(x, axis)
        return jax.grad(lambda x: jnp.sum(gathered(x) ** 2) * w)(x)
    out = s.run(step, args=(per_replica(s, comps), per_replica(s, weights)))
    upstream = 2 * np.concatenate(comps, axis=axis) * np.sum(weights)
    starts = np.cumsum([0] + sizes)
    assert_local_results(s, out, [np.take(upstream, np.arange(starts[r], starts[r + 1]), axis)
                                  for r in range(n)], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [2, 3, 8])
def test_even_per_replica_arguments_beside_ragged_ones_reach_their_replica(n):
    s = mirrored(n)
    comps = [np.arange(i % 3, dtype=np.float32) for i in range(n)]
    scales = [np.full((2,), i + 1, np.float32) for i in range(n)]

    def step(x, scale, unused):
        return jnp.sum(x) * scale, jdist.get_replica_context().all_reduce("sum", scale)
    scaled, total = s.run(step, args=(per_replica(s, comps), per_replica(s, scales),
                                      per_replica(s, [np.ones((3, 1), np.float32)] * n)))
    assert_local_results(s, scaled, [np.sum(c) * k for c, k in zip(comps, scales)])
    assert_local_results(s, total, [np.sum(scales, axis=0)] * n)


def test_merge_call_runs_once_on_the_true_values():
    s = mirrored(3)
    comps = [np.array([5., 6.], np.float32), np.array([7.], np.float32),
             np.zeros(0, np.float32)]
    calls = []

    def merge_fn(strategy, x, scale):
        calls.append(scale)
        assert jdist.in_cross_replica_context()
        return strategy.reduce("mean", x, axis=0) * scale, x, "tag"

    def step(x):
        mean, back, tag = jdist.get_replica_context().merge_call(merge_fn, args=(x,),
                                                                 kwargs={"scale": 2})
        assert tag == "tag"  # Python objects pass through.
        return mean, back
    mean, back = s.run(step, args=(per_replica(s, comps),))
    assert len(calls) == 1
    assert_local_results(s, mean, [12.0] * 3)  # The same on every replica: Mirrored.
    assert isinstance(mean, jdist.Mirrored)
    assert_local_results(s, back, comps)


def test_a_collective_inside_an_inner_jit_is_cut_too():
    s = mirrored(2)
    total = jax.jit(lambda x: jdist.get_replica_context().all_reduce("sum", jnp.sum(x)))
    v = per_replica(s, [np.ones(2, np.float32), np.ones(1, np.float32)])
    out = s.run(lambda x: total(x) / 3, args=(v,))
    assert_local_results(s, out, [1.0, 1.0])


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("merge", ["all_gather", "merge_call"])
def test_a_merge_inside_an_inner_jit_is_traced_anew_for_every_split(n, merge):
    # jax.jit reuses a jaxpr it traced for the same argument types, but a merge's result shape
    # depends on the other replicas' rows: an even step, another split or another replica of
    # the same rows must not lend it theirs (this raised, or failed with a KeyError).
    def gathered(x):
        ctx = jdist.get_replica_context()
        if merge == "all_gather":
            return ctx.all_gather(x, 0)
        return ctx.merge_call(lambda strategy, v: strategy.gather(v, 0), args=(x,))

    @jax.jit
    def weighted_total(x):
        g = gathered(x)
        return jnp.sum(g[:, 0] * jnp.arange(1, g.shape[0] + 1)), g.shape[0]

    s = mirrored(n)
    splits = [[2] * n, [2] * (n - 1) + [1], [1] + [2] * (n - 1), [2, 0] + [1] * (n - 2)]
    for k, rows in enumerate(splits):
        comps = [np.full((r, 1), 10 * k + i + 1, np.float32) for i, r in enumerate(rows)]
        total, size = s.run(weighted_total, args=(per_replica(s, comps),))
        g = np.concatenate(comps)[:, 0]
        assert_local_results(s, total, [np.sum(g * np.arange(1, g.size + 1))] * n)
        assert_local_results(s, size, [g.size] * n)


def test_distribute_datasets_from_function_with_different_inner_sizes():
    s = mirrored(2)
    batches = [np.full(shape, fill, np.float32)
               for shape, fill in [((2, 3), 1), ((1, 4), 2), ((3, 3), 3)]]
    first, second = list(s.distribute_datasets_from_function(lambda ctx: batches))
    assert [c.shape for c in first.values] == [(2, 3), (1, 4)]
    with pytest.raises(errors.ShapeMismatchError):
        s.gather(first, 0)  # Their inner sizes differ.
    assert s.reduce("sum", first, axis=(0, 1)) == 6 + 8
    assert [c.shape for c in second.values] == [(3, 3), (0, 3)]  # Replica 1 ran out: empty.
    np.testing.assert_array_equal(s.gather(second, 0), batches[2])


# --------------------------------------------------------------------- what raises, and why
def test_all_reduce_of_different_shapes_raises_before_any_collective():
    s = mirrored(2)
    v = per_replica(s, [np.ones(2, np.float32), np.ones(1, np.float32)])
    with pytest.raises(errors.ShapeMismatchError, match="all_reduce"):
        s.run(lambda x: jdist.get_replica_context().all_reduce("sum", x), args=(v,))


def test_a_collective_inside_scan_with_uneven_inputs_raises():
    s = mirrored(2)
    v = per_replica(s, [np.ones(2, np.float32), np.ones(1, np.float32)])

    def step(x):
        ctx = jdist.get_replica_context()
        return lax.scan(lambda c, _: (ctx.all_reduce("sum", c), None), jnp.sum(x), None, 2)[0]
    with pytest.raises(errors.UnevenValuesError, match="drop_remainder"):
        s.run(step, args=(v,))


@pytest.mark.parametrize("jit_kwargs", [{}, {"static_argnums": 2}, {"donate_argnums": 0}])
@pytest.mark.parametrize("n", [2, 3, 8])
def test_a_compiled_function_takes_full_and_partial_batches_in_turn(n, jit_kwargs):
    s = mirrored(n)
    even = [np.arange(2, dtype=np.float32) + i for i in range(n)]
    ragged = [np.arange(i % 3, dtype=np.float32) + i for i in range(n)]  # Rows 0, 1, 2, 0, ...

    def total(w, x, k):
        return s.reduce("sum", s.run(lambda w, x, k: w + k * jnp.sum(x), args=(w, x, k)),
                        axis=None)
    compiled = jdist.function(total, **jit_kwargs)
    for comps in (even, ragged, even, ragged):
        got = compiled(jnp.float32(1), per_replica(s, comps), 2.0)
        np.testing.assert_allclose(got, sum(1 + 2 * c.sum() for c in comps), rtol=1e-6)
    with pytest.raises(errors.UnevenValuesError, match="no compiled program"):
        compiled.lower(jnp.float32(1), per_replica(s, ragged), 2.0)


def test_run_on_uneven_values_a_compiled_function_captures_raises():
    s = mirrored(2)
    v = per_replica(s, [np.ones(2, np.float32), np.ones(1, np.float32)])
    with pytest.raises(errors.UnevenValuesError, match="as arguments"):
        jdist.function(lambda: s.run(lambda x: jnp.sum(x), args=(v,)))()


def test_run_on_uneven_values_inside_a_scan_of_a_compiled_function_raises():
    """Such arguments make jdist.function run its function as Python; a scan there still
    traces ``run``, which cannot give each replica its own shape."""
    s = mirrored(2)
    v = per_replica(s, [np.ones(2, np.float32), np.ones(1, np.float32)])

    def loop(w, v):
        return lax.scan(lambda w, _: (s.run(lambda w, x: w + jnp.sum(x), args=(w, v)), None),
                        w, None, length=2)[0]
    with pytest.raises(errors.UnevenValuesError, match="drop_remainder"):
        jdist.function(loop)(jnp.float32(0), v)


# ----------------------------------------------------------------------- compile once
@pytest.mark.parametrize("compiled", [False, True], ids=["run", "jdist.function"])
def test_a_partial_batch_compiles_once_per_split_not_per_epoch(compiled):
    s = mirrored(4)
    data = np.arange(22, dtype=np.float32)  # Batches of 8, 8 and 6: the last split 2, 2, 2, 0.
    dist = s.experimental_distribute_dataset(s.experimental_make_numpy_dataset(data).batch(8))
    traces = []

    def step(x):
        traces.append(x.shape)
        return jdist.get_replica_context().all_reduce("sum", jnp.sum(x))
    total = lambda b: s.run(step, args=(b,))  # noqa: E731
    if compiled:
        total = jdist.function(total)
    totals, compiles = [], []
    for _ in range(3):
        with count_compiles() as epoch_compiles:
            totals.append([float(jnp.asarray(total(b))) for b in dist])
        compiles.append(len(epoch_compiles))
    assert totals == [[28.0, 92.0, 111.0]] * 3
    assert sorted(set(traces)) == [(0,), (2,)] and len(traces) == 2 + 1  # Full; ceil; empty.
    assert compiles[1:] == [0, 0]  # Every XLA compile happens in the first epoch.


def test_a_partial_batch_compiles_as_often_on_any_replica_count():
    """Each piece of an exact step compiles once over the whole mesh for every per-replica
    shape (ceil, floor), not once per device: the count is the same on 3, 4 and 8 replicas."""
    def step(w, x):  # One cut (the all-reduce): a piece before it and one after.
        grad = jdist.get_replica_context().all_reduce("sum", jnp.sum(x * w, axis=0))
        return w - 0.5 * grad, jnp.mean(x)
    counts = {}
    for n in (3, 4, 8):
        s, rng = mirrored(n), np.random.default_rng(n)
        rows = [2] * (n // 2) + [1] * (n - n // 2)  # Two distinct shapes.
        xs = [rng.normal(size=(k, 3)).astype(np.float32) for k in rows]
        w = np.float32([0.5, -1.0, 2.0])
        with count_compiles() as compiles:
            new_w, means = s.run(step, args=(w, per_replica(s, xs)))
        counts[n] = len(compiles)
        want = w - 0.5 * sum((x * w).sum(axis=0) for x in xs)
        np.testing.assert_allclose(np.asarray(new_w), want, rtol=1e-6)
        assert_local_results(s, means, [x.mean() for x in xs])
    assert counts[3] == counts[4] == counts[8], counts


@pytest.mark.parametrize("n", [3, 4, 8])
def test_per_replica_prng_keys_of_uneven_sizes(n):
    """Typed keys (``jax.random.key``) split per replica row, uneven like the rows: each replica
    draws from its own keys, and the sum of the draws is all-reduced."""
    s = mirrored(n)
    sizes = [2] * (n // 2) + [1] * (n - n // 2)
    keys = [jax.random.split(jax.random.key(r), k) for r, k in enumerate(sizes)]
    draw = jax.vmap(lambda key: jax.random.normal(key, (3,)))

    def step(k):
        total = jdist.get_replica_context().all_reduce("sum", jnp.sum(draw(k)))
        return total, jax.vmap(lambda key: jax.random.split(key)[0])(k)
    total, next_keys = s.run(step, args=(per_replica(s, keys),))
    np.testing.assert_allclose(float(total), sum(float(np.sum(draw(k))) for k in keys),
                               rtol=1e-5)
    assert [jax.random.key_data(v).shape for v in s.experimental_local_results(next_keys)] == [
        (k, 2) for k in sizes]


@pytest.mark.parametrize("n", [2, 3, 8])
def test_all_reduce_of_a_python_number_in_an_uneven_step(n):
    """``all_reduce("sum", x.shape[0])``: the operand is a number the trace folds in, different
    per replica; it crashed the exact plan's piece that hands it to the collective."""
    s = mirrored(n)
    rows = [3, 0] + [1] * (n - 2)
    v = per_replica(s, [np.ones((r, 2), np.float32) for r in rows])
    total, scaled = s.run(lambda x: (jdist.get_replica_context().all_reduce("sum", x.shape[0]),
                                     x.sum() / jdist.get_replica_context().all_reduce("sum", 2)),
                          args=(v,))
    assert_local_results(s, total, [sum(rows)] * n, 0, 0)
    assert_local_results(s, scaled, [np.float32(2 * r) / np.float32(2 * n) for r in rows], 0, 0)


@pytest.mark.parametrize("n", [2, 3, 8])
def test_merge_call_of_python_numbers_that_differ_between_replicas(n):
    """``merge_call(fn, args=(x.shape[0],))`` on a partial batch: TF regroups the replicas'
    different numbers into a PerReplica (of int32 tensors); equal numbers stay one number."""
    s = mirrored(n)
    rows = [3, 0] + [1] * (n - 2)
    v = per_replica(s, [np.ones((r, 2), np.float32) for r in rows])
    seen = []

    def merge_fn(strategy, count, same):
        seen.append((type(count).__name__, same))
        return strategy.reduce("sum", count, axis=None)
    total = s.run(lambda x: jdist.get_replica_context().merge_call(
        merge_fn, args=(x.shape[0], 7)), args=(v,))
    assert seen == [("PerReplica", 7)]
    assert isinstance(total, jdist.Mirrored)  # merge_fn's plain array: every replica's.
    assert_local_results(s, total, [sum(rows)] * n)
    assert all(r.dtype == np.int32 for r in s.experimental_local_results(total))


@pytest.mark.parametrize("n", [2, 3, 8])
def test_a_collective_inside_jax_checkpoint_is_computed_as_without_it(n):
    """``jax.checkpoint`` (flax's ``nn.remat``) only chooses what the backward pass recomputes:
    an uneven step with a collective inside one gives the numbers of the same step without it.
    It raised UnevenValuesError (the call was not inlined)."""
    s = mirrored(n)
    rows = [3, 0] + [1] * (n - 2)
    v = per_replica(s, [np.arange(2 * r, dtype=np.float32).reshape(r, 2) for r in rows])

    def step(remat):
        def loss(w, x):
            return jdist.get_replica_context().all_reduce("sum", jnp.sum(x * w)) ** 2
        loss = jax.checkpoint(loss) if remat else loss
        return lambda x: jax.value_and_grad(loss)(jnp.float32(2), x)
    got, want = (s.run(step(remat), args=(v,)) for remat in (True, False))
    for g, w in zip(got, want):
        assert_local_results(s, g, s.experimental_local_results(w), 0, 0)
    total = sum(float(np.arange(2 * r).sum()) for r in rows)
    assert_local_results(s, got[1], [4 * total * n * np.arange(2 * r).sum() for r in rows], 0, 0)


@pytest.mark.parametrize("n", [2, 3, 8])
@pytest.mark.parametrize("compiled", [False, True])
def test_a_reduction_without_identity_on_an_empty_replica_says_the_batch_is_empty(n, compiled):
    """TF's ``reduce_max`` of a replica's empty batch is -inf; JAX's ``jnp.max`` raises. The
    error keeps JAX's type and gains a note naming the empty replica and the fix, which then
    gives TF's numbers."""
    s = mirrored(n)
    rows = [3] + [0] * (n - 1)
    v = per_replica(s, [np.arange(r * 2, dtype=np.float32).reshape(r, 2) for r in rows])
    run = (lambda f: jdist.function(lambda x: s.run(f, args=(x,)))) if compiled else (
        lambda f: lambda x: s.run(f, args=(x,)))
    with pytest.raises(ValueError, match="zero-size") as raised:
        run(jnp.max)(v)
    assert any("replica 1 ran on an empty batch" in note and "initial=" in note
               for note in raised.value.__notes__)
    got = run(lambda x: jnp.max(x, initial=-jnp.inf))(v)
    assert_local_results(s, got, [np.float32(5)] + [np.float32(-np.inf)] * (n - 1), 0, 0)
