"""SEMANTICS.md, reduce(op, value, axis): every rule against a NumPy reference."""

import hypothesis
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdist
from jdist import errors
from jdist.testing import REPLICA_COUNTS, mirrored, mirrored_reducing_to_one_device
from jdist.testing import per_replica

SETTINGS = hypothesis.settings(max_examples=30, deadline=None,
                               suppress_health_check=[hypothesis.HealthCheck.too_slow])


def numpy_reduce(op, components, axis):
    """TF's rule computed from the unpadded components: reduce within, then across replicas."""
    if axis is None:
        total = np.sum(np.stack(components), axis=0)
        return total / len(components) if op == "mean" else total
    axes = tuple(np.atleast_1d(axis) % components[0].ndim)
    total = sum(np.sum(c.astype(np.float64), axis=axes) for c in components)
    count = sum(np.prod([c.shape[a] for a in axes]) for c in components)
    return total / count if op == "mean" else total


@pytest.mark.parametrize("op", ["sum", "SUM", "Sum", "mean", "MEAN", "Mean",
                                jdist.ReduceOp.SUM, jdist.ReduceOp.MEAN])
def test_ops_accept_enum_and_names_in_any_case(op):
    s = mirrored(2)
    v = per_replica(s, [np.float32(1.0), np.float32(3.0)])
    expected = 4.0 if str(getattr(op, "value", op)).lower() == "sum" else 2.0
    assert float(s.reduce(op, v, axis=None)) == expected


@pytest.mark.parametrize("op", ["MAX", "prod", 3, None])
def test_unknown_op_is_value_error(op):
    s = mirrored(2)
    v = per_replica(s, [np.float32(1.0), np.float32(3.0)])
    with pytest.raises(ValueError, match="is not a valid ReduceOp"):
        s.reduce(op, v)
    with pytest.raises(errors.InvalidArgumentError):
        s.reduce(op, v)


@pytest.mark.parametrize("n", REPLICA_COUNTS)
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_axis_none_is_elementwise_across_replicas(n, op):
    s = mirrored(n)
    comps = [np.arange(6, dtype=np.float32).reshape(2, 3) * (i + 1) for i in range(n)]
    got = s.reduce(op, per_replica(s, comps) if n > 1 else comps[0], axis=None)
    np.testing.assert_allclose(got, numpy_reduce(op, comps, None) if n > 1 else comps[0],
                               rtol=1e-6)


def test_axis_none_on_run_output_nest():
    s = mirrored(4)
    out = s.run(lambda: {"a": jdist.get_replica_context().replica_id_in_sync_group,
                         "b": [jnp.ones(2) * jdist.get_replica_context().replica_id_in_sync_group]})
    got = s.reduce("sum", out, axis=None)
    assert int(got["a"]) == 6
    np.testing.assert_allclose(got["b"][0], [6.0, 6.0])


@pytest.mark.parametrize("n", [2, 3])
def test_axis_none_with_different_shapes_raises(n):
    s = mirrored(n)
    v = per_replica(s, [np.ones(2, np.float32)] + [np.ones(1, np.float32)] * (n - 1))
    with pytest.raises(errors.ShapeMismatchError, match="axis=0"):
        s.reduce("sum", v, axis=None)


@pytest.mark.parametrize("components, expected", [
    ([[5., 6.], [7.]], 6.0),              # Not 6.25: the denominator is 3 elements.
    ([[0.], [1., 1.]], 2 / 3),
    ([[5., 6.], [7.], []], 6.0),          # An empty replica contributes nothing.
    ([[], [2.], [], [4.]], 3.0),
])
def test_mean_with_axis_divides_by_total_elements(components, expected):
    s = mirrored(len(components))
    v = per_replica(s, [np.asarray(c, np.float32) for c in components])
    assert float(s.reduce("mean", v, axis=0)) == pytest.approx(expected)


