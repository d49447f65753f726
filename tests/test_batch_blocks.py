"""Batch blocks: a numpy dataset's full batches placed several at a time (`batch_blocks`).

An element held in a block must be, for every reader, the batch TF's split gives: the same
values per replica, the same results from `run`, one compile per loop.
"""

import copy
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdist
from jdist._src.input import blocks as batch_blocks
from jdist._src.input import in_place as in_place_batches
from jdist._src.input import prefetch
from jdist.testing import count_compiles, mirrored

BLOCKED_REPLICAS = (2, 3, 4, 8)


def tf_split(batch, n):
    """TF's rule: consecutive chunks of ceil(B / n) rows, trailing replicas short or empty."""
    per = -(-len(batch) // n)
    return [batch[min(i * per, len(batch)):min((i + 1) * per, len(batch))] for i in range(n)]


def data(rows, features=3):
    return {"x": np.arange(rows * features, dtype=np.float32).reshape(rows, features),
            "y": np.arange(rows, dtype=np.int32)}


def batches(d, batch, order=None):
    order = np.arange(len(d["y"])) if order is None else order
    return [{k: v[order[i:i + batch]] for k, v in d.items()}
            for i in range(0, len(order), batch)]


def elements(strategy, dataset, **options):
    return list(strategy.experimental_distribute_dataset(dataset, jdist.InputOptions(**options)))


@pytest.mark.parametrize("n", BLOCKED_REPLICAS)
@pytest.mark.parametrize("rows,batch", [(96, 24), (100, 24), (24 * 40, 24)])
@pytest.mark.parametrize("buffer", [0, 1])
def test_each_element_holds_tf_split_of_its_batch(n, rows, batch, buffer):
    # 96 rows: whole blocks only; 100: a partial last batch after them; 960: blocks of the
    # block size and a last block padded with positions nobody reads.
    s, d = mirrored(n), data(rows)
    batch = batch // n * n
    got = elements(s, s.experimental_make_numpy_dataset(d).batch(batch),
                   experimental_per_replica_buffer_size=buffer)
    want = batches(d, batch)
    assert len(got) == len(want)
    for element, host in zip(got, want):
        for key in host:
            for value, chunk in zip(element[key].values, tf_split(host[key], n)):
                np.testing.assert_array_equal(np.asarray(value), chunk)


@pytest.mark.parametrize("n", [2, 8])
@pytest.mark.parametrize("buffer", [0, 1])
def test_large_blocks_hold_tf_split_of_each_batch(n, buffer):
    # Batches of 1 MiB make blocks of 3 batches (`batch_blocks.BLOCK_BYTES`).
    s, d, batch = mirrored(n), data(80, features=16384), 16
    got = elements(s, s.experimental_make_numpy_dataset(d).batch(batch),
                   experimental_per_replica_buffer_size=buffer)
    for element, host in zip(got, batches(d, batch), strict=True):
        for key in host:
            for value, chunk in zip(element[key].values, tf_split(host[key], n)):
                np.testing.assert_array_equal(np.asarray(value), chunk)


@pytest.mark.parametrize("n", (2, 8))
def test_epochs_that_drop_their_elements_read_tf_split_of_each_batch(n):
    # Blocks are freed as their elements go, and later ones read the data anew.
    s, d, batch = mirrored(n), data(40 * 8), 8
    shuffled = s.experimental_make_numpy_dataset(d).shuffle(
        320, seed=3, reshuffle_each_iteration=False).batch(batch)
    want = [b["x"] for b in shuffled]  # The same order every pass.
    dist = s.experimental_distribute_dataset(shuffled)
    for _ in range(3):
        got = []
        for element in dist:
            got.append(np.asarray(s.gather(element["x"], 0)))
        assert len(got) == len(want)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)


def buffers(block):
    """The addresses of the device buffers holding a placed ``block``."""
    return {shard.data.unsafe_buffer_pointer() for shard in block.addressable_shards}


