"""Batch blocks: full batches of in-memory data placed several at a time, one transfer per block.

Placing a small batch on several devices costs mostly per-buffer work (one buffer per leaf and
device: about 110 us for a 64 KiB batch of two leaves on 8 CPU devices), not its bytes. A block
holds ``K`` consecutive full batches, ``(K, num_replicas, rows, *inner)``, and is placed in one
call with as many buffers as ONE batch. Measured with a dispatch-bound step (1 ms) on 8 CPU
devices, a shuffled numpy dataset (``make bench``, ``bench_input``): one placement per batch
runs at 0.71 of the speed of batches already on the devices, blocks whose batches are cut out
as ordinary values at 0.81-0.85. (Indexing the block inside the step's own program, with
elements that flattened to ``(block, position)`` while ``run`` called it, ran at 0.89-0.92:
it cost a `PerReplica` subclass and a thread-local flag that changed how a value flattens, in
four modules, for 4-11% of a step that does nothing; it went.)

That layout is the dataset's own: ``K`` consecutive batches of its rows are those rows, so a
block of them is a view of the dataset's arrays (a `NumpyDataset` holds an aligned, read-only
copy). On CPU devices a block is placed replicated: every device's buffer is that host memory
itself, with no copy and no transfer. On several accelerators it is sharded over the replica axis (dimension 1),
each device receiving its replicas' rows. A block holds no more batches than one pass over
the data gives, and a short last block is the block's worth of rows ending with it, its
batches at the last positions. Shuffled rows, 64-bit data (without x64) and rows that are not
a block's worth in order (padded) are copied into the layout first.

An element is an ordinary `PerReplica`, cut out of its block on the devices by one compiled
program for `CUT` batches at a time, each batch sharded over the replicas as any `PerReplica`
is: the batching of transfers stays inside the iterator, and a step sees plain values.

On one replica TF's elements are plain tensors: there a block's batches are plain arrays, cut
the same way (or, on a CPU device, aliased in place).

Blocks are used where a dataset's data is already in memory and its full batches share one shape
(a batched `NumpyDataset`), so waiting for ``K`` batches costs no loading latency. On CPU devices
the loop's own thread places each block when its first batch is asked for: a prefetch thread's
work would only compete with the devices for the host's cores (``docs/design.md``), and a
block read in place is placed once and kept for the later epochs. On accelerators the
prefetch thread places them ahead, beside the steps. Where the rows are in order and every
replica's part is aligned, CPU devices skip blocks altogether: `in_place_batches`.
"""

import functools

import jax
from jax import lax
import numpy as np

from jdist._src.host_values import (aliased, aligned_empty, held_copy, placed_as_is,
                                    placed_replicated)
from jdist._src.input import in_place as in_place_batches
from jdist._src.values import PerReplica

BLOCK_BYTES = 4 << 20  # A block holds at most this many bytes of batches...
MAX_BATCHES = 64  # ...and at most this many batches.


