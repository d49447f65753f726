"""SEMANTICS.md, gather(value, axis): concatenation of the replicas' real values."""

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


@pytest.mark.parametrize("n", REPLICA_COUNTS)
@pytest.mark.parametrize("axis", [0, 1])
def test_gather_concatenates_along_axis(n, axis):
    s = mirrored(n)
    comps = [np.arange(6, dtype=np.float32).reshape(2, 3) + 10 * i for i in range(n)]
    got = s.gather(per_replica(s, comps) if n > 1 else comps[0], axis=axis)
    np.testing.assert_array_equal(got, np.concatenate(comps, axis=axis) if n > 1 else comps[0])


def test_gather_uneven_sizes_returns_the_real_rows():
    s = mirrored(3)
    comps = [np.full((rows, 2), rows - 1, np.float32) for rows in (1, 2, 3)]
    got = s.gather(per_replica(s, comps), axis=0)
    assert got.shape == (6, 2)
    np.testing.assert_array_equal(got, np.concatenate(comps))


def test_gather_with_empty_replica():
    s = mirrored(4)
    comps = [np.float32([1., 2.]), np.float32([]), np.float32([3.]), np.float32([])]
    np.testing.assert_array_equal(s.gather(per_replica(s, comps), axis=0), [1., 2., 3.])


def test_gather_uneven_along_another_axis_is_an_error():
    s = mirrored(2)
    v = per_replica(s, [np.ones((1, 2), np.float32), np.ones((2, 2), np.float32)])
    with pytest.raises(errors.ShapeMismatchError):
        s.gather(v, axis=1)


SCALAR_GATHERS = {
    "gather": lambda s, v: s.gather(v, axis=0),
    "all_gather": lambda s, v: s.run(
        lambda x: jdist.get_replica_context().all_gather(x, axis=0), args=(v,)),
}


@pytest.mark.parametrize("how", list(SCALAR_GATHERS))
def test_gather_of_scalars_is_an_error_on_several_replicas(how):
    s = mirrored(2)
    v = s.run(lambda: jnp.float32(jdist.get_replica_context().replica_id_in_sync_group))
    with pytest.raises(ValueError, match="rank >= 1"):
        SCALAR_GATHERS[how](s, v)


@pytest.mark.parametrize("how", list(SCALAR_GATHERS))
def test_one_replica_hands_a_scalar_back_as_it_is(how):
    # TF: with one replica, gather and all_gather return the value itself, scalars included.
    s = mirrored(1)
    assert float(SCALAR_GATHERS[how](s, jnp.float32(3.5))) == 3.5


@pytest.mark.parametrize("n", [1, 2, 4])
def test_gather_of_plain_tensor_comes_back_unchanged(n):
    x = jnp.arange(3.0)
    np.testing.assert_array_equal(mirrored(n).gather(x, axis=0), x)


def test_gather_of_mirrored_repeats_the_value():
    s = mirrored(3)
    m = s.run(lambda: jdist.get_replica_context().all_reduce("sum", jnp.ones((1, 2))))
    np.testing.assert_array_equal(s.gather(m, axis=0), np.full((3, 2), 3.0, np.float32))


AXIS_GATHERS = {
    "gather": lambda s, v, axis: s.gather(v, axis=axis),
    "all_gather": lambda s, v, axis: s.experimental_local_results(s.run(
        lambda x: jdist.get_replica_context().all_gather(x, axis), args=(v,)))[0],
}


@pytest.mark.parametrize("how", list(AXIS_GATHERS))
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("axis", [-1, -2])
@pytest.mark.parametrize("n", [2, 3, 8])
def test_a_negative_axis_raises_where_tfs_collective_ops_gather(n, axis, dtype, how):
    # TF's default cross-device ops on several devices (CollectiveAllReduce) build the gather
    # with range(axis), which raises on a negative axis; they gather all but int32 values.
    s = mirrored(n)
    v = per_replica(s, [np.ones((2, 3), dtype)] * n)
    with pytest.raises(errors.InvalidArgumentError, match=f"axis={axis + 2}"):
        AXIS_GATHERS[how](s, v, axis)


@pytest.mark.parametrize("numbers", ["counts", "zeros"])
@pytest.mark.parametrize("source", ["values", "dataset batch"])
@pytest.mark.parametrize("axis", [-1, -2])
@pytest.mark.parametrize("n", [2, 3])
def test_a_negative_axis_follows_the_dtype_jax_holds_int64_host_numbers_in(
        n, axis, source, numbers):
    # Dtypes are JAX's: with x64, int64, which TF gathers with its collective ops, which raise
    # on a negative axis (measured: TF 2.21, "Requires start <= limit"); without it, int32,
    # which TF concatenates (the axis counts from the end).
    s = mirrored(n)
    comps = [np.arange(6, dtype=np.int64).reshape(2, 3) + 10 * i + 1 for i in range(n)]
    if numbers == "zeros":
        comps = [np.zeros_like(c) for c in comps]
    if source == "values":
        value = per_replica(s, comps)
    else:
        data = np.concatenate(comps)
        value = next(iter(s.experimental_distribute_dataset(
            s.experimental_make_numpy_dataset(data).batch(len(data)))))
    np.testing.assert_array_equal(s.gather(value, axis=axis), np.concatenate(comps, axis=axis))
    with jax.enable_x64(True):
        value = per_replica(s, comps)
        with pytest.raises(errors.InvalidArgumentError, match=f"axis={axis + 2}"):
            s.gather(value, axis=axis)
        np.testing.assert_array_equal(s.gather(value, axis=axis + 2),
                                      np.concatenate(comps, axis=axis + 2))


