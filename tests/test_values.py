"""DistributedValues: PerReplica and Mirrored as thin wrappers over sharded arrays."""

import copy
import pickle
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdist
from jdist import errors
from jdist._src import host_values
from jdist._src import values
from jdist.testing import REPLICA_COUNTS, assert_local_results, mirrored, per_replica


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_per_replica_is_one_array_sharded_over_the_replicas(n):
    s = mirrored(n)
    v = per_replica(s, [np.full((2,), i, np.float32) for i in range(n)])
    assert v.stacked.shape == (n, 2)
    assert v.stacked.sharding == jax.sharding.NamedSharding(
        s.extended.mesh, jax.sharding.PartitionSpec("replica"))
    results = s.experimental_local_results(v)
    assert [next(iter(r.devices())) for r in results] == list(s.extended.worker_devices)
    assert_local_results(s, v, [[i, i] for i in range(n)])
    assert_local_results(s, v, [np.asarray(x) for x in v.values])


def test_local_results_are_read_on_each_replicas_device():
    s = mirrored(4)
    v = per_replica(s, [np.full((2,), i, np.float32) for i in range(4)])
    for shard, result in zip(v.stacked.addressable_shards, s.experimental_local_results(v)):
        assert result.devices() == {shard.device}


@pytest.mark.parametrize("n", [2, 4])
def test_mirrored_is_one_replicated_array(n):
    s = mirrored(n)
    m = s.run(lambda: jnp.arange(3.0))
    assert isinstance(m, jdist.Mirrored) and m.value.sharding.is_fully_replicated
    results = s.experimental_local_results(m)
    assert len(results) == n and [next(iter(r.devices())) for r in results] == list(
        s.extended.worker_devices)
    assert_local_results(s, m, [[0., 1., 2.]] * n)


@pytest.mark.parametrize("copy", [
    lambda m: jax.tree_util.tree_map(lambda v: v * 1, m),
    lambda m: jax.tree_util.tree_unflatten(*reversed(jax.tree_util.tree_flatten(m))),
    lambda m: __import__("pickle").loads(__import__("pickle").dumps(m)),
    lambda m: __import__("copy").deepcopy(m)], ids=["tree_map", "unflatten", "pickle", "deepcopy"])
@pytest.mark.parametrize("n", [1, 3, 8])
def test_mirrored_keeps_its_replica_count_through_copies(n, copy):
    # The count is the class's (one pytree node type per count), so every copy must keep it.
    m = copy(mirrored(n).run(lambda: jnp.arange(3.0)) if n > 1 else
             jdist.Mirrored([np.arange(3, dtype=np.float32)]))
    assert isinstance(m, jdist.Mirrored) and m.num_replicas == n and len(m.values) == n
    np.testing.assert_array_equal(np.asarray(m), [0., 1., 2.])


def test_local_results_of_plain_value_is_one_tuple():
    assert mirrored(4).experimental_local_results(5.0) == (5.0,)


def test_local_results_of_a_nest():
    s = mirrored(2)
    out = s.run(lambda: {"id": jdist.get_replica_context().replica_id_in_sync_group, "k": 3.0})
    first, second = s.experimental_local_results(out)
    assert int(first["id"]) == 0 and int(second["id"]) == 1 and float(second["k"]) == 3.0


def test_uneven_value_is_ragged_with_each_component_on_its_device():
    s = mirrored(3)
    v = per_replica(s, [np.float32([1., 2.]), np.float32([3.]), np.float32([])])
    results = s.experimental_local_results(v)
    assert [r.tolist() for r in results] == [[1., 2.], [3.], []]
    assert v.ragged
    assert [r.devices() for r in results] == [{d} for d in s.extended.worker_devices]
    with pytest.raises(errors.ShapeMismatchError):
        v.stacked  # pylint: disable=pointless-statement


@pytest.mark.parametrize("op", [lambda v: v + 1, lambda v: 1 + v, lambda v: v * v, lambda v: -v,
                                lambda v: np.ones(2, np.float32) + v, lambda v: jnp.ones(2) * v,
                                lambda v: float(v), lambda v: np.asarray(v)])
def test_arithmetic_on_per_replica_in_cross_replica_context_is_type_error(op):
    s = mirrored(2)
    v = per_replica(s, [np.ones(2, np.float32), np.zeros(2, np.float32)])
    with pytest.raises(TypeError):
        op(v)
    with pytest.raises(errors.CrossReplicaArithmeticError):
        op(v)