@pytest.mark.parametrize("n", REPLICA_COUNTS)
@pytest.mark.parametrize("axis", [0, 1, -1, (0, 1), (0, -1)])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_axis_reduces_within_then_across(n, axis, op):
    s = mirrored(n)
    rng = np.random.default_rng(n)
    comps = [rng.normal(size=(4, 3)).astype(np.float32) for _ in range(n)]
    got = s.reduce(op, per_replica(s, comps) if n > 1 else comps[0], axis=axis)
    np.testing.assert_allclose(got, numpy_reduce(op, comps, axis), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("axis", [2, -3, (0, 5)])
def test_axis_out_of_range_is_value_error(axis):
    s = mirrored(2)
    v = per_replica(s, [np.ones((2, 2), np.float32)] * 2)
    with pytest.raises(ValueError, match="out of range"):
        s.reduce("sum", v, axis=axis)


def test_nest_with_axis_is_type_error():
    s = mirrored(2)
    v = per_replica(s, [np.ones(2, np.float32)] * 2)
    with pytest.raises(TypeError, match="nest"):
        s.reduce("sum", {"a": v}, axis=0)


@pytest.mark.parametrize("n", [2, 3, 8])
def test_plain_value_on_several_replicas(n):
    s = mirrored(n)
    with pytest.raises(ValueError, match="cannot be reduced with .*SUM"):
        s.reduce("sum", jnp.ones(3), axis=None)
    np.testing.assert_array_equal(s.reduce("mean", jnp.arange(3.0), axis=None), [0., 1., 2.])


@pytest.mark.parametrize("strategy_fn", [lambda: mirrored(1), lambda: jdist.get_strategy(),
                                         lambda: jdist.OneDeviceStrategy("cpu:0")])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_plain_value_on_one_replica_comes_back(strategy_fn, op):
    np.testing.assert_array_equal(strategy_fn().reduce(op, jnp.arange(3.0)), [0., 1., 2.])


@pytest.mark.parametrize("strategy", ["mirrored 1", "mirrored 3", "one device", "default"])
@pytest.mark.parametrize("value", [None, (None, 1.0), {"a": None}])
def test_none_is_a_value_sum_refuses_and_mean_hands_back(strategy, value):
    # A plain value is one value: MEAN hands it back, SUM too on one replica, and SUM refuses
    # it on several (TF's MirroredStrategy raises there too).
    s = {"one device": lambda: jdist.OneDeviceStrategy("cpu:0"), "default": jdist.get_strategy,
         }.get(strategy, lambda: mirrored(int(strategy[-1])))()
    if strategy == "mirrored 3":
        with pytest.raises(errors.InvalidArgumentError, match="non-DistributedValues"):
            s.reduce("sum", value)
    else:
        assert s.reduce("sum", value) == value
    assert s.reduce("mean", value) == value


@pytest.mark.parametrize("n", [2, 4])
def test_mirrored_value_is_one_value_per_replica(n):
    s = mirrored(n)
    m = s.run(lambda: jdist.get_replica_context().all_reduce("sum", jnp.ones(2)))
    assert isinstance(m, jdist.Mirrored)
    np.testing.assert_allclose(s.reduce("sum", m, axis=None), [n * n] * 2)
    np.testing.assert_allclose(s.reduce("mean", m, axis=None), [n] * 2)
    np.testing.assert_allclose(s.reduce("mean", m, axis=0), n)


def test_per_replica_of_another_strategy_is_rejected():
    v = per_replica(mirrored(2), [np.ones(1, np.float32)] * 2)
    with pytest.raises(errors.InvalidArgumentError, match="replicas"):
        mirrored(4).reduce("sum", v)


def test_reduce_result_is_replicated_array():
    s = mirrored(4)
    got = s.reduce("sum", per_replica(s, [np.ones(2, np.float32)] * 4))
    assert isinstance(got, jax.Array) and got.sharding.is_fully_replicated


@st.composite
def uneven_case(draw):
    n = draw(st.sampled_from(REPLICA_COUNTS))
    inner = draw(hnp.array_shapes(min_dims=0, max_dims=2, min_side=1, max_side=3))
    lengths = draw(st.lists(st.integers(0, 4), min_size=n, max_size=n).filter(
        lambda ls: sum(ls) > 0))
    elements = st.floats(-100, 100, allow_nan=False, width=32)
    comps = [draw(hnp.arrays(np.float32, (ln,) + inner, elements=elements)) for ln in lengths]
    return n, comps


@SETTINGS
@hypothesis.given(case=uneven_case(), op=st.sampled_from(["sum", "mean"]))
def test_property_axis0_reduce_matches_numpy_on_unpadded_data(case, op):
    n, comps = case
    s = mirrored(n)
    v = per_replica(s, comps) if n > 1 else comps[0]
    got = s.reduce(op, v, axis=0)
    np.testing.assert_allclose(got, numpy_reduce(op, comps, 0), rtol=1e-4, atol=1e-3)


@SETTINGS
@hypothesis.given(n=st.sampled_from(REPLICA_COUNTS),
                  shape=hnp.array_shapes(min_dims=0, max_dims=3, max_side=4),
                  op=st.sampled_from(["sum", "mean"]), data=st.data())
def test_property_axis_none_matches_numpy(n, shape, op, data):
    s = mirrored(n)
    comps = [data.draw(hnp.arrays(np.float32, shape, elements=st.floats(-1e3, 1e3, width=32)))
             for _ in range(n)]
    v = per_replica(s, comps) if n > 1 else comps[0]
    expected = numpy_reduce(op, comps, None) if n > 1 else comps[0]
    np.testing.assert_allclose(s.reduce(op, v, axis=None), expected, rtol=1e-5, atol=1e-3)


# ------------------------------------------------- issue 9: integer and bool reductions
def _reduce_in_merge_call(s, op, v, axis):
    """The same reduce inside a merge_fn, where the replicas arrive stacked (stacked_reduce)."""
    out = s.run(lambda x: jdist.get_replica_context().merge_call(
        lambda strategy, y: strategy.reduce(op, y, axis=axis), args=(x,)), args=(v,))
    return s.experimental_local_results(out)[0]


@pytest.mark.parametrize("n", REPLICA_COUNTS)
@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.int32])
@pytest.mark.parametrize("axis", [None, 0])
@pytest.mark.parametrize("where", ["strategy", "merge_call"])
def test_integer_sum_keeps_its_dtype_on_every_axis(n, dtype, axis, where):
    # TF: int8/uint8 SUM gives int8/uint8 with axis=0 as with axis=None (no widening).
    s = mirrored(n)
    comps = [np.arange(3, dtype=dtype) + i for i in range(n)]
    v = per_replica(s, comps) if n > 1 else comps[0]
    if where == "strategy":
        got = s.reduce("sum", v, axis=axis)
    else:
        got = _reduce_in_merge_call(s, "sum", v, axis)
    expected = np.sum(np.stack(comps), axis=0 if axis is None else (0, 1), dtype=np.int64)
    assert jnp.asarray(got).dtype == dtype
    np.testing.assert_array_equal(got, expected.astype(dtype))


