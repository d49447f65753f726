"""Distributed input: datasets split across replicas as tf.distribute splits them, fed ahead.

``experimental_distribute_dataset`` splits global batches (`_GlobalPlan`);
``distribute_datasets_from_function`` deals per-replica batches (`_DealtPlan`). Both hand out
`PerReplica` elements through a `DistributedIterator` that ends as TF's do. Batches are prepared
ahead on a thread (`prefetch`), except a numpy dataset's full batches on CPU devices, placed in
blocks by the loop's own thread (`blocks`; ``docs/design.md``, "Batch blocks").
"""

import itertools
import math
from typing import Any
import weakref

import jax
import numpy as np

from jdist._src.input import auto_shard
from jdist._src.input import blocks as batch_blocks
from jdist._src import context
from jdist._src import dispatch
from jdist._src import errors
from jdist._src.input import batches as input_batches
from jdist._src.input import steps as input_steps
from jdist._src.input import iterator_state
from jdist._src.input.options import InputContext, InputOptions, InputReplicationMode
from jdist._src.input import prefetch
from jdist._src.reduce import replica_mesh
from jdist._src.input.numpy_dataset import INFINITE, UNKNOWN, NumpyDataset


_EMPTY = object()


class Optional:
    """A value that may be absent (``tf.experimental.Optional``), as `get_next_as_optional` gives.

    Example:
      >>> Optional.from_value(3).get_value(), Optional.empty(None).has_value()
      (3, False)
    """

    def __init__(self, value: Any = _EMPTY, element_spec: Any = None):
        self._value = value
        self._element_spec = element_spec

    @staticmethod
    def from_value(value: Any) -> "Optional":
        """An optional holding ``value``."""
        return Optional(value, input_batches.spec_of_element(value)
                        if jax.tree_util.tree_leaves(value) else None)

    @staticmethod
    def empty(element_spec: Any) -> "Optional":
        """An empty optional whose value would have had ``element_spec``."""
        return Optional(_EMPTY, element_spec)

    def has_value(self) -> bool:
        """Whether a value is present (a Python bool)."""
        return self._value is not _EMPTY

    def get_value(self) -> Any:
        """The value. Raises `InvalidArgumentError` when the optional is empty."""
        if self._value is _EMPTY:
            raise errors.InvalidArgumentError(
                "The Optional has no value: the iterator reached the end of its data. Check "
                "has_value() before calling get_value().")
        return self._value

    @property
    def element_spec(self) -> Any:
        """The spec of the value (a nest of ``jax.ShapeDtypeStruct``), if known."""
        return self._element_spec

    def __repr__(self):
        return f"Optional(has_value={self.has_value()})"


def _check_not_in_replica(what):
    if context.in_replica_function():
        raise errors.InvalidArgumentError(
            f"{what} was called inside a replica function (strategy.run). Take the batch in the "
            "outer loop and pass it in: strategy.run(step, args=(next(iterator),)).")


class _GlobalPlan:
    """Elements from global batches (``experimental_distribute_dataset``)."""

    def __init__(self, strategy, source, options, order=None):
        self.source = source
        self.placer = _placer(strategy, options)
        self.full_rows = source.static_rows()
        self.order = order  # Replica i's chunk of each batch (`auto_shard.chunk_order`).
        self.blocks = _block_feed(strategy, source, self.placer)
        # A numpy dataset on CPU devices is placed by the loop's own thread (in blocks on one
        # process, this worker's rows batch by batch across workers): a helper thread would
        # take a core the devices' collectives wait on (`docs/design.md`, "Who places a block").
        self.on_loop_thread = isinstance(source.dataset, NumpyDataset) and (
            batch_blocks.on_host_cores(strategy.extended.mesh))

    def open(self):
        splitter = input_batches.GlobalBatchSplitter(self.placer, self.full_rows, self.order)
        if self.blocks is not None:
            arrays, blocks, placements = self.source.open_blocks(self.blocks.size)
            return self.blocks(arrays, blocks, splitter, placements), _unchanged, None
        return self.source.open(), splitter, None

    def spec(self):
        first = self.source.first()
        return None if first is None else input_batches.GlobalBatchSplitter(
            self.placer, self.full_rows).spec(first)

    def cardinality(self):
        return self.source.cardinality()