def test_mirrored_supports_arithmetic_on_its_common_value():
    s = mirrored(2)
    m = s.run(lambda: jnp.float32(3.0))
    assert float(m + 1) == 4.0 and float(2 * m) == 6.0 and float(-m) == -3.0
    assert float(jnp.sin(m)) == pytest.approx(np.sin(3.0))


def test_a_mirrored_iterates_as_its_array():
    """Python iterates an object with ``__getitem__`` until IndexError, which a JAX array never
    raises (it clamps indices): ``list(m)`` of a Mirrored never ended, ``a, b = m`` raised."""
    s = mirrored(2)
    m = s.run(lambda: jnp.arange(2.0))
    a, b = m
    assert (float(a), float(b)) == (0.0, 1.0) and len(m) == 2 and len(list(m)) == 2
    with pytest.raises(TypeError):
        list(s.run(lambda: jnp.float32(1.0)))


VALUE_ENTRIES = {  # Each entry point with a value no device holds.
    "Mirrored": lambda s, v: jdist.Mirrored([v, v]),
    "mirror": lambda s, v: jdist.mirror({"w": v}, s),
    "reduce": lambda s, v: s.reduce("sum", v, axis=None),
    "all_reduce": lambda s, v: s.run(
        lambda: jdist.get_replica_context().all_reduce("sum", v)),
    "all_gather": lambda s, v: s.run(lambda: jdist.get_replica_context().all_gather(v, 0)),
    "cross-device reduce": lambda s, v: jdist.ReductionToOneDevice().reduce(
        jdist.ReduceOp.SUM, v, "CPU:0"),
    "broadcast_to": lambda s, v: s.extended.broadcast_to(v, "CPU:0"),
}


@pytest.mark.parametrize("value", ["text", np.array(["a"]), object()])
@pytest.mark.parametrize("entry", sorted(VALUE_ENTRIES))
def test_strings_and_objects_raise_a_typed_error_at_every_entry(entry, value):
    with pytest.raises(errors.UnsupportedValueError, match="string|objects|numeric"):
        VALUE_ENTRIES[entry](mirrored(3), value)


NOT_FUNCTIONS = {
    "run": lambda s, f: s.run(f),
    "merge_call": lambda s, f: s.run(lambda: jdist.get_replica_context().merge_call(f)),
    "jdist.function": lambda s, f: jdist.function(f),
    "replica_key": lambda s, f: s.run(lambda: jdist.replica_key(f)),
}


@pytest.mark.parametrize("value", [3, "text"])  # (jdist.function(None) is its decorator form.)
@pytest.mark.parametrize("entry", sorted(NOT_FUNCTIONS))
def test_a_function_or_key_argument_of_another_type_raises_a_typed_error(entry, value):
    with pytest.raises(errors.UnsupportedValueError, match=type(value).__name__):
        NOT_FUNCTIONS[entry](mirrored(3), value)


@pytest.mark.parametrize("value", ["text", b"bytes", object(),
                                   jax.ShapeDtypeStruct((2,), jnp.float32)])
def test_a_jdist_function_returning_a_host_object_raises_a_typed_error(value):
    s = mirrored(3)
    step = jdist.function(lambda x: (s.run(lambda x: x + 1.0, args=(x,)), {"out": value}))
    with pytest.raises(errors.UnsupportedValueError, match=type(value).__name__):
        step(jnp.ones(2))


@pytest.mark.parametrize("n", [2, 3])
def test_a_jdist_function_returns_a_mirrored_as_one_array_and_step_outputs_as_they_are(n):
    """As tf.function returns a Mirrored (a reduce_to result) as one tensor: one local result,
    MEAN hands it back, SUM refuses it; run's outputs (TF's PerReplica) keep one per replica."""
    s = mirrored(n)
    v = per_replica(s, [np.float32([1, 2]) * (i + 1) for i in range(n)])
    reduced, doubled = jdist.function(lambda v: (
        s.extended.reduce_to("sum", v, v), s.run(lambda x: x * 0 + 2.0, args=(v,))))(v)
    total = np.float32([1, 2]) * n * (n + 1) / 2
    assert not isinstance(reduced, jdist.DistributedValues)
    assert_local_results(s, reduced, [total])
    np.testing.assert_array_equal(s.reduce("mean", reduced, axis=None), total)
    with pytest.raises(errors.InvalidArgumentError, match="cannot be reduced"):
        s.reduce("sum", reduced, axis=None)
    assert_local_results(s, doubled, [np.float32([2, 2])] * n)


