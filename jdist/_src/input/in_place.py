"""Full batches read in place: on CPU devices, a numpy dataset's batches as arrays whose device
buffers are the dataset's own rows, made at the first epoch and kept for the later ones.

JAX's CPU client uses aligned host memory as a device buffer without a copy, and a `NumpyDataset`
holds an aligned, read-only copy of its data. Where its full batches are its rows in order and
every replica's part starts at an aligned address, each batch's array is its rows themselves
(`host_values.placed_split`): the step gets what a batch placed by hand gives it. Making one
costs about 3.4 us per buffer, so they are made once, a block at a time while the devices are
idle, and kept with the data (`NumpyDataset.placements`). Past `KEPT_BUFFERS`, shuffled or
unaligned data is read in blocks (`batch_blocks`); ``docs/design.md``, "Batches read in place".
"""

import itertools
import operator
from typing import Callable, Optional

import jax
import numpy as np

from jdist._src.host_values import (ALIGNMENT, held_copy, held_narrower, placed_as_is,
                                    placed_split, read_only)
from jdist._src.values import PerReplica

KEPT_BUFFERS = 1 << 15  # The most device buffers a dataset's kept batches may hold.
deleted = operator.methodcaller("is_deleted")  # Of a jax.Array: donated, or by hand.


class InPlaceBatches:
    """A dataset's full batches as arrays over its own rows (see the module doc).

    Args:
      mesh: the strategy's mesh of CPU devices; ``axis``: its replica axis.
      full_rows: the leading size of a full global batch (a multiple of the replica count).
      batches_per_pass: how many full batches one pass over the data gives
        (`NumpyDataset.full_batches_in_order`).
      guard: the `dispatch.DispatchGuard` of the mesh's devices.
    """

    def __init__(self, mesh, axis, full_rows: int, batches_per_pass: int, guard):
        n = mesh.devices.size
        spec = jax.sharding.PartitionSpec(axis) if n > 1 else jax.sharding.PartitionSpec()
        self._sharding = jax.sharding.NamedSharding(mesh, spec)
        # TF's one-replica elements are the plain batches; several replicas' are `PerReplica`.
        self._shape: tuple = (n, full_rows // n) if n > 1 else (full_rows,)
        self._wrap: Optional[Callable] = PerReplica._from_stacked if n > 1 else None
        self._n, self._rows, self._buffers, self._guard = n, full_rows, batches_per_pass * n, guard
        self.key = ("in place", self._sharding, full_rows)  # Its arrays' place in a store.

    def readable(self, leaves) -> bool:
        """Whether the batches of ``leaves`` can be read in place: every leaf aligned (64-bit
        ones: their 32-bit copy), at most `KEPT_BUFFERS` buffers in all."""
        return self._buffers * len(leaves) <= KEPT_BUFFERS and all(
            map(self._aligned_as_held, leaves))

    def _aligned_as_held(self, leaf) -> bool:
        """A replica's part of ``leaf``, as JAX holds it, is a multiple of `ALIGNMENT` bytes."""
        part = leaf[:self._rows // self._n].nbytes
        if held_narrower(leaf):
            return leaf.flags.c_contiguous and part // 2 % ALIGNMENT == 0
        return placed_as_is(leaf) and part % ALIGNMENT == 0

    def elements(self, leaves, tree, rows, kept: dict):
        """The elements of the full batches reading ``rows`` (a slice, or consecutive rows per
        batch): from ``kept`` (arrays and values by first row) where still alive, else made."""
        starts = range(rows.start, rows.stop, self._rows) if isinstance(rows, slice) else \
            rows[::self._rows].tolist()
        held: list = list(map(kept.get, starts))
        if None in held or any(map(deleted, itertools.chain.from_iterable(
                arrays for arrays, _ in held))):
            self._make(leaves, kept, starts)  # The first epoch, or an array deleted since.
            held = list(map(kept.get, starts))
        return tuple(tree.unflatten(values) for _, values in held)

    def _make(self, leaves, kept, starts):
        """Places the batches of ``starts`` missing from ``kept`` (or deleted since), once the
        program in flight has finished: the cores are then the placement's alone."""
        missing = [r for r in starts if r not in kept or any(map(deleted, kept[r][0]))]
        self._guard.wait()
        held = self._held(leaves, kept)
        made = [placed_split([self._rows_of(leaf, r) for r in missing], self._sharding)
                for leaf in held]
        wrap = self._wrap or (lambda array: array)
        for r, arrays in zip(missing, zip(*made)):
            kept[r] = arrays, tuple(map(wrap, arrays))

    @staticmethod
    def _held(leaves, kept):
        """``leaves`` as JAX holds them (a 64-bit one's 32-bit copy without x64), made once."""
        if "held" not in kept:
            kept["held"] = tuple(read_only(held_copy(leaf)) for leaf in leaves)
        return kept["held"]

    def _rows_of(self, leaf: np.ndarray, first: int) -> np.ndarray:
        """The batch of ``leaf`` from row ``first``, shaped as its array is placed."""
        return leaf[first:first + self._rows].reshape(self._shape + leaf.shape[1:])
