"""`NumpyDataset`: slices of in-memory NumPy arrays with the few tf.data verbs training needs.

What ``strategy.experimental_make_numpy_dataset(x)`` returns, as TF returns
``from_tensor_slices(x)``. The pipeline moves row indices, and a batch is one gather per array
(a read-only view where its rows are consecutive): no per-row Python work for batched data.
"""

import itertools
from typing import Any, Iterator, Optional

import jax
import numpy as np

from jdist._src import errors
from jdist._src.input import tf_shuffle
from jdist._src.host_values import owned_copy, read_only

INFINITE = -1  # tf.data.INFINITE_CARDINALITY
UNKNOWN = -2  # tf.data.UNKNOWN_CARDINALITY


class NumpyDataset:
    """A tf.data-like dataset over the rows of NumPy arrays (what TF's from_tensor_slices gives).

    Args:
      data: an array, or a nest of arrays sharing their leading size (copied here, as TF does).

    Example:
      >>> import numpy as np
      >>> ds = NumpyDataset(np.arange(5)).batch(2)
      >>> [b.tolist() for b in ds], ds.cardinality()
      ([[0, 1], [2, 3], [4]], 3)
    """

    def __init__(self, data: Any, _ops: tuple = ()):
        data = jax.tree_util.tree_map(np.asarray, data)
        leaves = jax.tree_util.tree_leaves(data)
        if not leaves:
            raise errors.InvalidArgumentError("a numpy dataset needs at least one array.")
        if any(a.ndim == 0 for a in leaves):
            raise errors.InvalidArgumentError(
                "a numpy dataset slices its arrays along the first axis; got a rank-0 array.")
        sizes = {a.shape[0] for a in leaves}
        if len(sizes) != 1:
            raise errors.InvalidArgumentError(
                "the arrays of a numpy dataset must share their first dimension, got "
                f"{sorted(sizes)}.")
        self._data = jax.tree_util.tree_map(owned_copy, data)
        self._size = sizes.pop()
        self._ops = tuple(_ops)
        self._placements: dict = {}  # Shared with every dataset made from this one, as `_data` is.

    @classmethod
    def from_tensor_slices(cls, data: Any) -> "NumpyDataset":
        """The rows of ``data`` (same as the constructor)."""
        return cls(data)

    def _then(self, op):
        out = object.__new__(NumpyDataset)
        out._data, out._size, out._ops = self._data, self._size, self._ops + (op,)
        out._placements = self._placements
        return out

    def batch(self, batch_size: int, drop_remainder: bool = False) -> "NumpyDataset":
        """Groups consecutive elements into batches of ``batch_size`` (the last may be smaller)."""
        return self._then(_Batch(_positive(batch_size, "batch_size"), bool(drop_remainder)))

    def shuffle(self, buffer_size: int, seed: Optional[int] = None,
                reshuffle_each_iteration: bool = True) -> "NumpyDataset":
        """Shuffles with a ``buffer_size`` buffer in tf.data's order for ``seed`` (`tf_shuffle`)."""
        return self._then(_Shuffle(_positive(buffer_size, "buffer_size"), seed,
                                   bool(reshuffle_each_iteration)))

    def repeat(self, count: Optional[int] = None) -> "NumpyDataset":
        """Repeats the data ``count`` times (None or -1: forever)."""
        return self._then(_Repeat(None if count is None or count == -1 else int(count)))

    def take(self, count: int) -> "NumpyDataset":
        """The first ``count`` elements (-1: all)."""
        return self._then(_Take(int(count)))

    def skip(self, count: int) -> "NumpyDataset":
        """All but the first ``count`` elements."""
        return self._then(_Skip(int(count)))

    def shard(self, num_shards: int, index: int) -> "NumpyDataset":
        """Every ``num_shards``-th element starting at ``index`` (tf.data's shard)."""
        num_shards = _positive(num_shards, "num_shards")
        if not 0 <= int(index) < num_shards:
            raise errors.InvalidArgumentError(f"index {index} must be in [0, {num_shards}).")
        return self._then(_Shard(num_shards, int(index)))

    def prefetch(self, buffer_size: Optional[int] = None) -> "NumpyDataset":
        """The same elements (kept in the pipeline: between ``shuffle`` and ``repeat`` it changes
        the epochs' shuffle orders, as in tf.data)."""
        return self._then(_Prefetch(buffer_size))

    def __iter__(self) -> Iterator[Any]:
        for item in self._indices()():
            yield self._read(_rows(item))

    @property
    def arrays(self) -> Any:
        """The dataset's own aligned read-only copy of its data (`batch_blocks` places it as is)."""
        return self._data

    def __getstate__(self):  # Without `placements`: this process's arrays over this memory.
        state = dict(self.__dict__)
        state["_placements"] = {}
        return state

    def __setstate__(self, state):  # Its own aligned read-only copy again, as when made.
        self.__dict__.update(state)
        self._data = jax.tree_util.tree_map(owned_copy, self._data)

    @property
    def placements(self) -> dict:
        """The device arrays the distributed input made over `arrays`, kept with the data so
        every later epoch reuses them (`in_place_batches`, `batch_blocks`)."""
        return self._placements

    def blocks(self, count: int) -> Iterator[tuple[Optional[int], Any]]:
        """The elements in order as ``(number, rows)``: up to ``count`` full ones and the rows
        of `arrays` they read (a slice or a 1-D index), or ``(None, element)`` for another."""
        rows, group = self.batch_rows, []
        for item in self._indices()():
            if _is_rows(item) and _length(item) == rows:
                group.append(item)
                if len(group) == count:
                    yield count, _joined(group)
                    group = []
                continue
            if group:
                yield len(group), _joined(group)
                group = []
            yield None, self._read(_rows(item))
        if group:
            yield len(group), _joined(group)

    def _read(self, index):
        return jax.tree_util.tree_map(lambda a: read_only(a[index]), self._data)

    def _indices(self):
        ops = [op for op in self._ops if not op.is_noop]
        if any(isinstance(a, _Shuffle) and isinstance(b, _Repeat) and b.count == 0
               for a, b in zip(ops, ops[1:])):
            raise errors.InvalidArgumentError(
                "shuffle(...).repeat(0): tf.data fuses a repeat that follows a shuffle into one "
                "op, which refuses a count of 0 (\"count must be greater than zero or equal to "
                "-1\") when the data is read. Leave the repeat(0) out, or take(0) for no data.")
        if ops and isinstance(ops[0], _Batch):  # Batches of the rows in order: no per-row work.
            factory, ops = ops[0].of_rows(self._size), ops[1:]
        else:
            factory = lambda: tf_shuffle.Rows(range(self._size))  # A shuffle reads arrays.
        previous = None
        for op in ops:
            factory = op.wrap(factory, fused=isinstance(previous, _Shuffle)) if isinstance(
                op, _Repeat) else op.wrap(factory)
            previous = op
        return factory

    @property
    def iteration_seeds(self) -> list:
        """Each shuffle's `tf_shuffle.IterationSeeds`, in pipeline order (`iterator_state`)."""
        return [op.seeds for op in self._ops if isinstance(op, _Shuffle)]

    def describe(self) -> list:
        """The pipeline as JSON without seeds: the rows, then each op (`iterator_state`)."""
        return [self._size] + [[type(op).__name__.strip("_")] + sorted(
            f"{k}={v}" for k, v in vars(op).items() if k != "seeds") for op in self._ops]

    def cardinality(self) -> int:
        """The number of elements: an int, or -1 (INFINITE) for an endless repeat."""
        count = self._size
        for op in self._ops:
            count = op.cardinality(count)
        return count

    def __len__(self) -> int:
        count = self.cardinality()
        if count < 0:
            raise TypeError("the dataset is infinite; it has no len().")
        return count

    @property
    def batch_rows(self) -> Optional[int]:
        """The leading size of a full element (the outermost batch size), None if unbatched."""
        sizes = [op.size for op in self._ops if isinstance(op, _Batch)]
        return sizes[-1] if sizes else None

    def full_batches_in_order(self) -> Optional[int]:
        """How many full batches one pass gives where the pipeline is a batch of the rows in
        order, repeated or not (``batch(3).repeat()`` of 10 rows: 3); else None."""
        ops = [op for op in self._ops if not op.is_noop and not isinstance(op, _Prefetch)]
        if ops and isinstance(ops[0], _Batch) and all(isinstance(op, _Repeat) for op in ops[1:]):
            return self._size // ops[0].size
        return None

    @property
    def fixed_shapes(self) -> bool:
        """Whether every element has the shape of `element_spec` (TF's statically shaped)."""
        return all(op.drop for op in self._ops if isinstance(op, _Batch))

    @property
    def element_spec(self) -> Any:
        """A nest of ``jax.ShapeDtypeStruct`` describing a full element (batch dims included)."""
        outer = tuple(op.size for op in reversed(self._ops) if isinstance(op, _Batch))
        return jax.tree_util.tree_map(
            lambda a: jax.ShapeDtypeStruct(outer + a.shape[1:], a.dtype), self._data)

    def __repr__(self) -> str:
        return f"NumpyDataset(rows={self._size}, element_spec={self.element_spec})"