@pytest.mark.parametrize("how", list(AXIS_GATHERS))
@pytest.mark.parametrize("axis", [-1, -2])
@pytest.mark.parametrize("case", ["int32", "ReductionToOneDevice", "NcclAllReduce",
                                  "one replica"])
def test_a_negative_axis_counts_from_the_end_where_tf_concatenates(case, axis, how):
    # int32 values go to ReductionToOneDevice, which concatenates, as do the explicitly chosen
    # ops; one replica's value comes back as it is.
    n = 1 if case == "one replica" else 3
    ops = getattr(jdist, case)() if case[0].isupper() else None
    s = jdist.MirroredStrategy(jax.local_devices()[:n], cross_device_ops=ops)
    dtype = np.int32 if case == "int32" else np.float32
    comps = [np.arange(6, dtype=dtype).reshape(2, 3) + 10 * i for i in range(n)]
    got = AXIS_GATHERS[how](s, per_replica(s, comps) if n > 1 else comps[0], axis)
    np.testing.assert_array_equal(got, np.concatenate(comps, axis=axis))


def test_gather_axis_out_of_range():
    s = mirrored(2)
    with pytest.raises(ValueError, match="out of range"):
        s.gather(per_replica(s, [np.ones((2,), np.float32)] * 2), axis=1)


def test_gather_nest():
    s = mirrored(2)
    out = s.run(lambda: {"a": jnp.ones(2) * jdist.get_replica_context().replica_id_in_sync_group})
    np.testing.assert_array_equal(s.gather(out, axis=0)["a"], [0., 0., 1., 1.])


@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.given(n=st.sampled_from(REPLICA_COUNTS), data=st.data(),
                  inner=hnp.array_shapes(min_dims=0, max_dims=2, max_side=3))
def test_property_gather_axis0_equals_numpy_concatenate(n, data, inner):
    s = mirrored(n)
    lengths = data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    comps = [np.arange(ln * int(np.prod(inner)), dtype=np.float32).reshape((ln,) + inner) + 100 * i
             for i, ln in enumerate(lengths)]
    v = per_replica(s, comps) if n > 1 else comps[0]
    np.testing.assert_array_equal(s.gather(v, axis=0), np.concatenate(comps, axis=0))


# ----------------------------------------------- issue 9: the result lives on ONE device
@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("uneven", [False, True])
def test_gather_puts_its_result_on_one_device(n, axis, uneven):
    # TF gathers to one device, not a copy on every replica's device (8x the memory on 8).
    s = mirrored(n)
    rows = [2 + (i % 2 if uneven and axis == 0 else 0) for i in range(n)]
    comps = [np.arange(r * 3, dtype=np.float32).reshape(r, 3) + 100 * i
             for i, r in enumerate(rows)]
    got = s.gather(per_replica(s, comps), axis=axis)
    assert got.devices() == {s.extended.worker_devices[0]}
    np.testing.assert_array_equal(got, np.concatenate(comps, axis=axis))


@pytest.mark.parametrize("how", list(SCALAR_GATHERS))
@pytest.mark.parametrize("axis", [(0, 1), None, 0.0])
def test_gather_takes_one_axis(how, axis):
    # TF's gather and all_gather concatenate along one int axis; a tuple raises there too.
    s = mirrored(2)
    v = per_replica(s, [np.ones((2, 3), np.float32)] * 2)
    gather = {"gather": lambda: s.gather(v, axis=axis),
              "all_gather": lambda: s.run(
                  lambda x: jdist.get_replica_context().all_gather(x, axis=axis), args=(v,))}
    with pytest.raises(errors.InvalidArgumentError, match="one axis"):
        gather[how]()


@pytest.mark.parametrize("n", REPLICA_COUNTS)
def test_gather_leaves_the_value_it_gathers(n):
    # One replica's value on the gathering device was the program's donated input: it was
    # deleted by the first gather (RuntimeError on the second).
    s = mirrored(n)
    rows = [np.full((2, 3), r, np.float32) for r in range(n)]
    v = jdist.PerReplica([jax.device_put(x, d) for x, d in zip(rows, s.extended.worker_devices)])
    for _ in range(2):
        np.testing.assert_array_equal(np.asarray(s.gather(v, axis=0)), np.concatenate(rows))
    assert_local_results(s, v, rows)