def recording_placements(monkeypatch):
    """A list of the blocks `batch_blocks` places replicated (each placement's list of one block
    per leaf), in order."""
    placed, place = [], batch_blocks.placed_replicated
    monkeypatch.setattr(batch_blocks, "placed_replicated",
                        lambda *a: placed.append(place(*a)) or placed[-1])
    return placed


def cutting(monkeypatch):
    """A list that grows by one each time a block's batches are cut out into elements."""
    cuts, cut = [], batch_blocks.BlockFeed._cut_placed
    monkeypatch.setattr(batch_blocks.BlockFeed, "_cut_placed",
                        lambda self, *a: cuts.append(1) or cut(self, *a))
    return cuts


@pytest.mark.parametrize("n", [2, 8])
def test_consecutive_batches_are_placed_from_the_datasets_own_memory(n, monkeypatch):
    # On CPU devices each device's buffer of a block of consecutive batches is the dataset's
    # aligned read-only copy itself; the short last block's is the 64 batches ending with its
    # 3 where that is aligned too (every leaf's batch a multiple of 64 bytes: x's 48n bytes
    # on n = 8, not n = 2), else a copy; shuffled rows are copied. Blocks of 64 batches of 4n
    # rows, then a last block of 3.
    s, d = mirrored(n), data(4 * n * (2 * 64 + 3))
    rows = s.experimental_make_numpy_dataset(d)
    x = rows.arrays["x"]
    assert not x.flags.writeable
    placed = recording_placements(monkeypatch)
    got = elements(s, rows.batch(4 * n))
    block_bytes = 64 * x[:4 * n].nbytes
    assert buffers(placed[0][0]) == {x.ctypes.data}
    assert buffers(placed[1][0]) == {x.ctypes.data + block_bytes}
    own = range(x.ctypes.data, x.ctypes.data + x.nbytes)
    if n == 8:
        assert buffers(placed[2][0]) == {x.ctypes.data + x.nbytes - block_bytes}
    else:
        assert not any(b in own for b in buffers(placed[2][0]))
    elements(s, rows.shuffle(8, seed=1).batch(4 * n))
    assert not any(b in own for b in buffers(placed[3][0]))
    # Data shorter than a block: one block of its own 5 full batches, read in place in every
    # epoch.
    short = s.experimental_make_numpy_dataset(data(4 * n * 5 + 1))
    x = short.arrays["x"]
    elements(s, short.batch(4 * n).repeat(2))
    assert buffers(placed[-1][0]) == {x.ctypes.data}
    for element, host in zip(got, batches(d, 4 * n), strict=True):
        np.testing.assert_array_equal(np.asarray(s.gather(element["x"], 0)), host["x"])


def counting_placements(monkeypatch):
    """A list that grows by one at each block `batch_blocks` places replicated."""
    placed, place = [], batch_blocks.placed_replicated
    monkeypatch.setattr(batch_blocks, "placed_replicated",
                        lambda *a: placed.append(1) or place(*a))
    return placed


@pytest.mark.parametrize("n", [4, 8])
def test_blocks_read_in_place_are_placed_once_and_kept_for_later_epochs(n, monkeypatch):
    # Every epoch of one distributed dataset reads the same placed blocks, the dataset's own
    # memory, so keeping them holds nothing more; a block deleted meanwhile (donated, or by
    # hand) is placed again; shuffled rows are copied into new blocks every epoch. (Replicas'
    # parts of 48 bytes: not aligned, so read in blocks, not as batches in place.)
    placed = recording_placements(monkeypatch)
    s, d = mirrored(n), data(4 * n * (2 * 64 + 3) + 1)
    rows = s.experimental_make_numpy_dataset(d)
    dist = s.experimental_distribute_dataset(rows.batch(4 * n))
    epochs = [list(dist) for _ in range(3)]
    assert len(placed) == 3  # Blocks of 64, 64 and the last 3 batches, once each.
    for got in epochs:
        for element, host in zip(got, batches(d, 4 * n), strict=True):
            for key in host:
                np.testing.assert_array_equal(np.asarray(s.gather(element[key], 0)), host[key])
    placed[1][0].delete()
    again = list(dist)
    assert len(placed) == 4
    want = batches(d, 4 * n)[70]["x"]
    np.testing.assert_array_equal(np.asarray(s.gather(again[70]["x"], 0)), want)
    shuffled = s.experimental_distribute_dataset(rows.shuffle(64, seed=1).batch(4 * n))
    list(shuffled), list(shuffled)
    assert len(placed) == 4 + 2 * 3  # Copied into new blocks each epoch: 3 blocks each.