def _sliced(items, rows: slice):
    """``items`` cut by ``rows`` (a take, skip or shard), rows in order staying `tf_shuffle.Rows`."""
    if isinstance(items, tf_shuffle.Rows):
        sliced = items.sliced(rows)
        if sliced is not None:
            return sliced
    return itertools.islice(items, rows.start, rows.stop, rows.step)


def _rows(item):
    """An index for ``array[index]``: consecutive rows as a slice (a view, no copy)."""
    if isinstance(item, slice):
        return item
    if isinstance(item, np.ndarray) and item.ndim == 1 and item.size > 1 and (
            item[-1] - item[0] == item.size - 1 and bool(np.all(np.diff(item) == 1))):
        return slice(int(item[0]), int(item[-1]) + 1)
    return item


def _is_rows(item):
    """Whether an item reads rows of the data, not a nested batch."""
    return isinstance(item, slice) or (isinstance(item, np.ndarray) and item.ndim == 1)


def _length(item):
    return item.stop - item.start if isinstance(item, slice) else len(item)


def _joined(items):
    """One index reading ``items``' rows one after another (a slice when they are consecutive)."""
    if all(isinstance(x, slice) for x in items) and all(
            a.stop == b.start for a, b in zip(items, items[1:])):
        return slice(items[0].start, items[-1].stop)
    return _rows(np.concatenate([_row_indices(x) for x in items]))


