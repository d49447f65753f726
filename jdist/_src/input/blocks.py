"""Batch blocks: full batches of in-memory data placed several at a time, one transfer per block.

Placing a small batch costs mostly per-buffer work (one buffer per leaf and device), not its
bytes. A block holds ``K`` consecutive full batches, ``(K, num_replicas, rows, *inner)``, placed
in one call with as many buffers as ONE batch (measurements: ``docs/design.md``, "Batch blocks").

* ``K`` consecutive batches of a `NumpyDataset`'s rows are those rows, so a block is a view of
  its aligned read-only copy; shuffled rows, 64-bit data and short blocks are copied first.
* On CPU devices a block is placed replicated (every device's buffer is the host memory) by the
  loop's own thread, kept for later epochs; a prefetch thread would only compete with the
  devices for the host's cores. On accelerators it is sharded over the replica axis and placed
  ahead by the prefetch thread. Rows in order and aligned skip blocks: `in_place_batches`.
* An element is an ordinary `PerReplica` (one replica: a plain array, as TF's), cut out of its
  block by one compiled program for `CUT` batches at a time: a step sees plain values.
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
    """Whether ``mesh``'s devices (JAX's default device for the default strategy's None) are
    the host's CPU cores (blocks placed by the loop's thread)."""
    return (jax.devices()[0] if mesh is None else mesh.devices.flat[0]).platform == "cpu"


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
        # CPU devices run on the host's cores: a thread's copy there stalls every device's
        # collective (`docs/design.md`, "Who places a block").
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
        """Yields the elements of ``blocks`` (`NumpyDataset.blocks`): `Elements` of a block, or
        ``split(rows)`` for a batch that is not full. Arrays over the data's own memory are
        kept in ``placements``. A copy or placement first waits for the program in flight
        (`DispatchGuard.wait`): beside a running step it took two to three times as long."""
        leaves, tree = jax.tree_util.tree_flatten(arrays)
        in_place = self._in_place if self._in_place and self._in_place.readable(leaves) else None
        key = in_place.key if in_place else ("blocks", self._sharding, self.size, self._split)
        # One way of placing kept per dataset, so what it holds stays within `KEPT_BUFFERS`.
        kept = placements.get(key) if self._in_place else {}
        if kept is None:
            placements.clear()
            kept = placements[key] = {}
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
        """`Elements` of ``number`` full batches placed as one block: the dataset's own memory
        where it can be (`_as_is`), else a copy padded to the block's size."""
        start, first, blocks = self._as_is(leaves, rows, number)
        if blocks is not None and self.on_loop_thread and self._plain is None:
            placed = self._kept_placement(kept, start, blocks)  # At the first epoch only.
            return self._blocked_elements(tree, placed, first, number)
        if blocks is None:
            self._guard.wait()
            blocks = [self._copied(leaf, rows, number) for leaf in leaves]
        if self._plain is not None:
            return Elements(tree.unflatten(batch)
                            for batch in self._plain(blocks, first, number))
        blocks = (placed_replicated(blocks, self._sharding) if self.on_loop_thread
                  else jax.device_put(list(blocks), self._sharding))
        return self._blocked_elements(tree, blocks, first, number)

    def _blocked_elements(self, tree, blocks, first, number):
        """`PerReplica` elements cut out of placed ``blocks``, made at once while the cores are free."""
        return Elements(tuple(tree.unflatten([PerReplica._from_stacked(x) for x in batch])
                              for batch in self._cut_placed(blocks, first, number)))

    def _kept_placement(self, kept, start, blocks):
        """``blocks`` (read in place) placed replicated once and ``kept`` for later epochs,
        within `in_place_batches.KEPT_BUFFERS` buffers: they hold no memory of their own."""
        placed = kept.get(start)
        if placed is not None and not any(map(in_place_batches.deleted, placed)):
            return placed  # Else never placed, or one of them donated or deleted since.
        self._guard.wait()
        placed = placed_replicated(blocks, self._sharding)
        kept.pop(start, None)
        if (len(kept) + 1) * len(placed) * self._split[0] <= in_place_batches.KEPT_BUFFERS:
            kept[start] = placed
        return placed

    def _cut_batches(self, blocks, first, number):
        """One replica on an accelerator: the block placed in one transfer, batches cut out."""
        return self._cut_placed(jax.device_put(list(blocks), self._sharding), first, number)

    def _cut_placed(self, blocks, first, number):
        """The ``number`` batches of placed ``blocks`` from position ``first``, one array per
        leaf each (a launch past the block's end re-reads its last position; dropped)."""
        return [batch for start in range(first, first + number, self._cut_count)
                for batch in self._cut(blocks, self._positions[start])][:number]

    def _aliased_batches(self, blocks, first, number):
        """One replica on a CPU device: each batch's buffer aliases its rows in the block's
        host memory (`host_values.aliased`), no copy and no program."""
        return zip(*(aliased(block[first:first + number, 0], self._sharding)
                     for block in blocks))

    def _as_is(self, leaves, rows, number):
        """``(start, first, blocks)``: each leaf's block's worth of rows ending with ``rows``,
        from row ``start``, where they are consecutive and `placed_as_is`, the batches at
        positions ``first`` on; else ``(None, 0, None)``."""
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
        """``leaf``'s ``rows`` copied into the block's layout, in the dtype JAX holds them in."""
        shape = (self.size,) + self._split + leaf.shape[1:]
        block = aligned_empty(shape, leaf.dtype)
        if isinstance(rows, slice):
            np.copyto(block[:number], leaf[rows].reshape((number,) + shape[1:]))
        else:  # Indices are in range: "wrap" only spares numpy a buffer.
            np.take(leaf, rows.reshape((number,) + shape[1:3]), axis=0, out=block[:number],
                    mode="wrap")
        return held_copy(block)


CUT = 8  # The batches one launch cuts out of a block (its compile grows with it).


def _cut_count(size):
    """The most batches, up to `CUT`, that divide ``size``: no launch reads past the block."""
    return max(c for c in range(1, min(CUT, size) + 1) if size % c == 0)


@functools.lru_cache(maxsize=16)
def _cutter(sharding, count, one_replica):
    """The program cutting ``count`` batches from a position on out of blocks, onto ``sharding``
    (``one_replica``: the plain batch). Eight per launch: 64 compiled up to 5x slower."""
    def cut(blocks, start):
        return [[_take(block, start + i)[0] if one_replica else _take(block, start + i)
                 for block in blocks] for i in range(count)]
    return jax.jit(cut, out_shardings=sharding)


@functools.lru_cache(maxsize=8)
def _positions(mesh, size):
    """Positions ``0 .. size - 1`` as scalars replicated on ``mesh``, placed once per mesh (64
    cost about 3 ms on 8 CPU devices); never donated (`dispatch.function`)."""
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.device_put([np.int32(i) for i in range(size)], replicated)


class Elements:
    """A block's elements, handed over together: the iterator returns the later ones itself,
    so the step's path between two launches stays a few Python operations."""

    __slots__ = ("items",)

    def __init__(self, items):
        self.items = items  # An iterable of the block's elements, at least one.