def test_a_feed_keeps_blocks_of_at_most_its_count_of_buffers(monkeypatch):
    # Blocks of 16 buffers (two leaves on 8 devices), at most 16 kept: the first block only,
    # so each later pass places the two others again.
    monkeypatch.setattr(in_place_batches, "KEPT_BUFFERS", 16)
    placed = counting_placements(monkeypatch)
    s, d = mirrored(8), data(32 * (2 * 64 + 3))
    dist = s.experimental_distribute_dataset(s.experimental_make_numpy_dataset(d).batch(32))
    for passes in (1, 2, 3):
        got = list(dist)
        assert len(placed) == 3 + 2 * (passes - 1)
        np.testing.assert_array_equal(np.asarray(s.gather(got[-1]["y"], 0)), d["y"][-32:])


def test_one_replicas_batches_on_cpu_are_the_datasets_own_memory():
    # One replica's plain batches each hold their rows of the dataset's copy (batches of 16
    # rows: 256 and 64 bytes, aligned), in blocks of 64 batches and a last of 3; data shorter
    # than a block too, as a block of its own full batches.
    s, d = mirrored(1), data(16 * (64 + 3), features=4)
    rows = s.experimental_make_numpy_dataset(d)
    x = rows.arrays["x"]
    got = elements(s, rows.batch(16))
    assert [e["x"].unsafe_buffer_pointer() for e in got] == [
        x.ctypes.data + 256 * i for i in range(67)]
    short = s.experimental_make_numpy_dataset(data(16 * 3, features=4))
    x = short.arrays["x"]
    assert [e["x"].unsafe_buffer_pointer() for e in elements(s, short.batch(16))] == [
        x.ctypes.data + 256 * i for i in range(3)]
    for element, host in zip(got, batches(d, 16), strict=True):
        assert isinstance(element["x"], jax.Array)
        np.testing.assert_array_equal(np.asarray(element["x"]), host["x"])
        np.testing.assert_array_equal(np.asarray(element["y"]), host["y"])


@pytest.mark.parametrize("n", BLOCKED_REPLICAS)
def test_shuffled_elements_hold_the_shuffled_batches(n):
    s, d = mirrored(n), data(64)
    dataset = s.experimental_make_numpy_dataset(d).shuffle(64, seed=3).batch(2 * n)
    plain = [b for b in dataset]  # The same seed and epoch give the same order.
    dataset = s.experimental_make_numpy_dataset(d).shuffle(64, seed=3).batch(2 * n)
    for element, host in zip(elements(s, dataset), plain):
        np.testing.assert_array_equal(np.concatenate([np.asarray(v) for v in element["y"].values]),
                                      host["y"])


@pytest.mark.parametrize("rows,batch,features,size", [
    (96, 24, 3, 64), (100, 24, 3, 64), (24 * 70, 24, 3, 64),  # Last blocks of 4, 4 and 6.
    (80, 16, 16384, 3), (130, 10, 8192, 12)])  # Large batches: blocks of 3 and of 12.
