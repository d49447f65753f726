"""Batch blocks: full batches of in-memory data placed several at a time, one transfer per block.

Placing a small batch on several devices costs mostly per-buffer work (one buffer per leaf and
device: about 110 us for a 64 KiB batch of two leaves on 8 CPU devices), not its bytes. A block
holds ``K`` consecutive full batches replica-major, ``(num_replicas, K, rows, *inner)`` sharded
over the replica axis, and is placed in one call with as many buffers as ONE batch; each element
then names its position in the block. Measured with a dispatch-bound step on 8 CPU devices
(``docs/design.md``, "Batch blocks"): one placement per batch runs at 0.73-0.79 of the speed of
batches already on the devices, blocks of 32 at 0.93-0.96, blocks of 64 at 0.95.

An element is a `BlockedPerReplica`: a `PerReplica` in every respect (``values``, ``stacked``,
pytree utilities, pickling), whose array is taken out of the block by a small program the first
time anything reads it, and kept. Only `strategy.run`'s direct call reads the block itself:
while it calls its program (`reading`), the element flattens to ``(block, position)`` and
unflattens to the row the position selects, so the step receives the same values, indexed
inside the compiled step where the index is free.

Blocks are used where a dataset's data is already in memory and its full batches share one shape
(a batched `NumpyDataset`), so waiting for ``K`` batches costs no loading latency.
"""

import contextlib
import functools
import math
import mmap
import threading

import jax
from jax import lax
import numpy as np

from jdist._src.host_values import int64_magnitudes
from jdist._src.values import PerReplica

BLOCK_BYTES = 4 << 20  # A block holds at most this many bytes of batches...
MAX_BATCHES = 64  # ...and at most this many batches.
ALIGNMENT = 64  # Bytes: what XLA's CPU buffers need to alias host memory.
HUGE_PAGE = 2 << 20  # Bytes: blocks this large are placed in huge pages.


class _Reading(threading.local):
    """Whether this thread's `strategy.run` is calling its direct program: set around that
    call (inline, as it is on every step's path), cleared as the program's trace begins."""
    active = False


reading = _Reading()
_IN_BLOCK = "in_block"  # The pytree metadata of an element flattened to (block, position).


