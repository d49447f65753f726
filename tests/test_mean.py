"""A MEAN is TF's ``truediv`` of the sum, at every entry point, to the last bit.

A float MEAN is an IEEE division, never XLA's multiplication by a reciprocal. For integers, the sum
keeps the values' dtype and wraps as TF's does; the division is in float32 for 8- and 16-bit
integers and in float64 for wider ones (TF's ``_TRUEDIV_TABLE``). JAX has float64 only in 64-bit
mode: without it such a MEAN divides in JAX's default float, float32. On one replica an element-wise
MEAN is the value itself, dtype included. The values are chosen so that the sums wrap around.
"""

import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import jdist
from jdist._src.reduce import collectives
from jdist.testing import REPLICA_COUNTS, mirrored, mirrored_reducing_to_one_device
from jdist.testing import per_replica

MEAN = jdist.ReduceOp.MEAN
# dtype -> the values of replica i: (large, small + i), so that summing the replicas wraps.
NARROW = ("int8", "uint8", "int16")
WIDE = ("int32",)


def components(n, dtype, rows=lambda i: 2 - i % 3):
    """Replica i holds ``rows(i)`` rows of ``[big, i + 1]`` (by default 2, 1, 0, 2, 1, 0, ...
    rows); the big ones wrap when summed."""
    big = np.iinfo(dtype).max // 2 + 3
    return [np.array([[big, i + 1]] * rows(i), dtype).reshape(-1, 2) for i in range(n)]


def tf_mean(comps, axis=None, x64=True):
    """NumPy, TF's arithmetic: sums in the values' dtype, then truediv in its float dtype
    (without x64: JAX's default float, float32)."""
    dtype = comps[0].dtype
    mean = np.float32 if dtype.itemsize <= 2 or not x64 else np.float64
    if axis is None:
        total, count = np.sum(np.stack(comps), axis=0, dtype=dtype), len(comps)
    else:
        total = np.sum([np.sum(c, axis=axis, dtype=dtype) for c in comps], axis=0, dtype=dtype)
        count = sum(c.shape[axis] for c in comps)
    return total.astype(mean) / np.asarray(count).astype(dtype).astype(mean)


def even(n, dtype):
    return components(n, dtype, rows=lambda i: 1)


def in_run(s, v):
    return s.run(lambda x: jdist.get_replica_context().all_reduce("mean", x), args=(v,))


def in_merge_call(s, v, axis=None):
    def step(x):
        return jdist.get_replica_context().merge_call(
            lambda strategy, y: strategy.reduce(MEAN, y, axis=axis), args=(x,))
    return s.run(step, args=(v,))


def cross_device(ops):
    return lambda s, v: ops.reduce(MEAN, v, destinations=v)


def batch_reduce_to(s, v):
    with s.scope():  # One pair: TF refuses a batch of two with an int32 value.
        return s.extended.batch_reduce_to(MEAN, [(v, "CPU:0")])[0]


# name -> (the entry point, called with the strategy and the value); all element-wise.
ELEMENT_WISE = {
    "strategy.reduce": lambda s, v: s.reduce(MEAN, v, axis=None),
    "all_reduce in run": in_run,
    "merge_call": in_merge_call,
    "batch_reduce_to": batch_reduce_to,
    "ReductionToOneDevice": cross_device(jdist.ReductionToOneDevice()),
    "NcclAllReduce unpacked": cross_device(jdist.NcclAllReduce(num_packs=0)),
    "HierarchicalCopyAllReduce": cross_device(jdist.HierarchicalCopyAllReduce(num_packs=2)),
}
entry_points = pytest.mark.parametrize("entry", list(ELEMENT_WISE))
several = pytest.mark.parametrize("n", [n for n in REPLICA_COUNTS if n > 1])


def assert_every_result(s, got, expected):
    results = s.experimental_local_results(got) if isinstance(got, jdist.DistributedValues) \
        else [got]
    for r in results:
        assert r.dtype == expected.dtype, (r.dtype, expected.dtype)
        np.testing.assert_array_equal(np.asarray(r), expected)


@several
@entry_points
@pytest.mark.parametrize("dtype", NARROW)
def test_narrow_integers_divide_in_float32(n, entry, dtype):
    # TF's default ops on several devices refuse 8- and 16-bit integers in all_reduce and
    # batch_reduce_to (tests/test_reduce.py); ReductionToOneDevice takes them.
    s = mirrored_reducing_to_one_device(n)
    comps = even(n, dtype)
    assert_every_result(s, ELEMENT_WISE[entry](s, per_replica(s, comps)), tf_mean(comps))


@several
@entry_points
def test_wide_integers_divide_in_float64_with_x64(n, entry):
    with jax.enable_x64(True):
        s = mirrored(n)
        comps = even(n, "int32")
        assert_every_result(s, ELEMENT_WISE[entry](s, per_replica(s, comps)), tf_mean(comps))