@pytest.mark.parametrize("shuffled", [False, True])
def test_one_replica_elements_are_its_batches_as_plain_arrays_where_run_takes_them(
        rows, batch, features, size, shuffled):
    # TF gives one replica plain tensors: the block's rows (on CPU, where they are aligned)
    # or cut from it, placed replicated on the mesh; the feed hands over a block at a time.
    s, d = mirrored(1), data(rows, features)
    dataset = s.experimental_make_numpy_dataset(d)
    if shuffled:
        dataset = dataset.shuffle(rows, seed=5, reshuffle_each_iteration=False)
    dataset = dataset.batch(batch)
    want = list(dataset)
    it = iter(s.experimental_distribute_dataset(dataset))
    handed, get = [], it._feed.get
    it._feed.get = lambda: handed.append(1) or get()
    got = list(it)
    assert len(handed) == -(-(rows // batch) // size) + (rows % batch > 0) + 1  # And the end.
    replicated = jax.sharding.NamedSharding(s.extended.mesh, jax.sharding.PartitionSpec())
    for element, host in zip(got, want, strict=True):
        for key in host:
            assert isinstance(element[key], jax.Array) and element[key].sharding == replicated
            np.testing.assert_array_equal(np.asarray(element[key]), host[key])


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("pipeline", [
    lambda d: d.batch(4, drop_remainder=True), lambda d: d.batch(4).repeat(2),
    lambda d: d.batch(4).take(5).repeat(2), lambda d: d.batch(4).skip(1).shard(2, 1),
    lambda d: d.batch(2).batch(2),
    lambda d: d.shuffle(30, seed=1).batch(4).repeat(2)], ids=[
        "drop", "repeat", "take-repeat", "skip-shard", "nested", "reshuffled-epochs"])
def test_distributed_pipelines_give_tf_split_of_each_batch(pipeline, n):
    s, d = mirrored(n), data(30)
    # Each dataset's first pass: a shuffle reshuffles for every new pass, as tf.data's does.
    want = list(pipeline(s.experimental_make_numpy_dataset(d)))
    got = elements(s, pipeline(s.experimental_make_numpy_dataset(d)))
    assert len(got) == len(want)
    for element, host in zip(got, want):
        for key in host:
            values = s.experimental_local_results(element[key])
            for value, chunk in zip(values, tf_split(host[key], n), strict=True):
                np.testing.assert_array_equal(np.asarray(value), chunk)


@pytest.mark.parametrize("size,count", [(64, 8), (3, 3), (12, 6), (7, 7), (10, 5), (2, 2)])
def test_one_replica_blocks_are_cut_in_launches_that_divide_them(size, count):
    assert batch_blocks._cut_count(size) == count


@pytest.mark.parametrize("n", (2, 8))
def test_a_function_compiled_ahead_of_time_takes_blocked_elements(n):
    s, d = mirrored(n), data(8 * n * 3)
    element = elements(s, s.experimental_make_numpy_dataset(d).batch(8 * n))[1]
    host = batches(d, 8 * n)[1]

    @jdist.function
    def train(w, batch):
        return s.run(lambda w, b: w + jnp.sum(b["x"]) + jnp.sum(b["y"]), args=(w, batch))
    compiled = train.lower(jnp.float32(1), element).compile()
    want = [1 + np.sum(x) + np.sum(y)
            for x, y in zip(tf_split(host["x"], n), tf_split(host["y"], n))]
    for got in (compiled(jnp.float32(1), element), train(jnp.float32(1), element)):
        np.testing.assert_allclose([np.asarray(v) for v in s.experimental_local_results(got)],
                                   want, rtol=1e-6)


@pytest.mark.parametrize("n", (1, 4))
def test_a_short_last_block_read_in_place_gives_its_batches_as_on_accelerators(n, monkeypatch):
    # 69 aligned batches: a block of 64, then the 64 ending with the last 5 read in place,
    # its batches at positions 59-63 (cut out eight at a time on one replica).
    monkeypatch.setattr(batch_blocks, "on_host_cores", lambda mesh: False)
    s, d = mirrored(n), data(16 * n * 69, features=16)
    dataset = s.experimental_make_numpy_dataset(d).batch(16 * n)
    for element, host in zip(elements(s, dataset), dataset, strict=True):
        for key in host:
            got = s.experimental_local_results(element[key])
            for value, chunk in zip(got, tf_split(host[key], n), strict=True):
                np.testing.assert_array_equal(np.asarray(value), chunk)


@pytest.mark.parametrize("n", (1, 4))
def test_blocks_placed_by_a_prefetch_thread_as_on_accelerators_are_the_same(n, monkeypatch):
    # Off CPU the host's cores are free: the prefetch thread places blocks ahead of the loop,
    # each device receiving its replicas' rows of them.
    monkeypatch.setattr(batch_blocks, "on_host_cores", lambda mesh: False)
    s, d = mirrored(n), data(41 * 4 * n + 3)
    dataset = s.experimental_make_numpy_dataset(d).batch(4 * n)
    it = iter(s.experimental_distribute_dataset(dataset))
    first = next(it)
    assert len(prefetch.live_threads()) == 1
    if n > 1:  # Each device received its replicas' rows: the elements are sharded so.
        spec = jax.sharding.PartitionSpec(s.extended.replica_axis)
        assert first["x"].stacked.sharding.spec == spec
    for element, host in zip([first, *it], dataset, strict=True):
        got = s.experimental_local_results(element["x"])
        for value, chunk in zip(got, tf_split(host["x"], n), strict=True):
            np.testing.assert_array_equal(np.asarray(value), chunk)
    assert not prefetch.live_threads()
    it = iter(s.experimental_distribute_dataset(dataset))
    next(it)  # Closed while the thread places the next block.
    it.close()
    assert not prefetch.live_threads()


@pytest.mark.parametrize("n", (1,) + BLOCKED_REPLICAS)
def test_a_training_loop_on_blocks_computes_tf_numbers_and_compiles_once(n):
    # Three epochs with a partial last batch: one program for the full (blocked) batches,
    # the exact plan's fixed number for the partial one, nothing compiled after epoch 1.
    s, d = mirrored(n), data(10 * 4 * n + n + 1)
    dist = s.experimental_distribute_dataset(s.experimental_make_numpy_dataset(d).batch(4 * n))

    def step(w, batch):
        ctx = jdist.get_replica_context()
        local = jnp.sum(batch["x"] * w) + jnp.sum(batch["y"])
        return w + ctx.all_reduce("sum", local) * 1e-6, local
    w, w_ref, compiles = jnp.float32(1), np.float32(1), []
    for _ in range(3):
        with count_compiles() as epoch:
            for element, host in zip(dist, batches(d, 4 * n)):
                want = [np.sum(x * w_ref) + np.sum(y) for x, y in
                        zip(tf_split(host["x"], n), tf_split(host["y"], n))]
                w, local = s.run(step, args=(w, element))
                w_ref = np.float32(w_ref + np.float32(np.sum(want)) * np.float32(1e-6))
                np.testing.assert_allclose(
                    [np.asarray(v) for v in s.experimental_local_results(local)], want, rtol=1e-6)
                np.testing.assert_allclose(np.asarray(s.experimental_local_results(w)[0]), w_ref,
                                           rtol=1e-6)
            jax.block_until_ready(w)
        compiles.append(len(epoch))
    assert compiles[1:] == [0, 0]


@pytest.mark.parametrize("n", (2, 8))
def test_the_step_traces_once_for_blocked_and_plain_batches(n):
    s, d = mirrored(n), data(8 * n)
    element = elements(s, s.experimental_make_numpy_dataset(d).batch(4 * n))[0]
    plain = jdist.PerReplica([np.asarray(v) for v in element["x"].values])
    traces = []

    def step(x):
        traces.append(1)
        return jnp.sum(x) * 2
    for x in (element["x"], plain, element["x"], plain):
        out = s.run(step, args=(x,))
        np.testing.assert_array_equal(
            [np.asarray(v) for v in out.values],
            [2 * np.sum(c) for c in tf_split(d["x"][:4 * n], n)])
    assert len(traces) == 1


@pytest.mark.parametrize("n", BLOCKED_REPLICAS)
def test_a_blocked_element_reads_as_the_plain_value_everywhere(n):
    s, d = mirrored(n), data(16 * n)
    element = elements(s, s.experimental_make_numpy_dataset(d).batch(2 * n))[3]
    chunks = tf_split(d["x"][6 * n:8 * n], n)
    x = element["x"]
    assert isinstance(x, jdist.PerReplica) and x.num_replicas == n and not x.ragged

    def same(value):
        np.testing.assert_array_equal(np.asarray(value), np.stack(chunks))
    same(x.stacked)
    same(jax.device_get(x).stacked)
    same(jax.tree_util.tree_leaves(x)[0])
    same(jax.tree_util.tree_map(lambda a: a + 0, x).stacked)
    same(pickle.loads(pickle.dumps(x)).stacked)
    same(copy.deepcopy(x).stacked)
    same(np.stack(s.experimental_local_results(x)))
    np.testing.assert_array_equal(np.asarray(s.gather(x, axis=0)), np.concatenate(chunks))
    np.testing.assert_allclose(np.asarray(s.reduce("SUM", x, axis=None)), sum(chunks))


@pytest.mark.parametrize("n", (2, 4))
def test_a_step_closing_over_a_blocked_element_sees_its_values(n):
    # While run flattens its arguments a blocked element flattens to (block, position); the
    # step's own pytree work on an element it captured must see the plain value.
    s, d = mirrored(n), data(8 * n)
    first, second = elements(s, s.experimental_make_numpy_dataset(d).batch(4 * n))
    captured = second["y"]

    def step(x):
        doubled = jax.tree_util.tree_map(lambda a: a * 2, captured)
        return jnp.sum(x) + jnp.sum(doubled.stacked)
    out = s.run(step, args=(first["y"],))
    want = [np.sum(c) for c in tf_split(d["y"][:4 * n], n)]
    np.testing.assert_array_equal([np.asarray(v) for v in out.values],
                                  np.array(want) + 2 * np.sum(d["y"][4 * n:]))


def test_reading_an_element_inside_a_trace_keeps_it_concrete():
    s, d = mirrored(2), data(8)
    element = elements(s, s.experimental_make_numpy_dataset(d).batch(4))[1]
    traced = jax.jit(lambda: element["x"].stacked * 2)()
    np.testing.assert_array_equal(np.asarray(traced), 2 * np.stack(tf_split(d["x"][4:], 2)))
    np.testing.assert_array_equal(np.asarray(element["x"].values[1]), d["x"][6:8])


@pytest.mark.parametrize("batch_bytes,size", [
    (1, batch_blocks.MAX_BATCHES), (batch_blocks.BLOCK_BYTES // 5, 5),
    (batch_blocks.BLOCK_BYTES // 2 + 1, 1), (batch_blocks.BLOCK_BYTES * 3, 1)])
def test_a_block_holds_at_most_its_bytes_and_count(batch_bytes, size):
    assert batch_blocks.block_size(batch_bytes) == size


@pytest.mark.parametrize("options", [
    {"experimental_fetch_to_device": False}, {"experimental_per_replica_buffer_size": 0}])
def test_blocks_only_where_they_serve(options, monkeypatch):
    s, cuts = mirrored(4), cutting(monkeypatch)
    fetched = options.get("experimental_fetch_to_device", True)
    dataset = s.experimental_make_numpy_dataset(data(32)).batch(8)
    elements(s, dataset, **options)
    assert bool(cuts) == fetched
    uneven = s.experimental_make_numpy_dataset(data(30)).batch(6)  # 6 rows over 4 replicas.
    listed = batches(data(32), 8)  # A list: its batches may differ in shape.
    cuts.clear()
    for source in (uneven, listed):
        elements(s, source)
    elements(mirrored(1), dataset)  # Aliased in place on one CPU device.
    assert not cuts


@pytest.mark.parametrize("buffer", [1, 4])
def test_blocks_are_placed_by_the_loop_and_other_sources_by_a_thread(buffer, monkeypatch):
    # In-memory blocks have no loading to hide; a thread's work would slow the step.
    s, options = mirrored(4), jdist.InputOptions(experimental_per_replica_buffer_size=buffer)
    cuts = cutting(monkeypatch)
    blocked = s.experimental_make_numpy_dataset(data(64)).batch(8)
    it = iter(s.experimental_distribute_dataset(blocked, options))
    next(it)
    assert cuts and not prefetch.live_threads()
    listed = iter(s.experimental_distribute_dataset(batches(data(64), 8), options))
    next(listed)
    assert len(cuts) == 1 and len(prefetch.live_threads()) == 1
    listed.close()
    assert not prefetch.live_threads()


@pytest.mark.parametrize("n", (2, 8))
def test_run_on_blocked_batches_computes_the_batches(n):
    s, d = mirrored(n), data(40 * n)
    dist = s.experimental_distribute_dataset(s.experimental_make_numpy_dataset(d).batch(4 * n))

    def step(w, batch):
        return w + jdist.get_replica_context().all_reduce("sum", jnp.sum(batch["y"]))
    w = jdist.Mirrored([np.float32(0)] * n)
    for element in dist:
        w = s.run(step, args=(w, element))
    np.testing.assert_array_equal(np.asarray(w.values[0]), np.sum(d["y"]))


@pytest.mark.parametrize("pipeline", [
    lambda d: d.batch(4), lambda d: d.batch(4, drop_remainder=True), lambda d: d.batch(3),
    lambda d: d.shuffle(30, seed=1, reshuffle_each_iteration=False).batch(4),
    lambda d: d.batch(4).shuffle(8, seed=2, reshuffle_each_iteration=False),
    lambda d: d.batch(4).take(5).repeat(2), lambda d: d.batch(4).skip(1).shard(2, 1),
    lambda d: d.batch(2).batch(2)], ids=["batch", "drop", "uneven", "shuffled-rows",
                                         "shuffled-batches", "take-repeat", "skip-shard", "nested"])
@pytest.mark.parametrize("count", [1, 2, 3, 32])
def test_numpy_blocks_are_the_elements_in_order(pipeline, count):
    dataset = pipeline(jdist.NumpyDataset({"a": np.arange(30), "b": np.arange(60).reshape(30, 2)}))
    want = list(dataset)
    got = []
    for number, rows in dataset.blocks(count):
        if number is None:
            assert len(rows["a"]) != dataset.batch_rows or rows["a"].ndim > 1
            got.append(rows)
            continue
        assert 1 <= number <= count
        nest = {k: v[rows] for k, v in dataset.arrays.items()}
        got.extend({k: v.reshape((number, -1) + v.shape[1:])[i] for k, v in nest.items()}
                   for i in range(number))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        for key in w:
            np.testing.assert_array_equal(g[key], w[key])


@pytest.mark.parametrize("n", (2, 8))
@pytest.mark.parametrize("donate", [False, True])
def test_a_function_wrapped_step_on_blocked_batches(n, donate):
    # The TF idiom: @tf.function def train_step(batch): return strategy.run(step, (batch,)).
    s, d = mirrored(n), data(40 * n + 1)
    dist = s.experimental_distribute_dataset(s.experimental_make_numpy_dataset(d).batch(4 * n))

    @jdist.function(donate_argnums=(1,) if donate else ())
    def train_step(w, batch):
        def step(w, batch):
            return w + jdist.get_replica_context().all_reduce("sum", jnp.sum(batch["y"]))
        return s.run(step, args=(w, batch))
    w = jdist.Mirrored([np.float32(0)] * n)
    for _ in range(2):
        for element in dist:
            if not element["y"].ragged:  # The last row is a partial batch: left out.
                w = train_step(w, element)
    np.testing.assert_array_equal(np.asarray(w.values[0]), 2 * np.sum(d["y"][:40 * n]))