def block_size(batch_bytes: int) -> int:
    """How many full batches of ``batch_bytes`` bytes one block holds (1: no blocks)."""
    return max(1, min(MAX_BATCHES, BLOCK_BYTES // max(1, int(batch_bytes))))


@contextlib.contextmanager
def reading_blocks(active: bool = True):
    """While inside, blocked values flatten to ``(block, position)`` (when ``active``), so the
    program called there indexes the block itself (`jdist.function`, `run`'s second launch)."""
    reading.active = active
    try:
        yield
    finally:
        reading.active = False


def blocks_read():
    """Called as the direct program's trace begins: JAX has flattened its arguments, so any
    other flattening (of a blocked value the step captured, say) gives the plain value."""
    reading.active = False


def in_block(value) -> bool:
    """Whether ``value`` is a dataset element held in a placed block (`BlockedPerReplica`)."""
    return isinstance(value, BlockedPerReplica)


def replica_struct(value: PerReplica) -> jax.ShapeDtypeStruct:
    """One replica's shape and dtype of an even `PerReplica`, read without taking a block's row."""
    if isinstance(value, BlockedPerReplica):
        return jax.ShapeDtypeStruct(value._block.shape[2:], value._block.dtype)
    return jax.ShapeDtypeStruct(value.stacked.shape[1:], value.stacked.dtype)


@jax.jit
def _take(block, position):
    return lax.dynamic_index_in_dim(block, position, 1, keepdims=False)


class BlockedPerReplica(PerReplica):
    """A full batch's leaf held as one position of a placed block (see the module doc)."""

    __slots__ = ("_block", "_position", "_taken")

    @classmethod
    def _at(cls, block, position, int64_magnitude=0):
        self = object.__new__(cls)
        self._block, self._position, self._taken = block, position, None
        self._lengths = self._view_valid_rows = self._components = None
        self._int64_magnitude = int64_magnitude  # As `PerReplica` records it.
        return self

    @property
    def _stacked(self):  # Read through `PerReplica.stacked`, `values`, flattening, ...
        if self._taken is None:
            with jax.ensure_compile_time_eval():  # Read inside a trace too: kept concrete.
                self._taken = _take(self._block, self._position)
        return self._taken

    @property
    def num_replicas(self):
        return self._block.shape[0]

    def __reduce__(self):  # Pickled and copied as the plain value it is.
        return PerReplica._from_stacked, (self._stacked,)


def _flatten(value):
    if reading.active:
        return (value._block, value._position), _IN_BLOCK
    return (value._stacked,), None


def _unflatten(aux, children):
    if aux != _IN_BLOCK:
        return PerReplica._from_stacked(children[0])
    block, position = children
    if isinstance(block, jax.Array) and isinstance(position, jax.Array):  # Tracers included.
        return PerReplica._from_stacked(_take(block, position))
    return BlockedPerReplica._at(block, position)  # JAX's own placeholders: structure only.


jax.tree_util.register_pytree_node(BlockedPerReplica, _flatten, _unflatten)


class BlockFeed:
    """Turns a dataset's blocks of full batches into elements (see the module doc).

    Args:
      mesh: the strategy's mesh; ``axis``: its replica axis.
      full_rows: the leading size of a full global batch (a multiple of the replica count).
      size: how many batches a block holds (at least 2).
    """

    def __init__(self, mesh, axis, full_rows, size):
        spec = jax.sharding.PartitionSpec
        self._sharding = jax.sharding.NamedSharding(mesh, spec(axis))
        self._split = (mesh.devices.size, full_rows // mesh.devices.size)
        self.size = size
        self._positions = _positions(mesh, size)

    def __call__(self, blocks, split):
        """Yields the elements of ``blocks`` (`NumpyDataset.blocks`' pairs) in order: `Elements`
        of a block of full batches, or one element made by ``split`` (a batch that is not full);
        closes ``blocks`` at the end."""
        try:
            for number, nest in blocks:
                yield split(nest) if number is None else self._place(number, nest)
        finally:
            blocks.close()

    def _place(self, number, nest):
        """`Elements` of ``number`` full batches, read one after another in ``nest``'s arrays,
        placed as one block (padded to the block's size: positions nobody reads)."""
        leaves, tree = jax.tree_util.tree_flatten(nest)
        blocks, magnitudes = [], []
        for leaf in leaves:
            batches = leaf.reshape((number,) + self._split + leaf.shape[1:])
            block = _aligned_empty((self._split[0], self.size) + batches.shape[2:], leaf.dtype)
            np.copyto(block[:, :number], np.swapaxes(batches, 0, 1))
            block[:, number:] = 0  # The data's last block: positions nobody reads.
            blocks.append(block)
            # TF sums int64 batches in int64: a reduce checks what JAX's int32 holds.
            magnitudes.append(int64_magnitudes(batches, number))
        blocks = jax.device_put(blocks, self._sharding)
        return Elements(jax.tree_util.tree_unflatten(tree, [
            BlockedPerReplica._at(b, self._positions[i], 0 if m is None else int(m[i]))
            for b, m in zip(blocks, magnitudes)]) for i in range(number))


@functools.lru_cache(maxsize=8)
def _positions(mesh, size):
    """The positions in a block, ``0 .. size - 1``, as scalars replicated on ``mesh``: placed
    once per mesh, not per dataset (placing 64 scalars costs about 3 ms on 8 CPU devices, which
    a dataset made each epoch paid each epoch). They are never donated (`dispatch.function`)."""
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.device_put([np.int32(i) for i in range(size)], replicated)


def _aligned_empty(shape, dtype):
    """An uninitialised host array at an address ``ALIGNMENT`` divides: JAX's CPU client then
    uses its memory as the device buffers (no copy), where an unaligned one is copied again.

    A large one is fresh anonymous memory advised to use huge pages (`_huge_page_empty`)."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        return _huge_page_empty(nbytes).view(dtype).reshape(shape)
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def _huge_page_empty(nbytes):
    """``nbytes`` of new private memory starting on a huge page, advised ``MADV_HUGEPAGE``.

    A block is allocated on the prefetch thread and freed on the consumer's, so the allocator
    hands the thread pages it has returned to the system: each 4 MiB block then took 400-1000
    page faults, 4-6 ms on this machine's 2 cores (an epoch's first block waits on them). As
    two huge pages the same memory faults twice (0.4 ms). The mapping is unmapped when the
    array, and JAX's buffer aliasing it, are gone; where huge pages are off it is plain memory.
    """
    pages = -(-nbytes // HUGE_PAGE) * HUGE_PAGE  # Whole huge pages: a partial one is small ones.
    region = mmap.mmap(-1, pages + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = np.frombuffer(region, np.uint8)
    start = -raw.ctypes.data % HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, start, pages)
    except OSError:  # A kernel without transparent huge pages: small pages, as np.empty.
        pass
    return raw[start:start + nbytes]


class Elements(tuple):
    """Consecutive elements handed to the consumer at once: a prefetch thread's hand-off (the
    two threads waking each other, about 45 us on 2 cores) is then paid once per block."""