@several
@entry_points
def test_wide_integers_without_x64_divide_in_float32(n, entry):
    s, comps = mirrored(n), even(n, "int32")
    assert_every_result(s, ELEMENT_WISE[entry](s, per_replica(s, comps)),
                        tf_mean(comps, x64=False))


@pytest.mark.parametrize("n", REPLICA_COUNTS)
@pytest.mark.parametrize("dtype", NARROW + WIDE)
def test_along_an_axis_the_count_is_every_row(n, dtype):
    """Partial batches (replicas with 2, 1 or no rows): TF divides by every real row."""
    s = mirrored(n)
    comps = components(n, dtype)
    with jax.enable_x64(True):
        got = s.reduce(MEAN, per_replica(s, comps), axis=0)
        assert_every_result(s, got, tf_mean(comps, axis=0))
    assert_every_result(s, s.reduce(MEAN, per_replica(s, comps), axis=0),
                        tf_mean(comps, axis=0, x64=False))


@pytest.mark.parametrize("entry", ["all_reduce in run", "merge_call",
                                   "ReductionToOneDevice", "NcclAllReduce unpacked"])
@pytest.mark.parametrize("dtype", NARROW + WIDE)
def test_one_replica_returns_the_value_itself(entry, dtype):
    s = mirrored(1)
    (value,) = even(1, dtype)
    assert_every_result(s, ELEMENT_WISE[entry](s, per_replica(s, [value])), value)


@pytest.mark.parametrize("dtype", NARROW + WIDE)
def test_one_replicas_per_replica_value_is_divided_by_strategy_reduce(dtype):
    # TF's MirroredStrategy wraps one replica's value from a function in a PerReplica, whose
    # MEAN strategy.reduce divides (its dtype TF's truediv's); a plain value is handed back.
    s = mirrored(1)
    (value,) = even(1, dtype)
    with jax.enable_x64(True):
        assert_every_result(s, s.reduce(MEAN, per_replica(s, [value]), axis=None),
                            tf_mean([value]))
    assert_every_result(s, s.reduce(MEAN, per_replica(s, [value]), axis=None),
                        tf_mean([value], x64=False))
    assert_every_result(s, s.reduce(MEAN, value, axis=None), value)


@pytest.mark.parametrize("device", [0, 1])
@pytest.mark.parametrize("dtype", ["int16", "int32"])
def test_one_value_elsewhere_is_divided_by_one(device, dtype):
    """TF's shortcut returns a single value as it is only on the destinations' devices."""
    one = jax.device_put(np.array([7, -3], dtype), jax.devices()[0])
    ops = jdist.NcclAllReduce()
    if device == 0 or dtype == "int16":
        got = ops.reduce(MEAN, one, destinations=f"CPU:{device}")
        expected = one if device == 0 else np.array([7, -3], np.float32)
        assert_every_result(None, got, np.asarray(expected))
    else:
        got = ops.reduce(MEAN, one, destinations=f"CPU:{device}")
        assert_every_result(None, got, np.array([7.0, -3.0], np.float32))
        with jax.enable_x64(True):
            got = ops.reduce(MEAN, one, destinations=f"CPU:{device}")
            assert_every_result(None, got, np.array([7.0, -3.0]))


def test_a_mirrored_value_keeps_its_dtype_a_step_output_does_not():
    """TF's Mirrored's MEAN is itself; what TF's run returns for a value every replica computes
    alike is a PerReplica of equal values, whose MEAN divides their sum (tests/
    test_tf_conformance.py checks both against TF)."""
    s = mirrored(3)
    declared = jdist.Mirrored([np.array([5, 6], np.int32)] * 3)
    assert_every_result(s, s.reduce(MEAN, declared, axis=None), np.array([5, 6], np.int32))
    step_output = s.run(lambda: jnp.array([5, 6], jnp.int32))
    assert_every_result(s, s.reduce(MEAN, step_output, axis=None), np.float32([5.0, 6.0]))
    with jax.enable_x64(True):
        assert_every_result(s, s.reduce(MEAN, step_output, axis=None), np.array([5.0, 6.0]))


@pytest.mark.parametrize("n", [3, 5, 6, 7])
@entry_points
def test_float_mean_is_a_true_division(n, entry):
    """Sums of small integers are exact, so only the division can differ (146 / 9 in float32 is
    16.222221, XLA's 146 * (1 / 9) is 16.222223)."""
    s = mirrored(n)
    comps = [np.arange(40, dtype=np.float32).reshape(20, 2) + 7 * i for i in range(n)]
    expected = np.sum(comps, axis=0, dtype=np.float32) / np.float32(n)
    assert_every_result(s, ELEMENT_WISE[entry](s, per_replica(s, comps)), expected)
    along = np.float32(np.sum(comps, dtype=np.float32)) / np.float32(40 * n)
    assert_every_result(s, s.reduce(MEAN, per_replica(s, comps), axis=(0, 1)), along)


