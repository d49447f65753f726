"""SEMANTICS.md, ReplicaContext: all_reduce, all_gather and merge_call inside strategy.run."""

import hypothesis
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdist
from jdist import errors
from jdist.testing import REPLICA_COUNTS, assert_local_results, mirrored, per_replica


def replica_id():
    return jdist.get_replica_context().replica_id_in_sync_group


def test_all_reduce_example_from_the_tf_docs():
    s = mirrored(2)
    v = per_replica(s, [{"a": np.float32(1), "b": np.array([40., 1.], np.float32)},
                        {"a": np.float32(3), "b": np.array([2., 98.], np.float32)}])
    total = s.run(lambda x: jdist.get_replica_context().all_reduce("sum", x), args=(v,))
    mean = s.run(lambda x: jdist.get_replica_context().all_reduce("mean", x), args=(v,))
    assert float(total["a"]) == 4 and total["b"].value.tolist() == [42, 99]
    assert float(mean["a"]) == 2 and mean["b"].value.tolist() == [21, 49.5]


@pytest.mark.parametrize("n", REPLICA_COUNTS)
def test_all_reduce_result_is_the_same_on_every_replica_and_mirrored(n):
    s = mirrored(n)
    out = s.run(lambda: jdist.get_replica_context().all_reduce("sum", jnp.float32(replica_id())))
    if n > 1:
        assert isinstance(out, jdist.Mirrored)
    assert_local_results(s, out, [n * (n - 1) / 2] * n)


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(n=st.sampled_from(REPLICA_COUNTS), op=st.sampled_from(["sum", "mean"]),
                  shape=hnp.array_shapes(min_dims=0, max_dims=3, max_side=4), data=st.data())
