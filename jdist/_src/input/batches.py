"""From host batches to per-replica values: `Source` adapts what users bring,
`GlobalBatchSplitter` and `PerReplicaDealer` apply TF's rules, `Placer` transfers each element.

A leaf whose replica chunks share a shape becomes ONE array ``(N, rows, *inner)`` sharded over
the replicas; a partial batch's differing chunks become a ragged `PerReplica`, which ``run``
computes on exactly (``docs/design.md``, "Partial and uneven batches").
"""

import collections.abc
import itertools

import jax
import numpy as np

from jdist._src import errors
from jdist._src.host_values import check_host_numbers
from jdist._src.host_values import dtype_kind
from jdist._src.input.numpy_dataset import NumpyDataset
from jdist._src.input.numpy_dataset import UNKNOWN
from jdist._src.values import DistributedValues
from jdist._src.values import PerReplica
from jdist._src.values import is_distributed


def _is_tf_dataset(obj):
    module = type(obj).__module__ or ""
    return ("tensorflow" in module and hasattr(obj, "element_spec")
            and hasattr(obj, "as_numpy_iterator"))


class Source:
    """An iterable of host batches, opened once per pass: a ``tf.data.Dataset``, a `NumpyDataset`,
    a re-iterable, a one-shot iterator, or a function returning a fresh iterable (``what``:
    the API name, for error messages)."""

    def __init__(self, obj, what):
        if isinstance(obj, (np.ndarray, jax.Array, DistributedValues)):
            raise errors.InvalidArgumentError(
                f"{what} takes a dataset of global batches, not an array: use "
                "strategy.experimental_make_numpy_dataset(array).batch(global_batch_size), or "
                "pass a list of batches.")
        if isinstance(obj, (str, bytes, collections.abc.Mapping)):
            raise errors.InvalidArgumentError(
                f"{what} takes an iterable of batches, got a {type(obj).__name__}; for a dict of "
                "arrays use strategy.experimental_make_numpy_dataset(d).batch(global_batch_size).")
        self._obj = obj
        self.is_tf = _is_tf_dataset(obj)
        self.one_shot = isinstance(obj, collections.abc.Iterator)
        self._callable = not self.is_tf and callable(obj) and not isinstance(
            obj, collections.abc.Iterable)
        if not (self.is_tf or self._callable or isinstance(obj, collections.abc.Iterable)):
            raise errors.UnsupportedValueError(
                f"{what} takes a tf.data.Dataset, an iterable of batches or a function returning "
                f"one; got {type(obj).__name__}.")
        self._opened = False
        self._stash = []  # A one-shot source's batch read early by `first`.

    @property
    def dataset(self):
        """What the user passed."""
        return self._obj

    def open(self):
        """A new iterator of NumPy nests over the whole data (once only for one-shot sources)."""
        if self.one_shot:
            if self._opened:
                raise errors.InvalidArgumentError(
                    "this distributed dataset reads a one-shot iterator "
                    f"({type(self._obj).__name__}) that was already read; to iterate again, pass "
                    "a re-iterable (a list, a loader object, or a function of no arguments "
                    "returning a fresh generator).")
            self._opened = True
            stash, self._stash = self._stash, []
            return _host_batches(self._obj, stash)
        if isinstance(self._obj, NumpyDataset):
            return _host_batches(iter(self._checked_numpy()), (), convert=False)
        return _host_batches(self._obj.as_numpy_iterator() if self.is_tf else iter(
            self._obj() if self._callable else self._obj), ())

    def open_blocks(self, count):
        """A batched `NumpyDataset`'s ``(arrays, blocks(count), placements)``."""
        dataset = self._checked_numpy()
        return dataset.arrays, dataset.blocks(count), dataset.placements

    def _checked_numpy(self):
        """The `NumpyDataset`, its arrays checked once per pass (its batches are used as is)."""
        to_host(self._obj._data)
        return self._obj

    def first(self):
        """The first batch as a NumPy nest (None if none), without losing it; or the declared
        ``jax.ShapeDtypeStruct`` s, unread (reading would advance a shuffle's orders)."""
        if isinstance(self._obj, NumpyDataset):
            return self._obj.element_spec
        if self.is_tf:
            static = self._tf_spec(unknown_as_zero=False)
            if static is not None:
                return static
        if self.one_shot:
            if self._opened:
                return None
            if not self._stash:
                self._stash.extend(itertools.islice(self._obj, 1))
            return to_host(self._stash[0]) if self._stash else None
        it = self.open()
        try:
            return next(it, None)
        finally:
            it.close()

    def cardinality(self):
        """How many batches one pass yields: an int, -1 (infinite) or -2 (unknown)."""
        if self.is_tf:
            return int(self._obj.cardinality())
        if isinstance(self._obj, NumpyDataset):
            return self._obj.cardinality()
        sized = not self.one_shot and isinstance(self._obj, collections.abc.Sized)
        try:
            return len(self._obj) if sized else UNKNOWN
        except TypeError:
            return UNKNOWN

    def static_rows(self):
        """The leading size of a full batch when the source declares it, else None."""
        if isinstance(self._obj, NumpyDataset):
            return self._obj.batch_rows
        if self.is_tf:
            dims = {s[0] for s in self._tf_shapes() if s is not None and len(s) >= 1}
            return dims.pop() if len(dims) == 1 and None not in dims else None
        return None

    def fixed_shapes(self):
        """Whether the source declares one shape for every element (None: it declares none)."""
        if isinstance(self._obj, NumpyDataset):
            return self._obj.fixed_shapes
        if self.is_tf:
            return all(s is not None and None not in s for s in self._tf_shapes())
        return None

    def is_unbatched(self):
        """True when the source declares rank-0 elements (an unbatched dataset)."""
        if isinstance(self._obj, NumpyDataset):
            return is_unbatched(self._obj.element_spec)
        if self.is_tf:
            return any(s is not None and len(s) == 0 for s in self._tf_shapes())
        return False

    def empty_spec(self):
        """A tf.data spec, unknown dimensions 0 (TF's dummy for a worker without data), or None."""
        return self._tf_spec(unknown_as_zero=True) if self.is_tf else None

    def _tf_spec(self, unknown_as_zero):
        """The tf.data element spec as ``jax.ShapeDtypeStruct`` s (see `empty_spec`), or None."""
        import tensorflow as tf  # pylint: disable=import-outside-toplevel
        specs = self._obj.element_spec
        flat = tf.nest.flatten(specs)
        known = (lambda x: x.shape.rank is not None) if unknown_as_zero else (
            lambda x: x.shape.is_fully_defined())
        if not all(isinstance(x, tf.TensorSpec) and known(x) for x in flat):
            return None
        structs = [jax.ShapeDtypeStruct(tuple(0 if d is None else d for d in x.shape.as_list()),
                                        x.dtype.as_numpy_dtype) for x in flat]
        return tf.nest.pack_sequence_as(specs, structs)

    def _tf_shapes(self):
        import tensorflow as tf  # pylint: disable=import-outside-toplevel
        shapes = [getattr(spec, "shape", None) for spec in tf.nest.flatten(self._obj.element_spec)]
        return [None if s is None or s.rank is None else tuple(s.as_list()) for s in shapes]


