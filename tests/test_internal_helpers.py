"""Private helpers' examples as tests: each runs an example their docstrings once held, and
asserts its output."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jdist
from jdist import errors
from jdist._src import host_values
from jdist._src import values
from jdist._src.input import auto_shard
from jdist._src.input.numpy_dataset import NumpyDataset
from jdist._src.reduce import collectives
from jdist._src.training import checkpoint
from jdist._src.uneven import schedule


def _read_only_aligned(shape):
    x = host_values.aligned_empty(shape, np.float32)
    x[:] = 1
    x.flags.writeable = False
    return x


def test_aligned_empty_is_aligned():
    x = host_values.aligned_empty((3, 5), np.float32)
    assert x.ctypes.data % host_values.ALIGNMENT == 0


def test_read_only():
    assert host_values.read_only(np.ones(2)).flags.writeable is False
    assert host_values.read_only(3) == 3


def test_held_copy_dtypes():
    assert host_values.held_copy(np.arange(3)).dtype == np.dtype("int32")
    assert host_values.held_copy(np.ones(2, np.float32)).dtype == np.dtype("float32")


def test_placed_as_is():
    x = host_values.aligned_empty((4, 2), np.float32)
    x.flags.writeable = False
    assert (host_values.placed_as_is(x), host_values.placed_as_is(x[:, :1]),
            host_values.placed_as_is(np.zeros(2, np.float32))) == (True, False, False)


def test_placed_replicated_shares_the_host_memory():
    x = _read_only_aligned((2, 16))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("r",))
    both = jax.sharding.NamedSharding(mesh, P())
    on_both, = host_values.placed_replicated([x], both)
    assert {s.data.unsafe_buffer_pointer() == x.ctypes.data
            for s in on_both.addressable_shards} == {True}


def test_placed_split_shares_each_rows_memory():
    x = _read_only_aligned((2, 16))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("r",))
    split = jax.sharding.NamedSharding(mesh, P("r"))
    rows, = host_values.placed_split([x], split)
    assert [s.data.unsafe_buffer_pointer() == x[i].ctypes.data
            for i, s in enumerate(rows.addressable_shards)] == [True, True]


def test_check_host_leaves():
    assert host_values.check_host_leaves([np.ones(2, np.float32), 3]) is None
    with pytest.raises(errors.X64RequiredError, match="a host value of dtype int64"):
        host_values.check_host_leaves([np.array([2**40])])


def test_check_arrays_and_check_placeable_accept_numbers_and_arrays():
    assert host_values.check_arrays({"a": np.ones(2), "b": 3}, "all_gather") is None
    assert host_values.check_placeable([1.0, np.ones(2)]) is None


def test_rebatched_for_worker():
    rows = [np.arange(7), np.arange(7, 10)]
    batches = auto_shard.rebatched_for_worker(iter(rows), 2, 2, 1, 7)
    assert [b.tolist() for b in batches] == [[0, 1], [2], [3, 4], [5, 6], [7, 8], [9]]


def test_numpy_dataset_blocks():
    blocks = list(NumpyDataset(np.arange(5)).batch(2).blocks(4))
    assert len(blocks) == 2
    assert blocks[0] == (2, slice(0, 4, None))
    assert blocks[1][0] is None
    np.testing.assert_array_equal(blocks[1][1], np.array([4]))


def test_full_batches_in_order():
    assert NumpyDataset(np.arange(10)).batch(3).repeat().full_batches_in_order() == 3
    assert NumpyDataset(np.arange(10)).shuffle(4).batch(3).full_batches_in_order() is None


def test_gather_axis_mean_dtype_mean_count():
    assert collectives.gather_axis(-1, 2) == 1
    assert [str(collectives.mean_dtype(d)) for d in ("int8", "float16", "int32")] == [
        "float32", "float16", "float32"]
    assert collectives.mean_count((2, 3), (0,), 2) == 4
    assert collectives.mean_count((2, 3), (0, 1), 2, total_rows=3) == 9


def test_tree_spec():
    assert checkpoint.tree_spec({"w": np.zeros((2, 3), np.float32)}) == [
        ["['w']", [2, 3], "float32"]]


def test_is_chief_and_log_once(caplog):
    assert jdist.is_chief() is True
    with caplog.at_level(logging.DEBUG, logger="jdist"):
        jdist.log_once("step %d", 3, level=logging.DEBUG)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.DEBUG, "step 3")]


def test_grouped_collectives():
    mesh = jax.sharding.Mesh(jax.devices()[:1], ("r",))
    body = lambda a, b: (lax.psum(a * 2, "r"), lax.psum(jnp.sin(b), "r"))
    f = jax.shard_map(body, mesh=mesh, in_specs=P("r"), out_specs=P("r"), check_vma=False)
    inner = jax.make_jaxpr(f)(jnp.ones(1), jnp.ones(1)).jaxpr.eqns[0].params["jaxpr"]
    grouped = schedule.grouped_collectives(inner, lambda e: e.primitive.name == "psum")
    assert [e.primitive.name for e in grouped.eqns] == ["mul", "sin", "jdist_collectives"]


def test_check_replica_count_refuses_another_count():
    with pytest.raises(errors.InvalidArgumentError):
        values.check_replica_count(values.Mirrored([np.float32(1)] * 2), 3, "strategy.reduce")


def test_default_strategy_reduce_and_numpy_dataset():
    s = jdist.get_strategy()
    assert float(s.reduce("mean", np.float32(4.0))) == 4.0
    ds = s.experimental_make_numpy_dataset(np.arange(3)).batch(2)
    assert [b.tolist() for b in ds] == [[0, 1], [2]]