BOOL_REDUCTIONS = {
    "reduce": lambda s, op, v: s.reduce(op, v, axis=None),
    "reduce_axis0": lambda s, op, v: s.reduce(op, v, axis=0),
    "reduce_to": lambda s, op, v: s.extended.reduce_to(op, v, "cpu:0"),
    "batch_reduce_to": lambda s, op, v: s.extended.batch_reduce_to(op, [(v, "cpu:0")]),
    "cross_device_ops": lambda s, op, v: jdist.ReductionToOneDevice().reduce(
        jdist.ReduceOp[op.upper()], v, "cpu:0"),
    "all_reduce": lambda s, op, v: s.run(
        lambda x: jdist.get_replica_context().all_reduce(op, x), args=(v,)),
}


@pytest.mark.parametrize("n", [n for n in REPLICA_COUNTS if n > 1])
@pytest.mark.parametrize("op", ["sum", "mean"])
@pytest.mark.parametrize("how", sorted(BOOL_REDUCTIONS))
def test_bool_reduction_raises(n, op, how):
    # TF adds the replicas' values (add_n), which has no bool kernel: bool SUM (and MEAN) raise.
    s = mirrored(n)
    comps = [np.array([True, i % 2 == 0]) for i in range(n)]
    with pytest.raises(errors.UnsupportedValueError, match="bool"):
        BOOL_REDUCTIONS[how](s, op, per_replica(s, comps))


ADDING_ON_ONE_REPLICA = ("reduce_axis0",)