@pytest.mark.parametrize("value", [3, 2.5, True, 1j, np.float32(2), np.arange(3)])
def test_a_jdist_function_returns_numbers_as_arrays(value):
    np.testing.assert_array_equal(np.asarray(jdist.function(lambda: value)()), value)


@pytest.mark.parametrize("value", [None, {"a": 1.0}])
def test_cross_device_reduce_takes_one_value(value):
    with pytest.raises(errors.InvalidArgumentError, match="one value"):
        jdist.ReductionToOneDevice().reduce(jdist.ReduceOp.SUM, value, "CPU:0")


def test_a_dataset_of_distributed_values_is_a_typed_error():
    s = mirrored(2)
    v = s.experimental_distribute_values_from_function(lambda ctx: np.ones(2, np.float32))
    with pytest.raises(errors.InvalidArgumentError, match="distributed already"):
        list(s.experimental_distribute_dataset([v, v]))


@pytest.mark.parametrize("n", REPLICA_COUNTS)
def test_distribute_values_from_function_calls_value_fn_once_per_replica_in_order(n):
    s = mirrored(n)
    seen = []

    def value_fn(ctx):
        assert isinstance(ctx.replica_id_in_sync_group, int)
        assert ctx.num_replicas_in_sync == n
        seen.append(ctx.replica_id_in_sync_group)
        return {"x": np.float32(ctx.replica_id_in_sync_group)}
    v = s.experimental_distribute_values_from_function(value_fn)
    assert seen == list(range(n))
    assert_local_results(s, v["x"], list(range(n)))


@pytest.mark.parametrize("n", REPLICA_COUNTS)
@pytest.mark.parametrize("number", [lambda r, n: r / n, lambda r, n: 0.1 * (r + 1),
                                    lambda r, n: r + 7, lambda r, n: r % 2 == 0])
def test_python_numbers_per_replica_are_tfs_tensors_of_them(n, number):
    # TF's PerReplica holds the numbers as they are; jdist holds TF's tensors of them (float32
    # for floats, int32 for ints, bool), the dtypes its programs take (docs/design.md).
    s = mirrored(n)
    want = [number(r, n) for r in range(n)]
    v = s.experimental_distribute_values_from_function(lambda ctx: number(
        ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync))
    dtype = {float: np.float32, int: np.int32, bool: np.bool_}[type(want[0])]
    for got in (s.experimental_local_results(v), jdist.PerReplica(want).values):
        assert [np.asarray(g).dtype for g in got] == [np.dtype(dtype)] * n
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want, dtype))
    if not isinstance(want[0], bool):
        total = s.reduce("sum", v, axis=None)
        np.testing.assert_allclose(np.asarray(total), np.sum(np.asarray(want, dtype)), rtol=1e-6)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_python_ints_per_replica_are_int32_as_tf_converts_them(n):
    # Not int64 host numbers (whose products raise X64RequiredError): TF's tensors of them.
    s = mirrored(n)
    v = s.experimental_distribute_values_from_function(lambda ctx: 2 * ctx.replica_id_in_sync_group)
    out = s.run(lambda x: x * x * 1000, args=(v,))
    assert_local_results(s, out, [4000 * r * r for r in range(n)])
    assert all(np.asarray(r).dtype == np.int32 for r in s.experimental_local_results(out))


def test_python_numbers_differing_between_an_uneven_steps_replicas_are_those_numbers():
    s = mirrored(4)
    v = per_replica(s, [np.ones(r % 2 + 1, np.float32) for r in range(4)])
    rows = s.run(lambda x: x.shape[0] / 4, args=(v,))
    assert s.experimental_local_results(rows) == (0.25, 0.5, 0.25, 0.5)


def test_distribute_values_from_function_rejects_mismatched_values():
    s = mirrored(2)
    with pytest.raises(errors.InvalidArgumentError, match="dtype"):
        s.experimental_distribute_values_from_function(
            lambda ctx: np.ones(2, [np.float32, np.int32][ctx.replica_id_in_sync_group]))
    with pytest.raises(errors.InvalidArgumentError, match="structures"):
        s.experimental_distribute_values_from_function(
            lambda ctx: [1.0] * (1 + ctx.replica_id_in_sync_group))