class _DealtPlan:
    """Elements from per-replica batches (``distribute_datasets_from_function``)."""

    on_loop_thread = False  # Per-replica batches: one placement each, by the prefetch thread.

    def __init__(self, strategy, options, sources, per_replica, counted=None):
        self.extended = strategy.extended
        self.sources = sources
        self.counted = counted or sources[0]  # The source whose batches `cardinality` counts.
        self.per_replica = per_replica  # PER_REPLICA mode: one source per replica.
        self.n = strategy.num_replicas_in_sync
        self.workers = strategy.extended._input_pipeline()[0]
        self.placer = _placer(strategy, options)
        rows = {s.static_rows() for s in sources}
        self.full_rows = rows.pop() if len(rows) == 1 else None
        # TF ends statically shaped data at the last whole round of replicas (`makes_a_step`).
        declared = {s.fixed_shapes() for s in sources}
        self.fixed_shapes = declared.pop() if len(declared) == 1 else None

    def open(self):
        """``(source, transform, finish)``: ``finish`` (or None) runs on the consumer's thread."""
        dealer = input_batches.PerReplicaDealer(self.placer, self.full_rows)
        if self.per_replica:
            return (_zip_longest([s.open() for s in self.sources], self.fixed_shapes), dealer,
                    None)
        if self.workers > 1:  # Each worker's own pipeline, kept in step (multi_worker_input).
            return self.extended._per_worker_feed(self.sources[0], dealer)
        return _deal(self.sources[0].open(), self.n, self.fixed_shapes), dealer, None

    def spec(self):
        first = self.sources[0].first()
        return None if first is None else input_batches.PerReplicaDealer(
            self.placer, self.full_rows).spec(first)

    def cardinality(self):
        # TF's ``_cardinality(self._datasets[0])``: in per-replica batches, not steps.
        return self.counted.cardinality()


def _deal(batches, n, fixed_shapes):
    """Rounds (`_round`) of ``n`` consecutive per-replica batches."""
    try:
        while True:
            group: list = []
            for batch in batches:
                group.append(batch)
                if len(group) == n:
                    break
            group += [None] * (n - len(group))
            round_ = _round(group, fixed_shapes)
            if round_ is None:
                return
            yield round_
            if group[-1] is None:
                return
    finally:
        batches.close()


def _zip_longest(iterators, fixed_shapes):
    """One batch from each replica's iterator per step (None once it has ended)."""
    alive = list(iterators)
    try:
        while True:
            group = []
            for i, it in enumerate(alive):
                batch = None
                if it is not None:
                    batch = next(it, None)
                    if batch is None:
                        alive[i] = None
                group.append(batch)
            round_ = _round(group, fixed_shapes)
            if round_ is None:
                return
            yield round_
    finally:
        for it in iterators:
            it.close()


def _round(group, fixed_shapes):
    """``group`` if it makes a step, a `input_batches.TrailingRound` if only TF's
    ``get_next_as_optional`` takes it, None once no replica has data."""
    if input_batches.makes_a_step(group, fixed_shapes):
        return group
    if any(b is not None for b in group):
        return input_batches.TrailingRound(group)
    return None


