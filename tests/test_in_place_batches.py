"""Batches read in place: on CPU devices, a numpy dataset's full batches in order are arrays over
its own rows, made at the first epoch and kept (`in_place_batches`).

Such an element must be, for every reader, the batch TF's split gives, held where the dataset
holds it, made once per dataset, and run by the program a batch placed by hand runs.
"""

import copy
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdist
from jdist._src.input import blocks as batch_blocks
from jdist._src import host_values
from jdist._src.input import in_place as in_place_batches
from jdist.testing import count_compiles, mirrored

REPLICAS = (1, 2, 3, 4, 8)


def tf_split(batch, n):
    """TF's rule for a full batch: n consecutive chunks of equal size."""
    return np.split(batch, n)


def data(rows, inner=(16,)):
    """Rows whose every replica's part of a 16 * n-row batch is a multiple of 64 bytes."""
    x = np.arange(rows * np.prod(inner), dtype=np.float32).reshape((rows,) + inner)
    return {"x": x, "y": np.arange(rows, dtype=np.int32) % 7}


def parts(value):
    """Each replica's value of an element's leaf (one replica's is the plain array)."""
    return [value] if isinstance(value, jax.Array) else list(value.values)


def addresses(value):
    """The addresses of the device buffers holding an element's leaf, replica by replica."""
    array = value if isinstance(value, jax.Array) else value.stacked
    return [s.data.unsafe_buffer_pointer() for s in sorted(
        array.addressable_shards, key=lambda s: s.index[0].start or 0)]


def counting_placements(monkeypatch):
    """A list that grows by the number of arrays each placement of batches in place makes."""
    placed, place = [], in_place_batches.placed_split
    monkeypatch.setattr(in_place_batches, "placed_split",
                        lambda arrays, sharding: placed.append(len(arrays)) or place(
                            arrays, sharding))
    return placed


@pytest.mark.parametrize("n", REPLICAS)
@pytest.mark.parametrize("inner", [(16,), (4, 4)])
def test_each_replicas_rows_are_the_datasets_own_memory_and_tf_split(n, inner):
    s, d = mirrored(n), data(16 * n * 70 + 5, inner)  # Blocks of 64 and 6, a partial batch.
    rows = s.experimental_make_numpy_dataset(d)
    got = list(s.experimental_distribute_dataset(rows.batch(16 * n)))
    assert len(got) == 71
    x, part = rows.arrays["x"], rows.arrays["x"][:16].nbytes
    for i, element in enumerate(got[:70]):
        assert isinstance(element["x"], jax.Array) == (n == 1)  # TF's one-replica batches.
        assert addresses(element["x"]) == [x.ctypes.data + (i * n + r) * part for r in range(n)]
        for key in d:
            want = tf_split(d[key][i * 16 * n:(i + 1) * 16 * n], n)
            for value, chunk in zip(parts(element[key]), want, strict=True):
                np.testing.assert_array_equal(np.asarray(value), chunk)
    np.testing.assert_array_equal(np.asarray(s.gather(got[70]["y"], 0)), d["y"][-5:])


@pytest.mark.parametrize("n", REPLICAS)
def test_batches_are_made_once_and_kept_for_later_epochs(n, monkeypatch):
    # Three epochs of one distributed dataset (repeated twice: a block spans the repeat) read
    # the same arrays; an array deleted meanwhile (donated, or by hand) is made again.
    placed = counting_placements(monkeypatch)
    s, d = mirrored(n), data(16 * n * 100)
    root = s.experimental_make_numpy_dataset(d)
    rows = root.batch(16 * n).repeat(2)
    dist = s.experimental_distribute_dataset(rows)
    epochs = [list(dist) for _ in range(3)]
    assert sum(placed) == 2 * 100  # Two leaves' 100 batches, made at the first epoch only.
    stacked = lambda v: v if isinstance(v, jax.Array) else v.stacked  # noqa: E731
    for got in epochs:
        assert all(stacked(a["x"]) is stacked(b["x"]) for a, b in zip(got, epochs[0]))
        assert all(stacked(a["x"]) is stacked(b["x"]) for a, b in zip(got[100:], got))
        for i, element in enumerate(got):
            np.testing.assert_array_equal(np.asarray(s.gather(element["y"], 0)),
                                          d["y"][i % 100 * 16 * n:(i % 100 + 1) * 16 * n])
    stacked(epochs[0][70]["x"]).delete()
    again = list(dist)
    assert sum(placed) == 2 * 100 + 2  # That batch's two leaves, made again.
    np.testing.assert_array_equal(np.asarray(s.gather(again[70]["x"], 0)),
                                  d["x"][70 * 16 * n:71 * 16 * n])
    # Kept with the data: another distributed dataset over it, or over a dataset made from
    # it, reads the same arrays; another batch size makes its own.
    for other in (rows, root.batch(16 * n).prefetch(2), root.batch(16 * n)):
        got = list(s.experimental_distribute_dataset(other))
        assert stacked(got[0]["x"]) is stacked(again[0]["x"])
    assert sum(placed) == 2 * 100 + 2
    list(s.experimental_distribute_dataset(root.batch(32 * n)))
    assert sum(placed) == 2 * 100 + 2 + 2 * 50  # Another batch size: its own arrays...
    assert len(root.placements) == 1  # ...in place of the others: one kept set at most.
    list(dist)
    assert sum(placed) == 2 * 100 + 2 + 2 * 50 + 2 * 100
    list(s.experimental_distribute_dataset(root.shuffle(64, seed=1).batch(16 * n)))
    assert len(root.placements) == 1  # Shuffled rows keep nothing, and evict nothing.
    list(dist)
    assert sum(placed) == 2 * 100 + 2 + 2 * 50 + 2 * 100
    list(s.experimental_distribute_dataset(s.experimental_make_numpy_dataset(d).batch(16 * n)))
    assert sum(placed) == 2 * 100 + 2 + 2 * 50 + 2 * 100 * 2  # Another dataset: its own copy.