def test_property_all_reduce_matches_numpy(n, op, shape, data):
    s = mirrored(n)
    comps = [data.draw(hnp.arrays(np.float32, shape, elements=st.floats(-1e3, 1e3, width=32)))
             for _ in range(n)]
    v = per_replica(s, comps) if n > 1 else comps[0]
    out = s.run(lambda x: jdist.get_replica_context().all_reduce(op, x), args=(v,))
    expected = np.sum(comps, axis=0) / (n if op == "mean" else 1)
    assert_local_results(s, out, [expected] * n, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("n", [2, 3])
def test_gradient_of_all_sum_is_all_sum_of_upstream_gradients(n):
    s = mirrored(n)
    w = per_replica(s, [np.array([i + 1., 2 * i], np.float32) for i in range(n)])

    def fn(w):
        ctx = jdist.get_replica_context()
        return jax.grad(lambda x: jnp.sum(ctx.all_reduce("sum", x) * w))(jnp.ones(2))
    expected = np.sum([[i + 1., 2 * i] for i in range(n)], axis=0)
    assert_local_results(s, s.run(fn, args=(w,)), [expected] * n)


@pytest.mark.parametrize("n", REPLICA_COUNTS)
@pytest.mark.parametrize("axis", [0, 1])
def test_all_gather_concatenates_on_every_replica(n, axis):
    s = mirrored(n)
    comps = [np.arange(4, dtype=np.float32).reshape(2, 2) + 10 * i for i in range(n)]
    v = per_replica(s, comps) if n > 1 else comps[0]
    out = s.run(lambda x: jdist.get_replica_context().all_gather(x, axis), args=(v,))
    assert_local_results(s, out, [np.concatenate(comps, axis=axis)] * n)


@pytest.mark.parametrize("n", [1, 3])
def test_all_gather_takes_tfs_options_argument(n):
    s = mirrored(n)
    comps = [np.full((2,), i, np.float32) for i in range(n)]
    options = jdist.CommunicationOptions(bytes_per_pack=4)
    out = s.run(lambda x: jdist.get_replica_context().all_gather(x, 0, options=options),
                args=(per_replica(s, comps),))
    assert_local_results(s, out, [np.concatenate(comps)] * n)
    with pytest.raises(errors.InvalidArgumentError, match="CommunicationOptions"):
        s.run(lambda x: jdist.get_replica_context().all_gather(x, 0, options="ring"),
              args=(per_replica(s, comps),))


OPTIONS_TAKERS = {
    "all_reduce": lambda s, v, o: s.run(
        lambda x: jdist.get_replica_context().all_reduce("sum", x, options=o), args=(v,)),
    "all_gather": lambda s, v, o: s.run(
        lambda x: jdist.get_replica_context().all_gather(x, 0, options=o), args=(v,)),
    "batch_reduce_to": lambda s, v, o: s.extended.batch_reduce_to("sum", [(v, v)], options=o),
}


@pytest.mark.parametrize("options", ["ring", jdist.CommunicationOptions])
@pytest.mark.parametrize("call", list(OPTIONS_TAKERS))
@pytest.mark.parametrize("n", [1, 3])
def test_options_that_are_not_communication_options_raise_on_any_replica_count(n, call, options):
    s = mirrored(n)
    with pytest.raises(errors.InvalidArgumentError, match="CommunicationOptions"):
        OPTIONS_TAKERS[call](s, per_replica(s, [np.ones(2, np.float32)] * n), options)


@pytest.mark.parametrize("n", REPLICA_COUNTS)
def test_merge_call_sees_per_replica_values_in_cross_replica_context(n):
    s = mirrored(n)
    seen = {}

    def merge_fn(strategy, value, scale=1.0):
        seen["cross"] = jdist.in_cross_replica_context()
        seen["type"] = type(value)
        return strategy.reduce("sum", value, axis=None) * scale

    def fn():
        x = jnp.float32(replica_id() + 1)
        return jdist.get_replica_context().merge_call(merge_fn, args=(x,), kwargs={"scale": 2.0})
    out = s.run(fn)
    assert seen["cross"]
    assert seen["type"] is jdist.PerReplica or n == 1
    assert_local_results(s, out, [n * (n + 1)] * n)  # The same on every replica: Mirrored.


@pytest.mark.parametrize("n", [2, 4])
def test_merge_call_per_replica_result_is_unpacked_per_replica(n):
    s = mirrored(n)

    def merge_fn(strategy, value):
        assert isinstance(value, jdist.PerReplica)
        locals_ = strategy.experimental_local_results(value)
        return jdist.PerReplica([v * 10 for v in locals_]), strategy.reduce("mean", value, axis=0)

    def fn():
        return jdist.get_replica_context().merge_call(
            merge_fn, args=(jnp.full((2,), replica_id(), jnp.float32),))
    mine, mean = s.run(fn)
    assert_local_results(s, mine, [[10. * i] * 2 for i in range(n)])
    assert isinstance(mean, jdist.Mirrored)  # TF: the merge's tensor itself.
    assert_local_results(s, mean, [(n - 1) / 2] * n)


def _total_of_ids(strategy, ids):
    return strategy.reduce("SUM", ids, axis=None)


@pytest.mark.parametrize("n, uneven", [(2, False), (3, True), (8, False)])
@pytest.mark.parametrize("source", ["captured", "plain argument", "python number", "merge result"])
def test_a_value_that_is_not_per_replica_is_the_same_on_every_replica(n, uneven, source):
    # One rule (docs/design.md): an array the step captured, a plain argument of run, a Python
    # number given to run and a plain array a merge_fn returned are the same value on every
    # replica, as a Mirrored is. all_reduce adds each replica's copy, all_gather concatenates
    # them, merge_fn gets a PerReplica of the copies, and returned as it is it comes back
    # Mirrored. (TF holds such a value as one object: its collectives give it back as it is.)
    s, w = mirrored(n), np.float32([1.5, 2.0]) if source != "python number" else 2.5
    batch = per_replica(s, [np.ones((r % 2 + 1 if uneven else 2,), np.float32) for r in range(n)])
    captured = jnp.asarray(w)

    def step(a, x):
        ctx = jdist.get_replica_context()
        v = {"captured": captured, "plain argument": a, "python number": a,
             "merge result": ctx.merge_call(lambda st, _: captured, args=(x[:1],))}[source]
        summed = ctx.merge_call(lambda st, c: (st.reduce("sum", c, axis=None),
                                               st.reduce("mean", c, axis=None)), args=(v,))
        return (v, ctx.all_reduce("sum", v), ctx.all_gather(jnp.atleast_1d(v), axis=0), summed,
                jnp.sum(x))
    for _ in range(2):  # The second call reuses the program.
        kept, total, gathered, (merge_sum, merge_mean), _ = s.run(step, args=(w, batch))
        want = np.asarray(w, np.float32)
        assert isinstance(kept, jdist.Mirrored)
        assert_local_results(s, kept, [want] * n)
        assert_local_results(s, total, [n * want] * n)
        assert_local_results(s, gathered, [np.tile(np.atleast_1d(want), n)] * n)
        assert_local_results(s, merge_sum, [n * want] * n)
        assert_local_results(s, merge_mean, [want] * n)
        np.testing.assert_allclose(np.asarray(s.reduce("SUM", kept, axis=None)), n * want)


@pytest.mark.parametrize("n", [2, 3, 8])
@pytest.mark.parametrize("merge_fn", [lambda st, v: st.reduce("mean", v, axis=None),
                                      lambda st, v: np.float32(0.5)])
def test_all_reduce_adds_the_copies_of_a_python_or_numpy_number_merge_fn_returned(n, merge_fn):
    # TF's replicas get the number itself, and its all_reduce adds their copies; a tensor
    # merge_fn returned is one object instead (test_merge_call_per_replica_result...).
    s = mirrored(n)
    ctx = jdist.get_replica_context
    out = s.run(lambda x: ctx().all_reduce("sum", ctx().merge_call(merge_fn, args=(x,))),
                args=(0.5,))
    assert_local_results(s, out, [np.float32(0.5) * n] * n)


def test_merge_call_args_must_be_a_sequence():
    s = mirrored(2)
    with pytest.raises(ValueError, match="tuple or list"):
        s.run(lambda: jdist.get_replica_context().merge_call(lambda st, x: x, args=1.0))


def test_exception_in_merge_fn_reaches_caller_with_its_type():
    class Boom(Exception):
        pass

    def merge_fn(strategy):
        raise Boom("from merge_fn")
    with pytest.raises(Boom, match="from merge_fn"):
        mirrored(2).run(lambda: jdist.get_replica_context().merge_call(merge_fn))


@pytest.mark.parametrize("n", [1, 2, 3])
def test_devices_and_strategy_properties(n):
    s = mirrored(n)
    seen = {}
    s.run(lambda: seen.update(ctx=jdist.get_replica_context()) or 0.0)
    ctx = seen["ctx"]
    assert ctx.strategy is s
    assert ctx.devices == tuple(f"/cpu:{i}" for i in range(n))
    assert ctx.num_replicas_in_sync == n


def test_manual_replica_context_on_several_replicas_cannot_all_reduce():
    with jdist.ReplicaContext(mirrored(2), 1) as ctx:
        assert ctx.devices == ("/cpu:1",)
        with pytest.raises(errors.WrongContextError):
            ctx.all_reduce("sum", 1.0)


@pytest.mark.parametrize("n", REPLICA_COUNTS)
def test_run_inside_a_merge_fn_returns_per_replica_values(n):
    """TF: a step returning replica_id + 1, run inside merge_fn, gives [1, 2, ..., n]."""
    s = mirrored(n)

    def merge_fn(strategy, x):
        ids = strategy.run(lambda: jdist.get_replica_context().replica_id_in_sync_group + 1)
        doubled_sum = strategy.run(
            lambda x: jdist.get_replica_context().all_reduce("sum", x * 2), args=(x,))
        return ids, doubled_sum

    v = per_replica(s, [np.float32(i) for i in range(n)])
    ids, total = s.run(lambda x: jdist.get_replica_context().merge_call(merge_fn, args=(x,)),
                       args=(v,))
    assert_local_results(s, ids, list(range(1, n + 1)))
    assert_local_results(s, total, [float(sum(2 * i for i in range(n)))] * n)


def test_run_inside_the_merge_fn_of_an_uneven_step():
    s = mirrored(3)
    v = per_replica(s, [np.ones(2, np.float32), np.ones(1, np.float32), np.ones(0, np.float32)])

    def step(x):
        ctx = jdist.get_replica_context()
        ids = ctx.merge_call(lambda strategy: strategy.run(
            lambda: jdist.get_replica_context().replica_id_in_sync_group * 10))
        return ids + x.shape[0]
    assert_local_results(s, s.run(step, args=(v,)), [2, 11, 20])


ONE_REPLICA = {
    "default strategy": lambda f, x: f(x),
    "OneDeviceStrategy": lambda f, x: jdist.OneDeviceStrategy("cpu:0").run(f, args=(x,)),
    "MirroredStrategy(1)": lambda f, x: mirrored(1).run(f, args=(x,)),
}


@pytest.mark.parametrize("op", ["sum", "mean"])
@pytest.mark.parametrize("dtype", [np.int32, np.float32, np.uint8])
@pytest.mark.parametrize("where", sorted(ONE_REPLICA))
def test_all_reduce_on_one_replica_is_the_value_itself(where, dtype, op):
    # TF: a one-replica value reduces to itself; an integer MEAN stays integer there.
    x = np.array([1, 2, 4], dtype)
    out = ONE_REPLICA[where](lambda v: jdist.get_replica_context().all_reduce(op, v), x)
    assert np.asarray(out).dtype == dtype
    np.testing.assert_array_equal(np.asarray(out), x)


@pytest.mark.parametrize("rows", [(2, 2, 2), (2, 1, 0)])
def test_no_gradient_flows_back_through_merge_call(rows):
    # TF runs merge_fn outside the replica's gradient tape: a merge_call inside a differentiated
    # function (logging the loss) leaves the gradient as it is; a gradient that would come back
    # through merge_call's result, which TF's tape gives as None, raises.
    s = mirrored(3)
    comps = [np.full((k, 2), i + 1.0, np.float32) for i, k in enumerate(rows)]
    total = lambda ctx, v: ctx.merge_call(lambda st, v: st.reduce("sum", v, axis=None), args=(v,))

    def logged(x):
        def loss(x):
            value = jnp.sum(x ** 2)
            return value, total(jdist.get_replica_context(), value)
        return jax.grad(loss, has_aux=True)(x)
    grads, totals = s.run(logged, args=(per_replica(s, comps),))
    assert_local_results(s, grads, [2 * c for c in comps])
    assert_local_results(s, totals, [sum(np.sum(c ** 2) for c in comps)] * 3)
    with pytest.raises(errors.NoGradientError, match="stop_gradient"):
        s.run(lambda x: jax.grad(lambda x: total(jdist.get_replica_context(), jnp.sum(x)))(x),
              args=(per_replica(s, comps),))