def _row_indices(item):
    """The rows an item of a batched dataset reads, as an array (for batching it again)."""
    return np.arange(item.start, item.stop) if isinstance(item, slice) else item


def _stack(chunk):
    try:
        return np.stack(chunk)
    except ValueError as e:
        raise errors.InvalidArgumentError(
            f"cannot batch elements of different shapes: {e}") from None


def _positive(value, name):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise errors.InvalidArgumentError(f"{name} must be a positive int, got {value!r}.")
    return int(value)


class _Batch:
    is_noop = False

    def __init__(self, size, drop_remainder):
        self.size, self.drop = size, drop_remainder

    def of_rows(self, size):
        """The batches of rows ``0 .. size - 1`` in order, each one ``slice`` (read as a view)."""
        stop = size - size % self.size if self.drop else size
        return lambda: (slice(start, min(start + self.size, size))
                        for start in range(0, stop, self.size))

    def wrap(self, upstream):
        if isinstance(upstream, _Shuffled):  # Its runs of row indices cut as arrays.
            return lambda: self._batches_of_runs(upstream.runs())
        return lambda: self._batches_of(upstream())  # Its input made at once, as tf.data's.

    def _batches_of(self, items):
        if isinstance(items, tf_shuffle.Rows):  # Row indices in order: cut as arrays.
            return self._batches_of_runs(items.runs(self.size))
        return self._batches(iter(items))

    def _batches_of_runs(self, runs):
        """`_batches` of a shuffle's runs (`tf_shuffle.shuffled_runs`), cut as arrays."""
        first = next(runs, None)
        if first is None:
            return
        runs = itertools.chain((first,), runs)
        if not isinstance(first, np.ndarray) and not isinstance(first[0], int):
            yield from self._batches(itertools.chain.from_iterable(runs))
            return
        pending = np.zeros(0, np.intp)
        for run in runs:
            run = np.asarray(run, np.intp)
            pending = np.concatenate([pending, run]) if len(pending) else run
            while len(pending) >= self.size:
                yield pending[:self.size]
                pending = pending[self.size:]
        if len(pending) and not self.drop:
            yield pending

    def _batches(self, it):
        while True:
            first = next(it, None)
            if first is None:
                return
            rest = itertools.islice(it, self.size - 1)
            if isinstance(first, int):  # Row indices: read into one array in C, no list.
                chunk = np.fromiter(itertools.chain((first,), rest), np.intp)
            else:
                chunk = [_row_indices(x) for x in (first, *rest)]
            if self.drop and len(chunk) < self.size:
                return
            yield chunk if isinstance(first, int) else _stack(chunk)

    def cardinality(self, count):
        if count < 0:
            return count
        return count // self.size if self.drop else -(-count // self.size)