@pytest.mark.parametrize("make,in_place", [
    (lambda n: (data(16 * n * 8, (3,)), 16 * n, None), True),  # A part: 48 * 16 bytes...
    (lambda n: (data(4 * n * 8, (3,)), 4 * n, None), False),  # ...aligned; 48 bytes: not.
    (lambda n: ({"y": np.arange(16 * n * 8)}, 16 * n, None), True),  # int64, held as int32...
    (lambda n: ({"y": np.arange(8 * n * 8)}, 8 * n, None), False),  # ...in 32 bytes: not.
    (lambda n: (data(16 * n * 8), 16 * n, 8), False),  # Shuffled rows: copied.
], ids=["aligned", "unaligned", "int64", "int64-unaligned", "shuffled"])
def test_batches_are_read_in_place_only_where_every_part_is_aligned_and_in_order(
        make, in_place, monkeypatch):
    s = mirrored(4)
    d, batch, shuffle = make(4)
    rows = s.experimental_make_numpy_dataset(d)
    rows = (rows if shuffle is None else rows.shuffle(
        shuffle, seed=1, reshuffle_each_iteration=False)).batch(batch)
    cuts, cut = [], batch_blocks.BlockFeed._cut_placed  # Blocks: their batches cut out.
    monkeypatch.setattr(batch_blocks.BlockFeed, "_cut_placed",
                        lambda self, *a: cuts.append(1) or cut(self, *a))
    got = list(s.experimental_distribute_dataset(rows))
    assert in_place == (not cuts)
    for element, host in zip(got, list(rows), strict=True):
        for key in host:
            np.testing.assert_array_equal(np.asarray(s.gather(element[key], 0)),
                                          np.asarray(host[key]))


def test_a_dataset_of_more_buffers_than_kept_is_read_in_blocks(monkeypatch):
    monkeypatch.setattr(in_place_batches, "KEPT_BUFFERS", 2 * 4 * 10 - 1)  # 10 batches: one over.
    cuts, cut = [], batch_blocks.BlockFeed._cut_placed  # Blocks: their batches cut out.
    monkeypatch.setattr(batch_blocks.BlockFeed, "_cut_placed",
                        lambda self, *a: cuts.append(1) or cut(self, *a))
    s, d = mirrored(4), data(64 * 10)
    list(s.experimental_distribute_dataset(s.experimental_make_numpy_dataset(d).batch(64)))
    assert cuts
    cuts.clear()
    monkeypatch.setattr(in_place_batches, "KEPT_BUFFERS", 2 * 4 * 10)
    list(s.experimental_distribute_dataset(s.experimental_make_numpy_dataset(d).batch(64)))
    assert not cuts