def block_size(batch_bytes: int) -> int:
    """How many full batches of ``batch_bytes`` bytes one block holds (1: no blocks)."""
    return max(1, min(MAX_BATCHES, BLOCK_BYTES // max(1, int(batch_bytes))))


def _take(block, position):
    return lax.dynamic_index_in_dim(block, position, keepdims=False)


def on_host_cores(mesh) -> bool:
    """Whether ``mesh``'s devices are the host's CPU cores: its blocks are then placed by the
    loop's thread and replicated, every device's buffer being the host memory itself."""
    return mesh.devices.flat[0].platform == "cpu"


class BlockFeed:
    """Turns a dataset's blocks of full batches into elements (see the module doc).

    Args:
      mesh: the strategy's mesh; ``axis``: its replica axis.
      full_rows: the leading size of a full global batch (a multiple of the replica count).
      size: how many batches a block holds (at least 2).
      guard: the `dispatch.DispatchGuard` of the mesh's devices.
      batches_per_pass: how many full batches one pass over the data gives where they are its
        rows in order (`NumpyDataset.full_batches_in_order`), else None.
    """

    def __init__(self, mesh, axis, full_rows, size, guard, batches_per_pass):
        self._guard = guard
        # Simulated CPU devices run on the host's cores: a thread's copy there stalls every
        # device's collective (`docs/design.md`, "Who places a block"). An accelerator's host
        # has them free, so a prefetch thread overlaps the copy and transfer with the steps.
        self.on_loop_thread = on_host_cores(mesh)
        spec = jax.sharding.PartitionSpec
        # A CPU device's buffer can be the host memory itself, and one device holds it all
        # anyway; several accelerators each receive their replicas' rows.
        replicated = self.on_loop_thread or mesh.devices.size == 1
        self._sharding = jax.sharding.NamedSharding(mesh, spec() if replicated else spec(
            None, axis))
        self._split = (mesh.devices.size, full_rows // mesh.devices.size)
        self.size = size
        self._positions = _positions(mesh, size)
        self._plain = None  # One replica: how a block's batches become plain arrays, as in TF.
        per_replica = jax.sharding.NamedSharding(mesh, spec(axis))
        self._cut_count = _cut_count(size)
        self._cut = _cutter(per_replica if mesh.devices.size > 1 else self._sharding,
                            self._cut_count, mesh.devices.size == 1)
        self._in_place = in_place_batches.InPlaceBatches(
            mesh, axis, full_rows, batches_per_pass, guard) if (
                self.on_loop_thread and batches_per_pass) else None
        if mesh.devices.size == 1 and self.on_loop_thread:
            self._plain = self._aliased_batches
        elif mesh.devices.size == 1:
            self._plain = self._cut_batches

    def __call__(self, arrays, blocks, split, placements):
        """Yields the elements of ``blocks`` (`NumpyDataset.blocks`' pairs, over the rows of
        ``arrays``) in order: `Elements` of a block of full batches, or one element made by
        ``split`` (a batch that is not full); closes ``blocks`` at the end. Arrays made over
        the data's own memory are kept in ``placements`` (`NumpyDataset.placements`).

        On CPU (`on_loop_thread`) each block is read and placed when its first element is asked
        for; a copy or a placement waits for the guarded program in flight to finish first
        (`DispatchGuard.wait`): it then has the cores to itself, where beside a running step it
        took two to three times as long, and the next step waited for it all the same. Blocks
        and batches kept from an earlier epoch need neither. Elsewhere the prefetch thread
        runs this generator ahead of the loop (the wait is then a no-op)."""
        leaves, tree = jax.tree_util.tree_flatten(arrays)
        in_place = self._in_place if self._in_place and self._in_place.readable(leaves) else None
        key = in_place.key if in_place else ("blocks", self._sharding, self.size, self._split)
        kept = placements.get(key) if self._in_place else {}  # Else nothing is kept: not
        if kept is None:  # the rows in order, or not on CPU. One way of placing kept per
            placements.clear()  # dataset (a batch size, a mesh): what it holds stays within
            kept = placements[key] = {}  # one `KEPT_BUFFERS`, whatever a sweep tries.
        try:
            while True:
                item = next(blocks, None)
                if item is None:
                    return
                number, rows = item
                if number is None:
                    self._guard.wait()
                    yield split(rows)
                elif in_place is not None:
                    yield Elements(in_place.elements(leaves, tree, rows, kept))
                else:
                    yield self._place(leaves, tree, number, rows, kept)
        finally:
            blocks.close()

    def _place(self, leaves, tree, number, rows, kept):
        """`Elements` of ``number`` full batches, the ``rows`` of ``leaves`` one after another,
        placed as one block: the dataset's own memory where it can be (`_as_is`), else a
        copy (padded to the block's size: positions nobody reads, left as they are)."""
        start, first, blocks = self._as_is(leaves, rows, number)
        if blocks is not None and self.on_loop_thread and self._plain is None:
            placed = self._kept_placement(kept, start, blocks)  # At the first epoch only.
            return self._blocked_elements(tree, placed, first, number)
        if blocks is None:
            self._guard.wait()  # The copy then has the cores to itself (`__call__`).
            blocks = [self._copied(leaf, rows, number) for leaf in leaves]
        if self._plain is not None:
            return Elements(tree.unflatten(batch)
                            for batch in self._plain(blocks, first, number))
        blocks = (placed_replicated(blocks, self._sharding) if self.on_loop_thread
                  else jax.device_put(list(blocks), self._sharding))
        return self._blocked_elements(tree, blocks, first, number)

    def _blocked_elements(self, tree, blocks, first, number):
        """The elements of ``number`` batches of placed ``blocks`` (one per leaf), from position
        ``first``: `PerReplica` values cut out of the blocks, made at once while the cores are
        free (`Elements`)."""
        return Elements(tuple(tree.unflatten([PerReplica._from_stacked(x) for x in batch])
                              for batch in self._cut_placed(blocks, first, number)))

    def _kept_placement(self, kept, start, blocks):
        """``blocks`` (the data's rows from row ``start``, read in place) placed replicated
        once and ``kept`` for the next epochs, while the kept blocks hold at most
        `in_place_batches.KEPT_BUFFERS` device buffers. Keeping them holds no memory the
        dataset does not hold already; placing them again cost every epoch 0.3-0.5 ms per
        block while the devices waited (``docs/design.md``, "Batch blocks")."""
        placed = kept.get(start)
        if placed is not None and not any(map(in_place_batches.deleted, placed)):
            return placed  # Else never placed, or one of them donated or deleted since.
        self._guard.wait()  # Placed with the cores to themselves (`__call__`).
        placed = placed_replicated(blocks, self._sharding)
        kept.pop(start, None)
        if (len(kept) + 1) * len(placed) * self._split[0] <= in_place_batches.KEPT_BUFFERS:
            kept[start] = placed
        return placed

    def _cut_batches(self, blocks, first, number):
        """One replica on an accelerator: the block placed in one transfer, its batches cut
        out of it on the device (`_cut_placed`)."""
        return self._cut_placed(jax.device_put(list(blocks), self._sharding), first, number)

    def _cut_placed(self, blocks, first, number):
        """The ``number`` batches of placed ``blocks`` from position ``first``, each a list of
        one array per leaf, cut out on the devices by `_cutter` (a launch reading past the
        block's end reads its last position again, and that batch is dropped)."""
        return [batch for start in range(first, first + number, self._cut_count)
                for batch in self._cut(blocks, self._positions[start])][:number]

    def _aliased_batches(self, blocks, first, number):
        """One replica on a CPU device, batches not read in place (`in_place_batches`): each
        batch's buffer is its rows in the block's host memory (`host_values.aliased`), with no
        copy and no program, made as the loop asks for it (a few microseconds of C++ per
        leaf, beside the running step). Measured with a dispatch-bound step (``make bench``):
        0.86 of on-device speed, where cutting them out of a placed block ran at 0.65-0.72."""
        return zip(*(aliased(block[first:first + number, 0], self._sharding)
                     for block in blocks))

    def _as_is(self, leaves, rows, number):
        """``(start, first, blocks)``: where ``rows`` are consecutive, every leaf's block's
        worth of rows from row ``start`` to the end of ``rows``, when all can be placed as they
        are (`placed_as_is`), the batches at positions ``first`` on (a short last block's first
        positions hold rows the block before it read: no copy, no padding); else
        ``(None, 0, None)``."""
        start = rows.stop - self.size * self._split[0] * self._split[1] if isinstance(
            rows, slice) else -1
        if start < 0:
            return None, 0, None
        blocks = [leaf[start:rows.stop].reshape((self.size,) + self._split + leaf.shape[1:])
                  for leaf in leaves]
        if not all(map(placed_as_is, blocks)):
            return None, 0, None
        return start, self.size - number, blocks

    def _copied(self, leaf, rows, number):
        """``leaf``'s ``rows`` as ``number`` full batches copied into the block's layout, in the
        dtype JAX holds them in."""
        shape = (self.size,) + self._split + leaf.shape[1:]
        block = aligned_empty(shape, leaf.dtype)
        if isinstance(rows, slice):
            np.copyto(block[:number], leaf[rows].reshape((number,) + shape[1:]))
        else:  # The dataset's own row indices, in range: "wrap" only spares numpy a buffer.
            np.take(leaf, rows.reshape((number,) + shape[1:3]), axis=0, out=block[:number],
                    mode="wrap")
        return held_copy(block)


CUT = 8  # The batches one launch cuts out of a block (its compile grows with it).


def _cut_count(size):
    """How many batches each launch cuts out of a block of ``size``: the most, up to `CUT`,
    that divide it, so no launch reads past the block."""
    return max(c for c in range(1, min(CUT, size) + 1) if size % c == 0)


@functools.lru_cache(maxsize=16)
def _cutter(sharding, count, one_replica):
    """The program that cuts ``count`` batches, from a position on, out of blocks, each batch
    placed on ``sharding`` (a `PerReplica`'s, over the replica axis; ``one_replica``: the plain
    batch `run` wants there). Measured on an H100 (one replica, a dispatch-bound step): a
    transfer per batch ran at 0.28-0.37 of on-device speed, blocks cut this way at 0.54-0.74.
    Eight per launch: all 64 at once compiled in 0.6-2.7 s on CPU (2 to 40 leaves), eight in
    0.13-0.5 s, and cost no more per block."""
    def cut(blocks, start):
        return [[_take(block, start + i)[0] if one_replica else _take(block, start + i)
                 for block in blocks] for i in range(count)]
    return jax.jit(cut, out_shardings=sharding)


@functools.lru_cache(maxsize=8)
def _positions(mesh, size):
    """The positions in a block, ``0 .. size - 1``, as scalars replicated on ``mesh``: placed
    once per mesh, not per dataset (placing 64 scalars costs about 3 ms on 8 CPU devices, which
    a dataset made each epoch paid each epoch). They are never donated (`dispatch.function`)."""
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.device_put([np.int32(i) for i in range(size)], replicated)


class Elements:
    """A block's elements, handed over together: the iterator returns the later ones itself,
    so the step's path between two launches stays a few Python operations. Blocked ones are
    made at once while the cores are free (made one by one beside the running steps, ``next``
    took twice as long); one replica's aliased batches as they are asked for."""

    __slots__ = ("items",)

    def __init__(self, items):
        self.items = items  # An iterable of the block's elements, at least one.