@pytest.mark.parametrize("value", ["text", b"bytes", np.array(["a", "b"]), object()])
def test_values_a_device_cannot_hold_raise_a_typed_error(value):
    s = mirrored(3)  # TF holds strings; JAX arrays hold numbers and bools only.
    with pytest.raises(errors.UnsupportedValueError, match="numeric or bool"):
        s.experimental_distribute_values_from_function(lambda ctx: value)
    if isinstance(value, np.ndarray):
        with pytest.raises(errors.UnsupportedValueError, match="dtype <U1"):
            s.run(lambda x: x, args=(value,))


def test_per_replica_constructor_assembles_device_arrays_without_copy():
    devices = jax.devices()[:2]
    parts = [jax.device_put(np.full((2,), i, np.float32), d) for i, d in enumerate(devices)]
    v = jdist.PerReplica(parts)
    assert v.stacked.sharding.device_set == set(devices)
    out = mirrored(2).run(lambda x: x + 1, args=(v,))
    assert_local_results(mirrored(2), out, [[1., 1.], [2., 2.]])


def test_per_replica_constructor_validates():
    with pytest.raises(TypeError):
        jdist.PerReplica(np.ones(2, np.float32))
    with pytest.raises(errors.InvalidArgumentError):
        jdist.Mirrored([np.ones(2, np.float32), np.zeros(2, np.float32)])


# TF accepts components of one dtype kind (int32 with int64; JAX holds both as int32).
@pytest.mark.parametrize("components, want, dtype", [
    ([np.int32(1), np.int64(2)], [1, 2], np.int32),
    ([np.float32(1.5), 2.5], [1.5, 2.5], np.float32),
    ([1, np.int32(2)], [1, 2], np.int32),
    ([True, np.bool_(False)], [True, False], np.bool_),
])
def test_per_replica_accepts_numbers_and_arrays_of_one_dtype_kind(components, want, dtype):
    s = mirrored(2)
    v = jdist.PerReplica(components)
    out = s.run(lambda x: x, args=(v,))
    got = [np.asarray(c) for c in s.experimental_local_results(out)]
    assert [g.tolist() for g in got] == want
    assert {g.dtype for g in got} == {np.dtype(dtype)}


def test_per_replica_ragged_components_of_one_kind_stay_ragged():
    s = mirrored(2)
    v = jdist.PerReplica([np.arange(2, dtype=np.int32), np.arange(3, dtype=np.int64)])
    assert v.ragged
    out = s.run(lambda x: x * 2, args=(v,))
    assert [np.asarray(c).tolist() for c in out.values] == [[0, 2], [0, 2, 4]]


# TF rejects components of different dtype kinds; jdist says so when the value is made.
@pytest.mark.parametrize("components", [
    [1, 2.0],
    [np.ones(2, np.float32), np.ones(3, np.int32)],
    [np.ones(2, np.float32), np.ones(2, np.int32)],
    [True, 1],
    [np.int8(1), np.uint8(1)],
])
def test_per_replica_mixing_dtype_kinds_is_an_error(components):
    with pytest.raises(errors.InvalidArgumentError, match="dtype kind"):
        jdist.PerReplica(components)


@pytest.mark.parametrize("components", [
    [{"a": 1.0}, {"a": 2.0}],
    ["a", "b"],
    [None, None],
    [1.0, None],
    [[np.ones(2, np.float32)], [np.ones(2, np.float32)]],
    [np.array(["x"]), np.array(["y"])],
])
def test_per_replica_components_must_be_arrays_or_numbers(components):
    with pytest.raises(errors.UnsupportedValueError):
        jdist.PerReplica(components)


# One kind, but dtypes JAX keeps apart: a jdist value has one dtype (TF: one per replica).
@pytest.mark.parametrize("x64, components", [
    (True, [np.float32(1.5), np.float64(2.5)]),
    (False, [np.uint8(1), np.uint16(2)]),
    (False, [np.zeros(2, np.int8), np.zeros(3, np.int16)]),
])
def test_per_replica_dtypes_jax_keeps_apart_are_an_error(x64, components):
    with jax.enable_x64(x64):
        with pytest.raises(errors.InvalidArgumentError, match="one dtype"):
            jdist.PerReplica(components)