def _host_batches(it, stash, convert=True):
    """``stash`` then ``it`` as NumPy nests (``convert=False``: checked already); closes ``it``."""
    try:
        for element in stash:
            yield to_host(element)
        for element in it:
            yield to_host(element) if convert else element
    finally:
        if hasattr(it, "close"):
            it.close()


def to_host(element):
    """``element`` with every leaf as a NumPy array of a dtype a device can hold."""
    return jax.tree_util.tree_map(_host_array, element, is_leaf=is_distributed)


def _host_array(x):
    if is_distributed(x):
        raise errors.InvalidArgumentError(
            f"a batch holds a {type(x).__name__}: it is distributed already. A distributed "
            "dataset takes global batches of arrays (or, from distribute_datasets_from_function, "
            "per-replica batches), which it splits or deals to the replicas itself.")
    a = np.asarray(x)
    if dtype_kind(a.dtype) is None:  # bfloat16 and the other ml_dtypes are numbers too.
        raise errors.InvalidArgumentError(
            f"a batch holds a value of dtype {a.dtype} ({type(x).__name__}), which cannot be "
            "placed on a device; convert strings and objects to numbers in the input pipeline.")
    check_host_numbers(a)
    return a


WHOLE, STACKED, RAGGED = "whole", "stacked", "ragged"  # How `Placer` places a leaf.