class DistributedDataset:
    """A dataset whose elements are per-replica batches (``tf.distribute.DistributedDataset``).

    Each iteration starts a `DistributedIterator` from the start of the data (a one-shot
    source can be read once). Elements keep the input's nest, a `PerReplica` at each leaf
    (on one replica, a plain array for full batches).
    """

    INFINITE_CARDINALITY = INFINITE
    UNKNOWN_CARDINALITY = UNKNOWN

    def __init__(self, strategy: Any, plan: Any, options: Any) -> None:
        self._strategy, self._plan, self._options = strategy, plan, options
        self._spec, self._spec_known = None, False

    def __iter__(self) -> "DistributedIterator":
        _check_not_in_replica("iter(distributed_dataset)")
        if dispatch.under_a_staging_trace():
            raise errors.InvalidArgumentError(
                "a distributed dataset was iterated while jdist.function or jax.jit traced a "
                "function: its batches would be compiled into the program as constants, so "
                "every call would reuse this epoch's batches (TF's traced loop reads the "
                "dataset anew per call, reshuffled). Iterate outside and pass the batches in: "
                "for x in dataset: w = train_step(w, x).")
        return DistributedIterator(self)

    def _iterator_at(self, position: iterator_state.Position) -> "DistributedIterator":
        """An iterator counting handed-out batches from ``position`` (a restored one's)."""
        return DistributedIterator(self, position)

    @property
    def element_spec(self) -> Any:
        """A nest of ``jax.ShapeDtypeStruct``: what ONE replica receives per element (the full
        per-replica batch size); None without elements. May read the first batch."""
        if not self._spec_known:
            spec = self._plan.spec()
            if spec is not None:
                self._spec, self._spec_known = spec, True
        return self._spec

    def _record_spec(self, element):
        if not self._spec_known:
            self._spec, self._spec_known = input_batches.spec_of_element(element), True

    @property
    def cardinality(self) -> int:
        """TF 2.21's ``cardinality``: an int, ``INFINITE_CARDINALITY`` (-1) or
        ``UNKNOWN_CARDINALITY`` (-2). From ``distribute_datasets_from_function``, TF's count of
        the first dataset, in per-replica batches (five batches on two replicas: 5).

        Example:
          >>> import numpy as np, jdist
          >>> s = jdist.get_strategy()
          >>> s.experimental_distribute_dataset(s.experimental_make_numpy_dataset(
          ...     np.arange(5)).batch(2)).cardinality
          3
        """
        return self._plan.cardinality()

    @property
    def options(self) -> InputOptions:
        """The `InputOptions` the dataset was created with."""
        return self._options

    def reduce(self, initial_state: Any, reduce_func: Any) -> Any:
        """Folds the elements: ``state = reduce_func(state, element)`` over one pass."""
        state = initial_state
        for element in self:
            state = reduce_func(state, element)
        return state

    def __repr__(self):
        return f"DistributedDataset(strategy={self._strategy!r})"


class _SyncFeed:
    """The feeder without a thread (buffer size 0): prepares each element when asked."""

    def __init__(self, source, transform):
        self._source, self._transform = source, transform

    def get(self):
        item = prefetch.END if self._source is None else next(self._source, prefetch.END)
        return item if item is prefetch.END else self._transform(item)

    def close(self):
        source, self._source = self._source, None
        if source is not None:
            source.close()


def _close_source(source):
    source.close()