def test_values_pass_through_jit():
    s = mirrored(2)
    v = per_replica(s, [np.ones(2, np.float32), np.zeros(2, np.float32)])
    out = jax.jit(lambda v: jax.tree_util.tree_map(lambda x: x + 1, v))(v)
    assert isinstance(out, jdist.PerReplica)
    assert_local_results(s, out, [[2., 2.], [1., 1.]])


def test_ragged_value_of_several_workers_holds_only_this_workers_arrays():
    """Under MultiWorkerMirroredStrategy another worker's replica is a shape (agreed by the
    workers); values / experimental_local_results give this worker's arrays only."""
    from jdist._src.values import PerReplica, ragged_components, spans_workers
    mine = jnp.arange(2.0)
    v = PerReplica._from_ragged([mine, jax.ShapeDtypeStruct((3,), jnp.float32)])
    assert v.ragged and v.num_replicas == 2 and spans_workers(v)
    assert v.values == (mine,) and jdist.MirroredStrategy().experimental_local_results(v) == (
        mine,)
    assert ragged_components(v)[1].shape == (3,)
    assert not spans_workers(PerReplica([np.zeros(2, np.float32), np.zeros(3, np.float32)]))
    assert "shapes=[(2,), (3,)]" in repr(v)



# ----------------------------- 64-bit numbers: exact in 32 bits, or an error (no x64)
BIG = 2**40 + 5  # JAX without x64 would hold it as int32 5.
INEXACT = 0.1  # JAX without x64 would hold it as float32 0.100000001.
ENTRIES = {
    "PerReplica components": lambda s, v: per_replica(s, [v] * s.num_replicas_in_sync),
    "PerReplica": lambda s, v: jdist.PerReplica([v] * s.num_replicas_in_sync),
    "Mirrored": lambda s, v: jdist.Mirrored([v] * s.num_replicas_in_sync),
    "values from a function": lambda s, v: s.experimental_distribute_values_from_function(
        lambda ctx: v),
    "run argument": lambda s, v: s.run(lambda x: x + 1, args=(v,)),
    "jdist.function argument": lambda s, v: jdist.function(
        lambda x: s.run(lambda y: y + 1, args=(x,)))(v),
    "dataset batch": lambda s, v: next(iter(s.experimental_distribute_dataset(
        [np.repeat(v, s.num_replicas_in_sync)]))),
    "numpy dataset": lambda s, v: next(iter(s.experimental_distribute_dataset(
        s.experimental_make_numpy_dataset(np.repeat(v, 4 * s.num_replicas_in_sync)).batch(
            s.num_replicas_in_sync)))),
}


@pytest.mark.parametrize("dtype", [np.int64, np.uint64])
@pytest.mark.parametrize("entry", sorted(ENTRIES))
@pytest.mark.parametrize("n", [1, 2, 8])
def test_64_bit_integers_jax_would_wrap_raise(n, entry, dtype):
    s = mirrored(n)
    with pytest.raises(errors.InvalidArgumentError, match="jax_enable_x64"):
        ENTRIES[entry](s, np.array([BIG], dtype))


@pytest.fixture
def warns_anew():
    """The float64 warning comes once per process; each test sees its own first one."""
    host_values._warn_narrowed.cache_clear()
    yield
    host_values._warn_narrowed.cache_clear()


@pytest.mark.parametrize("value", [INEXACT, 1e300, 0.5, -3.0, np.inf, np.nan])
@pytest.mark.parametrize("entry", sorted(ENTRIES))
@pytest.mark.parametrize("n", [1, 2, 8])
def test_float64_values_are_held_as_jax_jit_holds_them(n, entry, value, warns_anew):
    """Without x64, JAX's dtypes: a float64 value is float32 (0.1 is 0.100000001), as jax.jit
    holds it, with one X64CastWarning naming jax_enable_x64 and the cast."""
    s = mirrored(n)
    with pytest.warns(errors.X64CastWarning, match="jax_enable_x64.*astype"):
        out = ENTRIES[entry](s, np.array([value], np.float64))
    want = np.float32(value) + np.float32(1 if "argument" in entry else 0)
    for local in s.experimental_local_results(out):
        assert np.asarray(local).dtype == np.float32
        np.testing.assert_array_equal(np.asarray(local).ravel(), want)