class Placer:
    """Puts the leaves of one element on the strategy's devices, in one transfer call: whole
    leaves replicated, stacked ones sharded over the replicas, ragged chunks each to its
    replica's device (``fetch_to_device=False`` keeps them on the host for ``run``)."""

    whole_batches_here = True  # Every row of a global batch goes to this process's devices.

    def __init__(self, strategy, fetch_to_device=True):
        extended = strategy.extended
        self.n = strategy.num_replicas_in_sync
        self.fetch = fetch_to_device
        self.plain = extended.mesh is None  # The default strategy: no mesh of its own.
        if self.plain:
            self._targets = {WHOLE: None}
        else:  # A whole leaf goes where `run` wants it, so `run` does not place it again.
            spec = jax.sharding.PartitionSpec
            self._targets = {WHOLE: jax.sharding.NamedSharding(extended.mesh, spec()),
                             RAGGED: list(extended.replica_devices),
                             STACKED: jax.sharding.NamedSharding(
                                 extended.mesh, spec(extended.replica_axis))}

    @staticmethod
    def whole(array):
        """A leaf given to the only replica as it is."""
        return (array, None, WHOLE)

    def split(self, chunks, rows):
        """A leaf from one chunk per replica: stacked if their shapes agree, else ragged."""
        if len({c.shape for c in chunks}) == 1:
            return (np.stack(chunks), None, STACKED)
        return (list(chunks), None, RAGGED)

    def place(self, leaves):
        """The element's values: arrays for `whole` leaves, `PerReplica` for the others."""
        arrays = [a for a, _, _ in leaves]
        kinds = {kind for _, _, kind in leaves}
        if self.fetch and len(kinds) == 1 and RAGGED not in kinds:
            # One target for every leaf: a third cheaper than a list of targets.
            arrays = jax.device_put(arrays, self._targets[kinds.pop()])
        elif self.fetch:
            arrays = jax.device_put(arrays, [self._targets[kind] for _, _, kind in leaves])
        return [PerReplica._from_stacked(a, lengths) if kind == STACKED
                else PerReplica._from_components(a) if kind == RAGGED else a
                for a, (_, lengths, kind) in zip(arrays, leaves)]