@several
@pytest.mark.parametrize("dtype", NARROW + WIDE)
def test_uneven_steps_follow_the_same_rule(n, dtype):
    """Replicas with 2, 1 or no rows (the exact uneven plan): each all-reduces its row sums."""
    s = mirrored_reducing_to_one_device(n) if dtype in NARROW else mirrored(n)
    comps = components(n, dtype)
    sums = [np.sum(c, axis=0, dtype=dtype) for c in comps]

    def step(x):
        return jdist.get_replica_context().all_reduce("mean", jnp.sum(x, axis=0, dtype=x.dtype))
    with jax.enable_x64(True):
        assert_every_result(s, s.run(step, args=(per_replica(s, comps),)), tf_mean(sums))
    assert_every_result(s, s.run(step, args=(per_replica(s, comps),)),
                        tf_mean(sums, x64=False))


@pytest.mark.parametrize("n", [1, 3])
def test_a_step_keeps_one_program_per_x64_mode(n):
    """A program traced in 64-bit mode computes in other dtypes: the mode selects it, as in
    ``jax.jit``."""
    s = mirrored(n)
    v = per_replica(s, even(n, "int32"))

    def step(x):
        return jdist.get_replica_context().all_reduce("mean", x), x.astype(jnp.float32) / 3

    with jax.enable_x64(True):
        mean, third = s.run(step, args=(v,))
    assert s.experimental_local_results(third)[0].dtype == np.float32
    assert s.experimental_local_results(mean)[0].dtype == (np.int32 if n == 1 else np.float64)
    if n > 1:  # Without x64: JAX's default float.
        assert s.experimental_local_results(s.run(step, args=(v,))[0])[0].dtype == np.float32
    else:  # One replica's MEAN is the value itself: no float64 needed.
        assert s.experimental_local_results(s.run(step, args=(v,))[0])[0].dtype == np.int32


@pytest.mark.parametrize("n", REPLICA_COUNTS)
@pytest.mark.parametrize("entry", [lambda s, v: s.reduce(MEAN, v, axis=0),
                                   lambda s, v: in_merge_call(s, v, axis=0)],
                         ids=["reduce", "merge_call"])
def test_along_rows_each_replica_sums_its_rows_first(n, entry):
    """TF sums each replica's rows, then adds the replicas' sums in order, then divides; traced,
    XLA must not fold the two sums into one in another order (replicas of 2 rows, so that each
    replica's own sum has one order)."""
    s = mirrored(n)
    rng = np.random.default_rng(n)
    comps = [rng.normal(size=(2, 256)).astype(np.float32) for _ in range(n)]
    total = functools.reduce(operator.add, [c[0] + c[1] for c in comps])  # In replica order.
    assert_every_result(s, entry(s, per_replica(s, comps)), total / np.float32(2 * n))


@settings(max_examples=60, deadline=None)
@given(data=st.data(), count=st.sampled_from([1, 2, 3, 4, 8, 16, 64, 96, 256, 1024]),
       dtype=st.sampled_from(["float32", "float16", "bfloat16"]))
def test_a_power_of_two_count_multiplies_by_its_reciprocal_bit_for_bit(data, count, dtype):
    """A count that is a power of two becomes a multiplication XLA fuses into its users (a
    lax.pmean's form); the quotient is still the division's, bits included: NumPy's for normal
    numbers, and XLA's own division's for all others but one kind. Where the float32 the
    division computes in holds a subnormal (bfloat16's and float32's own subnormals, and their
    quotients), XLA on CPUs flushes it to zero as TF does, or not, by the flags of the thread
    that runs the program (one run here gave XLA's division 0x0080 for bfloat16 0x00FF / 2,
    where TF gives 0): there the mean is a zero or NumPy's exact quotient."""
    dtype, uint = jnp.dtype(dtype), f"uint{8 * jnp.dtype(dtype).itemsize}"
    bits = data.draw(st.lists(st.integers(0, 2**(8 * dtype.itemsize) - 1), min_size=1,
                              max_size=16))
    totals = np.array(bits, uint).view(dtype)
    got = np.asarray(jax.jit(lambda t: collectives.finish(MEAN, t, count))(totals))
    divided = jax.jit(lambda t: t / jax.lax.optimization_barrier(jnp.full(t.shape, count, dtype)))
    with np.errstate(invalid="ignore", over="ignore"):  # NaN and infinite bit patterns.
        quotient = totals.astype(np.float32) / np.float32(count)
        want = quotient.astype(dtype)
    tiny = np.finfo(np.float32).tiny
    by_thread = (np.abs(totals.astype(np.float32)) < tiny) | (np.abs(quotient) < tiny)
    by_thread &= totals.astype(np.float32) != 0
    np.testing.assert_array_equal(got.view(uint)[~by_thread],
                                  np.asarray(divided(totals)).view(uint)[~by_thread])
    flushed = got[by_thread].astype(np.float32) == 0
    assert np.all(flushed | (got.view(uint)[by_thread] == want.view(uint)[by_thread]))
    normal = np.abs(want.astype(np.float32)) >= float(jnp.finfo(dtype).tiny)
    np.testing.assert_array_equal(got.view(uint)[normal], want.view(uint)[normal])