@pytest.mark.parametrize("n", (2, 3, 8))
def test_a_training_loop_runs_the_program_of_batches_placed_by_hand_and_tf_numbers(n):
    # Three epochs with a partial last batch: the full batches run the program a batch
    # placed by hand compiled, the partial one the exact plan's; nothing compiles after.
    s, d = mirrored(n), data(16 * n * 10 + n + 1)
    d["x"] = d["x"] % 13 / 8  # Sums float32 holds exactly.
    dist = s.experimental_distribute_dataset(s.experimental_make_numpy_dataset(d).batch(16 * n))

    def step(w, batch):
        local = jnp.sum(batch["x"] * w) + jnp.sum(batch["y"])
        return w + jdist.get_replica_context().all_reduce("sum", local) * 1e-6, local
    by_hand = {k: jdist.PerReplica([v[r * 16:(r + 1) * 16] for r in range(n)])
               for k, v in d.items()}
    w, w_ref = s.run(step, args=(jnp.float32(1), by_hand))[0], None
    w_ref = np.asarray(s.experimental_local_results(w)[0])
    with count_compiles() as first:
        jax.block_until_ready(s.run(step, args=(w, next(iter(dist)))))
    assert not first  # The program of the batch placed by hand.
    compiles = []
    for _ in range(3):
        with count_compiles() as epoch:
            for i, element in enumerate(dist):
                host = {k: v[i * 16 * n:(i + 1) * 16 * n] for k, v in d.items()}
                per = -(-len(host["y"]) // n)
                want = [np.sum(host["x"][r * per:(r + 1) * per] * w_ref)
                        + np.sum(host["y"][r * per:(r + 1) * per]) for r in range(n)]
                w, local = s.run(step, args=(w, element))
                w_ref = np.float32(w_ref + np.float32(np.sum(want)) * np.float32(1e-6))
                np.testing.assert_allclose(
                    [np.asarray(v) for v in s.experimental_local_results(local)], want,
                    rtol=1e-5)  # Float32 sums of products, in XLA's order.
            jax.block_until_ready(w)
        compiles.append(len(epoch))
    assert compiles[1:] == [0, 0]
    np.testing.assert_allclose(np.asarray(s.experimental_local_results(w)[0]), w_ref, rtol=1e-5)


def test_placed_split_parts_are_the_arrays_own_memory():
    x = host_values.aligned_empty((4, 16), np.float32)
    x[:] = np.arange(64, dtype=np.float32).reshape(4, 16)
    x.flags.writeable = False
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("r",))
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("r"))
    placed, = host_values.placed_split([x], split)
    np.testing.assert_array_equal(np.asarray(placed), x)
    assert addresses(jdist.PerReplica._from_stacked(placed)) == [
        x[i].ctypes.data for i in range(4)]


@pytest.mark.parametrize("clone", [lambda d: pickle.loads(pickle.dumps(d)), copy.deepcopy],
                         ids=["pickle", "deepcopy"])
def test_a_copied_dataset_reads_its_own_copy_in_place(clone):
    # The kept arrays are a cache over the original's memory: a copy has none, and its own
    # aligned read-only data, read in place in turn.
    s, d = mirrored(2), data(32 * 8)
    rows = s.experimental_make_numpy_dataset(d).batch(32)
    first = list(s.experimental_distribute_dataset(rows))
    other = clone(rows)
    assert not any(other.placements.values())
    got = list(s.experimental_distribute_dataset(other))
    x = other.arrays["x"]
    assert not x.flags.writeable and addresses(got[1]["x"]) == [
        x.ctypes.data + (2 + r) * x[:16].nbytes for r in range(2)]
    for a, b in zip(first, got, strict=True):
        np.testing.assert_array_equal(np.asarray(b["x"].stacked), np.asarray(a["x"].stacked))


@pytest.mark.parametrize("n", (1, 2, 4))
def test_batches_donated_to_a_function_are_made_again_and_the_data_left_as_it_was(n):
    # The TF idiom with JAX's donation: each epoch's batches are donated; the next epoch
    # makes them again, and no program ever writes into the dataset's memory.
    s, d = mirrored(n), data(16 * n * 4)
    rows = s.experimental_make_numpy_dataset(d)
    dist = s.experimental_distribute_dataset(rows.batch(16 * n))

    @jdist.function(donate_argnums=(0,))
    def overwrite(batch):
        return s.run(lambda b: jax.tree.map(lambda v: v * 0 - 7, b), args=(batch,))
    for _ in range(2):
        for i, element in enumerate(dist):
            want = d["y"][i * 16 * n:(i + 1) * 16 * n]
            np.testing.assert_array_equal(np.asarray(s.gather(element["y"], 0)), want)
            out = overwrite(element)
            assert np.all(np.asarray(s.gather(out["y"], 0)) == -7)
    np.testing.assert_array_equal(rows.arrays["x"], d["x"])
    np.testing.assert_array_equal(rows.arrays["y"], d["y"])


@pytest.mark.parametrize("n", (1, 2, 4))
def test_int64_batches_read_in_place_are_int32_without_x64(n):
    # Dtypes are JAX's: int64 labels are held as int32 (read in place from an int32 copy made
    # once), and computed with as jax.jit would.
    s = mirrored(n)
    y = (np.arange(16 * n * 6, dtype=np.int64) * 7919) % 1000 - 500
    rows = s.experimental_make_numpy_dataset({"y": y}).batch(16 * n)
    dist = s.experimental_distribute_dataset(rows)
    for _ in range(2):  # The second epoch reads the kept values.
        for i, element in enumerate(dist):
            assert s.experimental_local_results(element["y"])[0].dtype == np.int32
            batch = y[i * 16 * n:(i + 1) * 16 * n]
            total = s.run(lambda v: jdist.get_replica_context().all_reduce("sum", jnp.sum(v)),
                          args=(element["y"],))
            assert int(s.experimental_local_results(total)[0]) == batch.sum()