class GlobalBatchSplitter:
    """Splits global batches by TF's rule: consecutive chunks of ``ceil(B / N)`` rows, trailing
    replicas getting fewer or none. ``full_rows``: a full batch's size if known (else the
    largest seen); ``order``: replica ``i``'s chunk (`auto_shard.chunk_order`), None: ``i``."""

    def __init__(self, placer, full_rows=None, order=None):
        self.placer = placer
        self.n = placer.n
        self.rows = None if full_rows is None else -(-full_rows // self.n)
        self._chunks = range(self.n) if order is None else list(order)  # Replica i's chunk.
        self._stacked = slice(None) if order is None else list(order)  # The same, as an index.

    def __call__(self, batch):
        leaves, tree = jax.tree_util.tree_flatten(batch)
        if not leaves:
            raise errors.InvalidArgumentError("a dataset element has no arrays in it.")
        n, placer = self.n, self.placer
        if is_unbatched(leaves):
            if n > 1 and not placer.plain:
                raise unbatched_error(n)
            whole = placer.place([placer.whole(a) for a in leaves])
            return jax.tree_util.tree_unflatten(tree, whole)
        size = batch_size(leaves)
        per_replica = -(-size // n)
        self.rows = rows = per_replica if self.rows is None else max(self.rows, per_replica)
        if placer.plain or n == 1:
            parts = [placer.whole(a) for a in leaves]
        elif size == n * rows:  # A full batch: a free reshape, no padding, lengths None.
            columns = [a.reshape((n, rows) + a.shape[1:])[self._stacked] for a in leaves]
            parts = [(c, None, STACKED) for c in columns]
        else:
            bounds = [(min(i * per_replica, size), min((i + 1) * per_replica, size))
                      for i in self._chunks]
            columns = [[a[lo:hi] for lo, hi in bounds] for a in leaves]
            parts = [placer.split(c, rows) for c in columns]
        return jax.tree_util.tree_unflatten(tree, placer.place(parts))

    def spec(self, batch):
        """The per-replica element spec that ``batch`` would give (nothing is transferred)."""
        return _batch_spec(batch, lambda size: max(-(-size // self.n), self.rows or 0))


def batch_size(leaves):
    sizes = {a.shape[0] for a in leaves}
    if len(sizes) != 1:
        raise errors.InvalidArgumentError(
            f"the arrays of one batch must share their leading (batch) size, got {sorted(sizes)}.")
    return sizes.pop()


def unbatched_error(n):
    return errors.InvalidArgumentError(
        f"the dataset's elements are unbatched (rank-0 values) but the strategy has {n} replicas: "
        "each global batch is split along its first axis, so batch the dataset first, e.g. "
        "dataset.batch(global_batch_size).")


class PerReplicaDealer:
    """Deals up to ``N`` per-replica batches to the replicas in order (None, missing: empty)."""

    def __init__(self, placer, full_rows=None):
        self.placer = placer
        self.n = placer.n
        self.rows = full_rows

    def __call__(self, group):
        if isinstance(group, TrailingRound):
            return TrailingRound([self._element(list(group))])
        return self._element(list(group))

    def _element(self, group):
        group += [None] * (self.n - len(group))
        present = [b for b in group if b is not None]
        tree = jax.tree_util.tree_structure(present[0])
        other = next((t for t in map(jax.tree_util.tree_structure, present[1:]) if t != tree),
                     None)
        if other is not None:
            raise errors.InvalidArgumentError(
                "the per-replica datasets yielded batches of different structures: "
                f"{tree} and {other}.")
        template = jax.tree_util.tree_leaves(present[0])
        columns = [jax.tree_util.tree_leaves(b) if b is not None else None for b in group]
        scalar = is_unbatched(present[0])
        if not scalar:
            sizes = {batch_size(c) for c in columns if c is not None}
            self.rows = max(sizes | ({self.rows} if self.rows is not None else set()))
        placer, parts = self.placer, []
        for j, t in enumerate(template):
            chunks = [c[j] if c is not None else _empty_like(t) for c in columns]
            parts.append(placer.whole(chunks[0]) if placer.plain or self.n == 1
                         else placer.split(chunks, None if scalar else self.rows))
        return jax.tree_util.tree_unflatten(tree, placer.place(parts))

    def spec(self, batch):
        return _batch_spec(batch, lambda size: max(size, self.rows or 0))


def _batch_spec(batch, rows_of):
    """``batch``'s spec, a batched one's leading size ``rows_of(its size)``."""
    leaves, tree = jax.tree_util.tree_flatten(batch)
    rows = None if not leaves or is_unbatched(leaves) else rows_of(batch_size(leaves))
    return jax.tree_util.tree_unflatten(
        tree, [_struct(a.shape if rows is None else (rows,) + a.shape[1:], a.dtype)
               for a in leaves])


def is_unbatched(element):
    """Whether a host element (or its spec) holds rank-0 values: one example, not a batch."""
    return any(len(a.shape) == 0 for a in jax.tree_util.tree_leaves(element))


def makes_a_step(group, fixed_shapes=None):
    """Whether per-replica elements (None: that replica's data ended) make one more step. TF's
    rule: statically shaped elements (``fixed_shapes``; None: rank-0 elements are) only when
    every replica has one, as an empty batch would break their shape; others while any has."""
    present = [b for b in group if b is not None]
    if not present:
        return False
    if fixed_shapes is None:
        fixed_shapes = is_unbatched(present[0])
    return len(present) == len(group) or not fixed_shapes


class TrailingRound(list):
    """A statically shaped round in which some replica has no batch: a step for TF's
    ``get_next_as_optional`` only (`makes_a_step`). Dealt, it holds the one element it makes."""


def _empty_like(leaf):
    """TF's dummy for a replica without data: zeros, first dimension 0 (rank 0: one zero)."""
    return np.zeros(leaf.shape[:0] if leaf.ndim == 0 else (0,) + leaf.shape[1:], leaf.dtype)


def _struct(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), jax.dtypes.canonicalize_dtype(dtype))


def spec_of_element(element):
    """The per-replica spec of an element a distributed iterator produced."""
    def leaf_spec(x):
        if isinstance(x, PerReplica) and x.ragged:
            return _struct(x.values[0].shape, x.values[0].dtype)
        if isinstance(x, PerReplica):  # From the stacked array's shape: nothing is read.
            return _struct(x.stacked.shape[1:], x.stacked.dtype)
        dtype = getattr(x, "dtype", None)
        return _struct(np.shape(x), np.asarray(x).dtype if dtype is None else dtype)
    return jax.tree_util.tree_map(leaf_spec, element,
                                  is_leaf=lambda x: isinstance(x, DistributedValues))