@pytest.mark.parametrize("strategy", ["mirrored", "one device", "default"])
@pytest.mark.parametrize("op", ["sum", "mean"])
@pytest.mark.parametrize("how", sorted(BOOL_REDUCTIONS))
def test_one_replica_hands_bools_back_where_it_adds_nothing(strategy, op, how):
    # On one replica TF adds nothing (the value comes back) except along an axis (reduce_sum);
    # cross-device ops called directly hand a value on the destination's device back.
    s = {"mirrored": mirrored(1), "one device": jdist.OneDeviceStrategy("cpu:0"),
         "default": jdist.get_strategy()}[strategy]
    value = np.array([True, False])
    if how in ADDING_ON_ONE_REPLICA:
        with pytest.raises(errors.UnsupportedValueError, match="bool"):
            BOOL_REDUCTIONS[how](s, op, value)
        return
    got = BOOL_REDUCTIONS[how](s, op, value)
    for result in got if isinstance(got, list) else [got]:
        np.testing.assert_array_equal(np.asarray(result), value)
        assert np.asarray(result).dtype == np.bool_


@pytest.mark.parametrize("ops", [jdist.ReductionToOneDevice, jdist.NcclAllReduce])
@pytest.mark.parametrize("batch", [False, True], ids=["reduce", "batch_reduce"])
def test_cross_device_ops_divide_one_bool_value_elsewhere_as_tf(ops, batch):
    # TF's cross-device ops hand one value on the destination's device back; elsewhere they
    # reduce it: add_n of one value is that value, and a MEAN divides it by one, which a bool
    # is not (TypeError in TF).
    value, (SUM, MEAN) = np.array([True, False]), jdist.ReduceOp

    def reduce(op, destination):
        if batch:
            return ops().batch_reduce(op, [(value, destination)])[0]
        return ops().reduce(op, value, destination)
    for op, destination in ((SUM, "cpu:0"), (MEAN, "cpu:0"), (SUM, "cpu:1")):
        got = reduce(op, destination)
        np.testing.assert_array_equal(np.asarray(got), value)
        assert got.dtype == np.bool_
        assert got.devices() == {jax.devices()[int(destination[-1])]}
    with pytest.raises(errors.UnsupportedValueError, match="bool"):
        reduce(MEAN, "cpu:1")


@pytest.mark.parametrize("strategy", ["mirrored 1", "mirrored 2", "mirrored 3", "one device",
                                      "default"])
@pytest.mark.parametrize("how", ["reduce", "reduce_to"])
@pytest.mark.parametrize("number", [0, 0.0, False, 3, 0.1])
def test_a_python_number_reduces_as_any_plain_value(strategy, how, number):
    # MEAN hands it back as it is (0.1 stays a Python float), SUM too on one replica; SUM on
    # several refuses it, as TF's MirroredStrategy does (without TF's special case for zeros).
    s = {"one device": lambda: jdist.OneDeviceStrategy("cpu:0"), "default": jdist.get_strategy,
         }.get(strategy, lambda: mirrored(int(strategy[-1])))()

    def reduce(op):
        if how == "reduce":
            return s.reduce(op, number, axis=None)
        return s.extended.reduce_to(op, number, "cpu:0")
    assert reduce("mean") is number
    if strategy in ("mirrored 2", "mirrored 3"):
        with pytest.raises(errors.InvalidArgumentError, match="non-DistributedValues"):
            reduce("sum")
    else:
        assert reduce("sum") is number


@pytest.mark.parametrize("n", [n for n in REPLICA_COUNTS if n > 1])
@pytest.mark.parametrize("value", [np.array([True, False]), np.array([False, False]), True],
                         ids=["bools", "all false", "python bool"])
def test_a_plain_bool_reduces_as_any_plain_value(n, value):
    # No plain value is added without an axis: MEAN hands it back and SUM refuses it.
    s = mirrored(n)
    mean = s.reduce("mean", value, axis=None)
    np.testing.assert_array_equal(np.asarray(mean), value)
    assert np.asarray(mean).dtype == np.bool_
    with pytest.raises(errors.InvalidArgumentError, match="non-DistributedValues"):
        s.reduce("sum", value, axis=None)
    with pytest.raises(errors.UnsupportedValueError, match="bool"):  # Along an axis TF adds.
        s.reduce("mean", np.array([True, False]), axis=0)


@pytest.mark.parametrize("n", REPLICA_COUNTS)
@pytest.mark.parametrize("numbers, axis", [([1.0, 2.5], 0), ([[1, 2], [3, 4]], -1), ([], 0)])
def test_a_list_of_python_numbers_sums_along_an_axis_as_one_tensor(n, numbers, axis):
    # TF converts it as any Python numbers (floats to float32, ints to int32); every replica
    # holds it, so SUM adds n copies.
    s = mirrored(n)
    tensor = np.asarray(numbers, np.float32 if "." in str(numbers) or not numbers else np.int32)
    got = s.reduce("sum", numbers, axis=axis)
    assert got.dtype == tensor.dtype
    np.testing.assert_array_equal(got, np.sum(tensor, axis=axis) * n)