class DistributedIterator:
    """An iterator over a `DistributedDataset` (``tf.distribute.DistributedIterator``).

    At the end ``next`` raises ``StopIteration``, `get_next` `OutOfRangeError`, and
    `get_next_as_optional` returns an empty `Optional`. Its prefetch thread stops at the end of
    the data, on `close`, and when the iterator is garbage collected.
    """

    def __init__(self, dataset: Any, position: Any = None) -> None:
        self._dataset = dataset
        # Counted as elements are handed out: what a checkpoint saves (`iterator_state`).
        self._position = iterator_state.Position(dataset) if position is None else position
        self._finished = False
        self._ready: Any = None  # A block's later elements, in order.
        self._no_optional = None  # Worked out at the first get_next_as_optional.
        # ``_step``: a multi-worker dataset's consumer-side step (`_DealtPlan.open`).
        source, transform, self._step = dataset._plan.open()
        size = dataset._options.experimental_per_replica_buffer_size
        if size == 0 or dataset._plan.on_loop_thread:
            self._feed: Any = _SyncFeed(source, transform)
        else:
            self._feed = prefetch.Prefetcher(source, transform, size, on_close=_close_source)
        self._finalizer = weakref.finalize(self, self._feed.close)

    def __iter__(self) -> "DistributedIterator":
        return self

    def __next__(self) -> Any:
        return self._next(trailing=False)

    def _next(self, trailing):
        """The next element; ``trailing``: whether a `input_batches.TrailingRound` counts."""
        _check_not_in_replica("next(iterator)")
        if dispatch.under_a_staging_trace():
            raise errors.InvalidArgumentError(
                "next(iterator) was called while jdist.function or jax.jit traced a function, "
                "on an iterator made outside it: the element would be compiled into the program "
                "as a constant, so every call would reuse that batch (TF's traced iterator "
                "fetches a new one per call). Take the batches outside and pass them in: "
                "train(w, next(iterator)), or train(w, [next(iterator) for _ in range(k)]) "
                "for k steps per call.")
        if self._ready is not None:  # A block's later elements: the step's path, kept short.
            try:
                element = next(self._ready, None)
            except BaseException:
                self._finish()
                raise
            if element is not None:
                self._position.advance()
                return element
            self._ready = None
        if self._finished:
            raise StopIteration
        try:
            element = self._feed.get()
            if isinstance(element, batch_blocks.Elements):
                self._ready = iter(element.items)
                element = next(self._ready)
            if self._step is not None and element is not prefetch.END:
                element = self._step(element)
        except BaseException:
            self._finish()
            raise
        if isinstance(element, input_batches.TrailingRound):
            if trailing:
                return element[0]
            element = prefetch.END
        if element is prefetch.END:
            self._finish()
            raise StopIteration
        self._dataset._record_spec(element)
        self._position.advance()
        return element

    def _finish(self):
        self._finished = True
        self._ready = None
        self._finalizer()  # Stops and joins the worker (at most once).

    def get_next(self) -> Any:
        """The next element. Raises `OutOfRangeError` once the data has ended."""
        try:
            return self.__next__()
        except StopIteration:
            raise errors.OutOfRangeError("End of sequence: the distributed iterator has no more "
                                         "elements.") from None

    def get_next_steps(self, num_steps: int) -> Any:
        """The next ``num_steps`` elements as one, each replica's batches stacked on a leading
        step axis, for a ``lax.scan`` inside the replica function (TF's steps per execution).

        Per-replica values are ``(k, batch, ...)``, ``k <= num_steps``: a group holds batches of
        one shape, so the last partial batch comes alone (``docs/quickstart.md``, steps per
        execution). Raises `OutOfRangeError` where no element is left.

        Example:
          >>> import jax, numpy as np, jdist
          >>> from jax import lax
          >>> s = jdist.MirroredStrategy(jax.devices()[:2])
          >>> it = iter(s.experimental_distribute_dataset(
          ...     s.experimental_make_numpy_dataset(np.arange(12.0, dtype=np.float32)).batch(4)))
          >>> xs = it.get_next_steps(3)  # Each replica: (3, 2).
          >>> total = s.run(lambda xs: lax.scan(lambda c, x: (c + x.sum(), None), 0.0, xs)[0],
          ...               args=(xs,))
          >>> float(s.reduce("sum", total, axis=None))
          66.0
        """
        if num_steps < 1:
            raise errors.InvalidArgumentError(f"get_next_steps needs num_steps >= 1, got "
                                              f"{num_steps}.")
        group: list = []
        for element in self:
            if group and input_steps.signature(element) != input_steps.signature(group[0]):
                self._ready = itertools.chain([element], self._ready or ())  # Next group's.
                self._position.advance(-1)
                break
            group.append(element)
            if len(group) == num_steps:
                break
        if not group:
            raise errors.OutOfRangeError("End of sequence: the distributed iterator has no more "
                                         "elements.")
        return input_steps.stack_steps(group)

    def get_next_as_optional(self) -> Optional:
        """An `Optional` with the next element, or an empty one once the data has ended.

        As in TF it also hands over statically shaped rounds where only some replicas have
        data (the others get TF's dummies, first dimension 0), and on one worker it is empty
        from the start where `DistributedDataset.cardinality` is 0."""
        if self._no_optional is None:
            self._no_optional = (self._dataset._strategy.extended._input_pipeline()[0] == 1
                                 and self._dataset.cardinality == 0)
        if self._no_optional:
            return Optional.empty(self._dataset._spec)
        try:
            return Optional.from_value(self._next(trailing=True))
        except StopIteration:
            return Optional.empty(self._dataset._spec)

    @property
    def element_spec(self) -> Any:
        """The spec of one replica's value per element (see `DistributedDataset.element_spec`)."""
        return self._dataset.element_spec

    def close(self) -> None:
        """Stops the background feeding and releases the source; the iterator is then at its end."""
        self._finish()

    def __repr__(self):
        return f"DistributedIterator(finished={self._finished})"