def test_the_float64_warning_comes_once_per_process(warns_anew):
    s = mirrored(2)
    with pytest.warns(errors.X64CastWarning) as caught:
        for _ in range(3):
            s.run(lambda x: x + 1, args=(np.ones(2),))
    assert len(caught) == 1 and caught[0].filename == __file__


def _plus_one(x):
    return x + 1


REUSED = {  # Callables whose second call jax.jit would serve with the first call's program.
    "run": lambda s: lambda v: s.run(_plus_one, args=(v,)),
    "jdist.function of run": lambda s: jdist.function(lambda v: s.run(_plus_one, args=(v,))),
    "jdist.function": lambda s: jdist.function(_plus_one),
    "jdist.function lowered": lambda s: jdist.function(_plus_one).lower,
}


@pytest.mark.parametrize("entry", sorted(REUSED))
@pytest.mark.parametrize("n", [1, 2, 8])
def test_a_wide_int64_after_one_that_fits_raises(n, entry):
    """JAX holds both calls' values as int32, so a cached program would take the second,
    wrapped (2**40 + 5 as 5): it raises instead."""
    call = REUSED[entry](mirrored(n))
    out = call(np.array([7, 7], np.int64))
    if "lowered" not in entry:
        for local in mirrored(n).experimental_local_results(out):
            np.testing.assert_array_equal(np.asarray(local), [8, 8])
    with pytest.raises(errors.X64RequiredError, match="jax_enable_x64"):
        call(np.array([BIG, BIG]))


@pytest.mark.parametrize("entry", sorted(ENTRIES))
@pytest.mark.parametrize("n", [1, 3])
def test_float64_values_stay_float64_with_x64(n, entry):
    s = mirrored(n)
    with jax.enable_x64(True):
        out = ENTRIES[entry](s, np.array([INEXACT], np.float64))
        for local in s.experimental_local_results(out):
            assert np.asarray(local).dtype == np.float64
            np.testing.assert_array_equal(np.asarray(local).ravel(),
                                          INEXACT + 1 if "argument" in entry else INEXACT)


@pytest.mark.parametrize("entry", sorted(ENTRIES))
@pytest.mark.parametrize("n", [1, 3])
def test_64_bit_integers_that_fit_keep_their_values(n, entry):
    s = mirrored(n)
    value = np.array([2**31 - 2 if "argument" in entry else 2**31 - 1], np.int64)
    out = ENTRIES[entry](s, value)
    expected = value + 1 if "argument" in entry else value
    for local in s.experimental_local_results(out):
        np.testing.assert_array_equal(np.asarray(local).ravel(), expected.ravel()[:local.size])


@pytest.mark.parametrize("number", [2**31, -2**31 - 1, BIG])
@pytest.mark.parametrize("n", [1, 3])
def test_a_python_int_beyond_int32_given_to_run_is_tfs_int64_or_an_error(n, number):
    """TF takes such an int as int64; JAX without x64 cannot hold it (it raised OverflowError)."""
    s = mirrored(n)
    with pytest.raises(errors.X64RequiredError, match="jax_enable_x64"):
        s.run(lambda x: x + 1, args=(number,))
    with jax.enable_x64(True):
        out = s.run(lambda x: x + 1, args=(number,))
        assert {int(v) for v in s.experimental_local_results(out)} == {number + 1}


def _merge_sum(s, v):
    return s.run(lambda: jdist.get_replica_context().merge_call(
        lambda strategy, x: strategy.reduce("sum", x, axis=None), args=(v,)))


# The calls that compute with a host value (TF in the value's own dtype).
COMPUTING = {
    "reduce along an axis": lambda s, v: s.reduce("mean", v, axis=0),
    "reduce_to": lambda s, v: s.extended.reduce_to("sum", v, s.extended.worker_devices[0]),
    "batch_reduce_to": lambda s, v: s.extended.batch_reduce_to(
        "sum", [(v, s.extended.worker_devices[0])])[0],
    "all_reduce": lambda s, v: s.run(lambda: jdist.get_replica_context().all_reduce("sum", v)),
    "merge_call argument": _merge_sum,
    "mirror": lambda s, v: jdist.mirror(v, s),
}