@pytest.mark.parametrize("value, error", [
    ([1.0, 2.5], "TF raises"),  # TF's MEAN reads the value's shape: AttributeError.
    ([np.float32(1.0), {"a": 2.0}], "single value")])
def test_other_lists_along_an_axis_are_refused(value, error):
    op = "mean" if error == "TF raises" else "sum"
    with pytest.raises(errors.UnsupportedValueError, match=error):
        mirrored(2).reduce(op, value, axis=0)


# ------------------------------------------- bfloat16: TF rounds every cross-replica partial sum
BFLOAT16_SUMS = {
    "reduce": lambda s, v: s.reduce("sum", v, axis=None),
    "reduce_rows": lambda s, v: s.reduce("sum", v, axis=0),
    "merge_call": lambda s, v: _reduce_in_merge_call(s, "sum", v, None),
    "all_reduce": lambda s, v: s.experimental_local_results(s.run(
        lambda x: jdist.get_replica_context().all_reduce("sum", x), args=(v,)))[0],
    "packed_all_reduce": lambda s, v: s.experimental_local_results(s.run(
        lambda x: jdist.get_replica_context().all_reduce(
            "sum", [x], options=jdist.CommunicationOptions(bytes_per_pack=64))[0],
        args=(v,)))[0],
    "batch_reduce_to": lambda s, v: s.extended.batch_reduce_to(
        jdist.ReduceOp.SUM, [(v, "cpu:0")])[0],
}


def numpy_bfloat16_sum(components, axis):
    """TF's bfloat16 sum: each replica's rows summed in float32 and rounded once, then the
    replicas added one at a time, every partial sum rounded to bfloat16 (``add_n``)."""
    bf16 = jnp.bfloat16
    partials = [c if axis is None else c.astype(np.float32).sum(axis).astype(bf16)
                for c in components]
    total = partials[0]
    for p in partials[1:]:
        total = (total.astype(np.float32) + p.astype(np.float32)).astype(bf16)
    return total


@pytest.mark.parametrize("n", REPLICA_COUNTS)
@pytest.mark.parametrize("path", list(BFLOAT16_SUMS))
def test_bfloat16_sums_round_every_partial_sum(n, path):
    rng = np.random.default_rng(n)
    comps = [(rng.normal(size=(6, 40)) * 10.0 ** rng.integers(-2, 3, size=(6, 40))
              ).astype(jnp.bfloat16) for _ in range(n)]
    s = mirrored(n)
    got = BFLOAT16_SUMS[path](s, per_replica(s, comps) if n > 1 else comps[0])
    want = numpy_bfloat16_sum(comps, 0 if path == "reduce_rows" else None)
    assert jnp.asarray(got).dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), want.astype(np.float32))


# TF's MirroredStrategy reduces an int32 value with a ReductionToOneDevice of its own, and
# refuses a batch (all_reduce of a nest, batch_reduce_to) in which that is not every value's ops.
INT32_BATCHES = {
    "all_reduce": lambda s, v: s.run(
        lambda x: jdist.get_replica_context().all_reduce("sum", (x, x * 2)), args=(v,)),
    "batch_reduce_to": lambda s, v: s.extended.batch_reduce_to("sum", [(v, v), (v, "CPU:0")]),
}


@pytest.mark.parametrize("how", list(INT32_BATCHES))
@pytest.mark.parametrize("n", [1, 3])
def test_a_batch_with_an_int32_value_raises_as_in_tf(n, how):
    with jax.enable_x64(True):
        s = mirrored(n)
        v = per_replica(s, [np.int32([r, 1]) for r in range(n)]) if n > 1 else jnp.int32([0, 1])
        with pytest.raises(errors.InvalidArgumentError, match="Inputs to batch_reduce_to"):
            INT32_BATCHES[how](s, v)


@pytest.mark.parametrize("how", list(INT32_BATCHES))
@pytest.mark.parametrize("n", [1, 3])
def test_without_x64_an_int32_batch_raises_as_with_it(n, how):
    # Dtypes are JAX's: an int64 host value is int32 without x64, and TF refuses int32 batches.
    s = mirrored(n)
    comps = [np.int64([r, 1]) for r in range(n)]
    v = per_replica(s, comps) if n > 1 else jnp.asarray(comps[0])
    with pytest.raises(errors.InvalidArgumentError, match="Inputs to batch_reduce_to"):
        INT32_BATCHES[how](s, v)