def distribute_dataset(strategy, dataset, options=None):
    """Implements `Strategy.experimental_distribute_dataset`."""
    options = _options(options)
    if options.experimental_replication_mode is InputReplicationMode.PER_REPLICA:
        raise errors.InvalidArgumentError(
            "InputReplicationMode.PER_REPLICA is only supported in "
            "`distribute_datasets_from_function`; use it, or the default PER_WORKER mode here.")
    if options.experimental_place_dataset_on_device:
        raise errors.InvalidArgumentError(
            "`experimental_place_dataset_on_device` is only supported in "
            "`distribute_datasets_from_function` with PER_REPLICA mode; unset it here.")
    if isinstance(dataset, DistributedDataset):
        raise errors.InvalidArgumentError("the dataset is already distributed.")
    source = input_batches.Source(dataset, "experimental_distribute_dataset")
    n = strategy.num_replicas_in_sync
    if n > 1 and strategy.extended.mesh is not None and source.is_unbatched():
        raise input_batches.unbatched_error(n)
    share = auto_shard.worker_share(source, options.auto_shard_policy, strategy.extended)
    if share.pipeline is None:  # Every worker splits the same global batches.
        return DistributedDataset(strategy, _GlobalPlan(strategy, source, options, share.order),
                                  options)
    # This worker's own pipeline, dealt as PER_WORKER ones are, counted in the given batches.
    plan = _DealtPlan(strategy, options, [share.pipeline], per_replica=False, counted=source)
    return DistributedDataset(strategy, plan, options)


def distribute_datasets_from_function(strategy, dataset_fn, options=None):
    """Implements `Strategy.distribute_datasets_from_function`."""
    options = _options(options)
    if not callable(dataset_fn):
        raise errors.UnsupportedValueError(
            f"dataset_fn must be a function of an InputContext, got {type(dataset_fn).__name__}.")
    mode = options.experimental_replication_mode
    if options.experimental_place_dataset_on_device and (
            mode is not InputReplicationMode.PER_REPLICA):
        raise errors.InvalidArgumentError(
            "When `experimental_place_dataset_on_device` is set for dataset placement, you must "
            "also specify `PER_REPLICA` for the replication mode.")
    if (options.experimental_place_dataset_on_device and options.experimental_fetch_to_device
            and mode is InputReplicationMode.PER_REPLICA):
        raise errors.InvalidArgumentError(
            "`experimental_place_dataset_on_device` can not be set to True when "
            "experimental_fetch_to_device is True and replication mode is set to `PER_REPLICA`.")
    n = strategy.num_replicas_in_sync
    what = "distribute_datasets_from_function"
    if mode is InputReplicationMode.PER_REPLICA:
        contexts = [InputContext(n, i, n) for i in range(n)]
    else:
        contexts = [InputContext(*strategy.extended._input_pipeline(), n)]
    sources = [input_batches.Source(dataset_fn(ctx), what) for ctx in contexts]
    plan = _DealtPlan(strategy, options, sources, mode is InputReplicationMode.PER_REPLICA)
    return DistributedDataset(strategy, plan, options)


def make_numpy_dataset(numpy_input):
    """Implements `Strategy.experimental_make_numpy_dataset`: the rows of ``numpy_input``."""
    return NumpyDataset(numpy_input)


def _placer(strategy, options):
    """The strategy's `input_batches.Placer` (a multi-worker strategy places only its rows)."""
    placer = strategy.extended._input_placer(strategy, options)
    if placer is None:
        return input_batches.Placer(strategy, options.experimental_fetch_to_device)
    return placer


def _block_feed(strategy, source, placer):
    """A `batch_blocks.BlockFeed` for a batched `NumpyDataset` placed whole on this process's
    devices, its full batches split evenly, two or more to a block; else None."""
    rows, n = source.static_rows(), placer.n
    if (not isinstance(source.dataset, NumpyDataset) or rows is None or rows % n
            or placer.plain or not placer.fetch or not placer.whole_batches_here):
        return None
    spec = jax.tree_util.tree_leaves(source.first())
    size = batch_blocks.block_size(sum(math.prod(s.shape) * np.dtype(s.dtype).itemsize
                                       for s in spec))
    # No bigger than a pass's full batches: bigger would be a padded copy made every epoch.
    in_order = source.dataset.full_batches_in_order()
    size = min(size, in_order or size)
    if size < 2:
        return None
    extended = strategy.extended
    return batch_blocks.BlockFeed(extended.mesh, extended.replica_axis, rows, size,
                                  replica_mesh.guard_for(tuple(extended.mesh.devices.flat)),
                                  in_order)


def _unchanged(element):
    return element


def _options(options):
    if options is None:
        return InputOptions()
    if not isinstance(options, InputOptions):
        raise errors.UnsupportedValueError(
            f"options must be a jdist.InputOptions, got {type(options).__name__}.")
    return options