class _Shuffle:
    is_noop = False

    def __init__(self, buffer_size, seed, reshuffle):
        self.buffer_size = buffer_size
        self.seeds = tf_shuffle.IterationSeeds(tf_shuffle.op_seeds(seed), reshuffle)

    def wrap(self, upstream):
        return _Shuffled(upstream, self.buffer_size, self.seeds)

    def cardinality(self, count):
        return count


class _Shuffled:
    """A shuffle's iterators: called, its items; `runs`, in runs (for a `_Batch` after it)."""

    def __init__(self, upstream, buffer_size, seeds):
        self._upstream, self._buffer_size, self._seeds = upstream, buffer_size, seeds

    def __call__(self):
        return tf_shuffle.shuffled(self._upstream, self._buffer_size, self._seeds.next())

    def runs(self):
        return tf_shuffle.shuffled_runs(self._upstream, self._buffer_size, self._seeds.next())


class _Repeat:
    """tf.data's repeat, down to the input iterators it makes (each draws a shuffle's seeds):
    one per epoch and, for a finite count, one more after the last, unless fused with a
    shuffle just before it (``ShuffleAndRepeat``)."""

    def __init__(self, count):
        self.count = count
        self.is_noop = count == 1

    def wrap(self, upstream, fused=False):
        if self.count == 0:
            return lambda: iter(())

        def epochs():
            first = upstream()
            if isinstance(first, tf_shuffle.Rows):  # Rows in order: their input has no effects.
                return first.repeated(self.count)
            return self._epochs(first, upstream, not fused)
        return epochs

    def _epochs(self, it, upstream, one_more):
        epoch = 0
        while True:
            empty = True
            for item in it:
                empty = False
                yield item
            epoch += 1
            if self.count is not None and epoch >= self.count:
                if one_more:
                    upstream()
                return
            if empty:
                return
            it = upstream()

    def cardinality(self, count):
        if count == 0 or self.count == 0:
            return 0
        if self.count is None or count < 0:
            return INFINITE if self.count is None or count == INFINITE else count
        return count * self.count


class _Prefetch:
    def __init__(self, buffer_size):
        self.is_noop = buffer_size == 0

    def wrap(self, upstream):
        return upstream

    def cardinality(self, count):
        return count


class _Take:
    def __init__(self, count):
        self.count = count
        self.is_noop = count < 0

    def wrap(self, upstream):
        if self.count == 0:
            return lambda: iter(())  # tf.data makes no input for it.
        return lambda: _sliced(upstream(), slice(self.count))

    def cardinality(self, count):
        if self.count < 0:
            return count
        return self.count if count == INFINITE else min(count, self.count)


class _Skip:
    def __init__(self, count):
        self.count = count
        self.is_noop = count == 0

    def wrap(self, upstream):
        if self.count < 0:  # Everything skipped: the input is made (as tf.data does), not read.
            return lambda: (upstream(), iter(()))[1]
        return lambda: _sliced(upstream(), slice(self.count, None))

    def cardinality(self, count):
        if self.count < 0:
            return 0 if count >= 0 else count
        return count if count < 0 else max(0, count - self.count)


class _Shard:
    def __init__(self, num_shards, index):
        self.num, self.index = num_shards, index
        self.is_noop = num_shards == 1

    def wrap(self, upstream):
        return lambda: _sliced(upstream(), slice(self.index, None, self.num))

    def cardinality(self, count):
        if count < 0:
            return count
        return max(0, -(-(count - self.index) // self.num))