@pytest.mark.parametrize("entry", sorted(COMPUTING))
@pytest.mark.parametrize("n", [1, 2, 3])
def test_a_float64_host_value_a_call_computes_with_is_float32(n, entry):
    """Without x64 the mean of 0.5, 1.5 and 2.0 is float32's 1.3333334, as jnp.mean gives."""
    if entry.endswith("reduce_to") and (n > 1 or entry == "reduce_to"):
        pytest.skip("a SUM of a plain value: TF refuses on several replicas, and reduce_to "
                    "on one gives the value back as it is")
    s, value = mirrored(n), np.array([0.5, 1.5, 2.0])
    adds = {"reduce along an axis": 1, "mirror": 1}.get(entry, n)
    want = (np.mean(value.astype(np.float32)) if entry == "reduce along an axis"
            else value.astype(np.float32) * np.float32(adds))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", errors.X64CastWarning)
        for local in s.experimental_local_results(COMPUTING[entry](s, value)):
            assert np.asarray(local).dtype == np.float32
            np.testing.assert_array_equal(local, want)


@pytest.mark.parametrize("entry", sorted(COMPUTING))
@pytest.mark.parametrize("n", [1, 2, 3])
def test_a_float64_host_value_computes_in_float64_with_x64(n, entry):
    if n > 1 and entry.endswith("reduce_to"):
        pytest.skip("TF refuses SUM of a value that is not per-replica on several replicas")
    s, value = mirrored(n), np.array([0.5, 1.5, 2.0])
    adds = {"reduce along an axis": 1, "mirror": 1}.get(entry, n)  # MEAN along the axis.
    want = np.mean(value) if entry == "reduce along an axis" else value * adds
    with jax.enable_x64(True):
        for local in s.experimental_local_results(COMPUTING[entry](s, value)):
            assert np.asarray(local).dtype == np.float64
            np.testing.assert_array_equal(local, want)


# The SUMs jdist computes of int64 host values (TF's are int64).
INT64_SUMS = {
    "reduce of a PerReplica": lambda s, v: s.reduce(
        "sum", jdist.PerReplica([v] * s.num_replicas_in_sync), axis=None),
    "reduce of values from a function": lambda s, v: s.reduce(
        "sum", s.experimental_distribute_values_from_function(lambda ctx: v), axis=None),
    "reduce_to": lambda s, v: s.extended.reduce_to(
        "sum", jdist.PerReplica([v] * s.num_replicas_in_sync), s.extended.worker_devices[0]),
    "batch_reduce_to": lambda s, v: s.extended.batch_reduce_to(
        "sum", [(jdist.PerReplica([v] * s.num_replicas_in_sync),
                 s.extended.worker_devices[0])])[0],
    "reduce of a host array along an axis": lambda s, v: s.reduce("sum", v, axis=0),
    "all_reduce of a host array": lambda s, v: s.experimental_local_results(s.run(
        lambda: jdist.get_replica_context().all_reduce("sum", v)))[0],
    "reduce of a numpy dataset's batch (a block's)": lambda s, v: s.reduce("sum", first_batch(
        s, s.experimental_make_numpy_dataset(rows_of(s, v, 2)).batch(s.num_replicas_in_sync)),
        axis=0),
    "reduce of a batch from a list": lambda s, v: s.reduce(
        "sum", first_batch(s, [rows_of(s, v, 1)]), axis=0),
}


def rows_of(s, v, batches):
    """``batches`` global batches of one row ``v`` per replica."""
    return np.tile(v[None], (batches * s.num_replicas_in_sync, 1))


def first_batch(s, dataset):
    """The first element of ``dataset`` distributed by ``s``."""
    return next(iter(s.experimental_distribute_dataset(dataset)))


@pytest.mark.parametrize("entry", sorted(INT64_SUMS))
@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_sum_of_int64_values_is_int32_without_x64_and_tfs_int64_with_it(n, entry):
    """Without x64 int64 host values are int32, as jax.jit holds them (their sum is int32's
    too: jdist does not bound it); with x64, TF's int64 sum (4 x 2**30 is 4294967296)."""
    s, big, small = mirrored(n), np.array([2**30], np.int64), np.array([2**20], np.int64)
    got = INT64_SUMS[entry](s, small)
    assert np.asarray(got).dtype == np.int32
    np.testing.assert_array_equal(got, [n * 2**20])
    with jax.enable_x64(True):
        got = INT64_SUMS[entry](s, big)
        assert np.asarray(got).dtype == np.int64
        np.testing.assert_array_equal(got, [n * 2**30])