@pytest.mark.parametrize("n", [1, 3])
def test_a_batch_of_one_int32_value_or_of_floats_goes_on(n):
    with jax.enable_x64(True):
        s = mirrored(n)
        comps = [np.int32([r, 1]) for r in range(n)]
        v = per_replica(s, comps) if n > 1 else jnp.asarray(comps[0])
        one, = s.extended.batch_reduce_to("sum", [(v, v)])
        floats = s.run(lambda x: jdist.get_replica_context().all_reduce(
            "sum", (x.astype(jnp.float32), x.astype(jnp.float32) * 2)), args=(v,))
        for got in s.experimental_local_results(one):
            np.testing.assert_array_equal(got, np.sum(comps, axis=0))
        for got in s.experimental_local_results(floats[1]):
            np.testing.assert_array_equal(got, 2 * np.sum(comps, axis=0))


# ------------------------------------------ dtypes that TF's collective ops refuse
# MirroredStrategy's default ops on several devices (CollectiveAllReduce) all-reduce bfloat16,
# float16/32/64, int32 and int64, and gather the same but bfloat16; a reduce or reduce_to of one
# value goes to ReductionToOneDevice on CPUs, as does every int32 value; explicitly chosen ops
# take every dtype.
COLLECTIVE_CALLS = {
    "all_reduce": lambda s, v: s.run(
        lambda x: jdist.get_replica_context().all_reduce("sum", x), args=(v,)),
    "batch_reduce_to": lambda s, v: s.extended.batch_reduce_to("sum", [(v, v)])[0],
    "gather": lambda s, v: s.gather(v, axis=0),
    "all_gather": lambda s, v: s.run(
        lambda x: jdist.get_replica_context().all_gather(x, 0), args=(v,)),
    "reduce": lambda s, v: s.reduce("sum", v, axis=None),
    "reduce_to": lambda s, v: s.extended.reduce_to("sum", v, v),
}
REFUSED = {"int8": {"all_reduce", "batch_reduce_to", "gather", "all_gather"},
           "uint16": {"all_reduce", "batch_reduce_to", "gather", "all_gather"},
           "complex64": {"all_reduce", "batch_reduce_to", "gather", "all_gather"},
           "bfloat16": {"gather", "all_gather"}}


def expected_result(call, comps):
    if "gather" in call:
        return np.concatenate(comps)
    return np.sum(np.stack(comps), axis=0, dtype=comps[0].dtype)


@pytest.mark.parametrize("call", list(COLLECTIVE_CALLS))
@pytest.mark.parametrize("dtype", list(REFUSED))
@pytest.mark.parametrize("n", [2, 3])
def test_dtypes_tfs_collective_ops_refuse_raise_where_they_would_run(n, dtype, call):
    comps = [(np.arange(3) + i).astype(jnp.dtype(dtype)) for i in range(n)]
    for s in (mirrored(n), mirrored_reducing_to_one_device(n)):
        v = per_replica(s, comps)
        if s is mirrored(n) and call in REFUSED[dtype]:
            with pytest.raises(errors.InvalidArgumentError, match="CollectiveAllReduce"):
                COLLECTIVE_CALLS[call](s, v)
            continue
        out = COLLECTIVE_CALLS[call](s, v)
        for got in s.experimental_local_results(out):
            assert got.dtype == comps[0].dtype
            np.testing.assert_array_equal(np.asarray(got).astype(np.complex128),
                                          expected_result(call, comps).astype(np.complex128))


@pytest.mark.parametrize("call", ["gather", "all_gather"])
def test_bools_gather_only_where_tfs_collective_ops_do_not(call):
    comps = [np.array([True, False]), np.array([False, False])]
    with pytest.raises(errors.InvalidArgumentError, match="bool value"):
        COLLECTIVE_CALLS[call](mirrored(2), per_replica(mirrored(2), comps))
    s = mirrored_reducing_to_one_device(2)
    out = s.experimental_local_results(COLLECTIVE_CALLS[call](s, per_replica(s, comps)))
    np.testing.assert_array_equal(out[0], np.concatenate(comps))