@pytest.mark.parametrize("n", REPLICA_COUNTS)
def test_a_mirrored_knows_whether_run_returned_it(n):
    """TF's run returns a value every replica computed alike as a PerReplica of equal values,
    which reduce treats apart from a Mirrored (`values.is_step_output`): its SUM adds the
    copies, where a Mirrored's raises. Copies and pickles keep the mark; a Mirrored JAX rebuilds
    (tree_map, jax.jit) has none, and reduces as run's outputs do, on the strategy's count."""
    s = mirrored(n)
    x = np.array([1.5, -2.25], np.float32)
    step_output = s.run(lambda: jnp.asarray(x))
    declared = jdist.Mirrored([x] * n)
    kept = [lambda m: m, lambda m: pickle.loads(pickle.dumps(m)), copy.deepcopy]
    rebuilt = [lambda m: jax.tree_util.tree_map(lambda v: v, m), jax.jit(lambda m: m),
               lambda m: pickle.loads(pickle.dumps(jax.device_get(m)))]  # Saved host state.
    copies_added = np.sum([x] * n, axis=0, dtype=np.float32)
    mirrored_values = ((step_output, True), (declared, False)) if n > 1 else ((declared, False),)
    for value, from_run in mirrored_values:  # One replica's run returns its one value.
        for keep in kept:
            m = keep(value)
            assert type(m) is jdist.Mirrored and m.num_replicas == n
            assert values.is_step_output(m) == from_run
        for rebuild in rebuilt:
            m = rebuild(value)
            assert type(m) is jdist.Mirrored and values.is_step_output(m)
            np.testing.assert_array_equal(s.reduce("sum", m, axis=None), copies_added)
            np.testing.assert_array_equal(s.reduce("mean", m, axis=None), copies_added / n)


@pytest.mark.parametrize("n", [1, 3, 8])
def test_per_replica_prng_keys(n):
    """Typed PRNG keys per replica (from values_from_function, of one shape or ragged, or the
    constructor) draw what each key draws alone; they gather, and do not reduce. Building
    them raised TypeError ("Cannot interpret 'key<fry>' as a data type")."""
    s = mirrored(n)
    keys = s.experimental_distribute_values_from_function(
        lambda ctx: jax.random.key(ctx.replica_id_in_sync_group))
    split = s.experimental_distribute_values_from_function(
        lambda ctx: jax.random.split(jax.random.key(7), ctx.replica_id_in_sync_group + 1))
    built = jdist.PerReplica([jax.random.key(i) for i in range(n)]) if n > 1 else keys
    draw = lambda k: jax.random.normal(k, ())  # noqa: E731
    for value, last in ((keys, False), (split, True), (built, False)):
        out = s.run(lambda k: draw(k[-1] if last else k), args=(value,))
        want = [draw(jax.random.split(jax.random.key(7), i + 1)[-1] if last else jax.random.key(i))
                for i in range(n)]
        assert_local_results(s, out, want, 0, 0)
    gathered = s.gather(s.run(lambda k: k[None], args=(keys,)), 0)
    np.testing.assert_array_equal(jax.random.key_data(gathered),
                                  [jax.random.key_data(jax.random.key(i)) for i in range(n)])
    if n > 1:
        with pytest.raises(errors.UnsupportedValueError, match="PRNG keys"):
            s.reduce("sum", keys, axis=None)
        with pytest.raises(errors.UnsupportedValueError, match="PRNG keys"):
            s.run(lambda k: jdist.get_replica_context().all_reduce("sum", k), args=(keys,))


@pytest.mark.parametrize("where", ["jdist.function", "replica function"])
def test_values_from_function_while_tracing_is_a_typed_error(where):
    """It places values on the devices, which a trace cannot (JAX raised a ValueError)."""
    s = mirrored(3)
    make = lambda *_: s.experimental_distribute_values_from_function(  # noqa: E731
        lambda ctx: np.float32(ctx.replica_id_in_sync_group))
    with pytest.raises(errors.WrongContextError, match="traced"):
        if where == "jdist.function":
            jdist.function(make)()
        else:
            s.run(make, args=(jnp.float32(0),))
