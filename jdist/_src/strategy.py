"""`Strategy`: the cross-replica API every strategy shares (what ``reduce``, ``gather``, ``run``
compute, and where they are allowed), and the default strategy. How values move between devices
is the concrete strategy's `StrategyExtended` (`jdist._src.mirrored`)."""

import collections.abc
from typing import Any, Callable, ContextManager, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jdist._src.base import Axis, PyTree, ReduceOpLike, input_wing, reduce_wing
from jdist._src import context, dispatch, errors
from jdist._src.host_values import check_host_numbers, check_placeable, python_numbers_as_tf
from jdist._src.reduce_op import ReduceOp, check_reducible
from jdist._src.strategy_extended import StrategyExtended
from jdist._src.values import (DistributedValues, Mirrored, PerReplica, check_replica_count,
                               is_distributed, is_python_number, local_results)


class Strategy:
    """A set of devices and how a computation is replicated over them (``tf.distribute.Strategy``).

    Use a concrete strategy (`MirroredStrategy`, `OneDeviceStrategy`), or `get_strategy`.
    """

    def __init__(self, extended: Any) -> None:
        self._extended = extended

    @property
    def extended(self) -> StrategyExtended:
        """The `StrategyExtended` with the lower-level API."""
        return self._extended

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas run in sync (values are aggregated over this many)."""
        return self._extended._num_replicas

    @property
    def cluster_resolver(self) -> Optional[Any]:
        """The cluster resolver of a multi-worker strategy; None for single-process strategies."""
        return None

    def scope(self) -> ContextManager[None]:
        """Returns a context manager that makes this strategy current (cross-replica context).

        >>> import jdist
        >>> with jdist.OneDeviceStrategy("cpu:0").scope():
        ...   print(jdist.in_cross_replica_context())
        True
        """
        return context.cross_replica_scope(self)

    def run(self, fn: Callable[..., PyTree], args: Sequence[Any] = (),
            kwargs: Optional[dict] = None, options: Optional[Any] = None) -> PyTree:
        """Runs ``fn`` on every replica and returns the per-replica results.

        ``fn`` (which may call `get_replica_context` for collectives) is compiled once per
        argument signature into one SPMD program over the replicas and sees per-replica shapes;
        `DistributedValues` arguments are unpacked per replica. ``options`` (TF's ``RunOptions``)
        is unused. Returns ``fn``'s output nest, with `Mirrored` leaves for values equal on every
        replica and `PerReplica` leaves otherwise; plain arrays on one replica.

        >>> import jax.numpy as jnp, jdist
        >>> s = jdist.MirroredStrategy(["cpu:0"])
        >>> float(s.run(lambda x: x * 2, args=(jnp.float32(3),)))
        6.0
        """
        if not callable(fn):
            raise errors.UnsupportedValueError(
                f"run() expects a function as fn, got {type(fn).__name__}: "
                "strategy.run(step, args=(...)).")
        if not isinstance(args, (tuple, list)):
            raise errors.InvalidArgumentError(
                f"run() expects args to be a tuple or list, got {type(args).__name__}; "
                "write args=(value,) for a single argument.")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise errors.InvalidArgumentError(f"run() expects kwargs to be a dict, got "
                                              f"{type(kwargs).__name__}.")
        context.require_run_allowed(self)
        return self._extended._run(fn, tuple(args), kwargs or {})

    experimental_run_v2 = run

    def reduce(self, reduce_op: ReduceOpLike, value: PyTree, axis: Axis = None) -> PyTree:
        """Reduces a per-replica value across replicas (and optionally along ``axis``).

        Args:
          reduce_op: ``ReduceOp.SUM`` / ``ReduceOp.MEAN`` or their names in any case.
          value: a `PerReplica` or `Mirrored` value, a nest of them (only with ``axis=None``),
            or a plain array.
          axis: None to combine replicas element-wise; an int or tuple of ints to reduce inside
            each replica along those axes first (MEAN divides by the total count, no padding).
        """
        context.require_cross_replica(self, "strategy.reduce")
        op = ReduceOp.from_any(reduce_op)
        if axis is not None and _is_number_list(value):  # TF sums it as one tensor.
            value = _number_list_as_tf(op, value)
        across = self.num_replicas_in_sync > 1 or axis is not None
        value = self._extended._as_worker_values(value)  # Across workers: each worker's value.
        for leaf in jax.tree_util.tree_leaves(value, is_leaf=is_distributed):
            distributed = is_distributed(leaf)
            check_reducible(op, leaf, adds=across if distributed else axis is not None,
                            places=distributed or axis is not None)
        self._extended._check_collective_dtypes(value, "strategy.reduce", reduces_one=True)
        if axis is not None and not _is_single_value(value):
            raise errors.UnsupportedValueError(
                "strategy.reduce with an axis takes a single value, not a nest; reduce each "
                "leaf separately, or use axis=None.")
        # None is a value here, as in TF: SUM refuses it, MEAN hands it back.
        return jax.tree_util.tree_map(lambda v: self._extended._reduce_value(op, v, axis), value,
                                      is_leaf=lambda v: v is None or is_distributed(v))

    def gather(self, value: PyTree, axis: int) -> PyTree:
        """Concatenates the replicas' values along ``axis`` (cross-replica context).

        Sizes along ``axis`` may differ between replicas; only real rows are returned. A plain
        array comes back unchanged.

        >>> import numpy as np, jdist
        >>> s = jdist.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> s.gather(jdist.PerReplica([np.float32([1.0]), np.float32([2.0, 3.0])]), 0).tolist()
        [1.0, 2.0, 3.0]
        """
        context.require_cross_replica(self, "strategy.gather")
        self._extended._check_gather(value, axis, "strategy.gather")
        return jax.tree_util.tree_map(lambda v: self._gather_value(v, axis), value,
                                      is_leaf=is_distributed)

    def _gather_value(self, value, axis):
        value = self._extended._as_worker_value(value)
        if isinstance(value, DistributedValues):
            check_replica_count(value, self.num_replicas_in_sync, "strategy.gather")
        if isinstance(value, Mirrored):
            value = PerReplica._from_stacked(
                jnp.broadcast_to(value.value, (self.num_replicas_in_sync,) + value.value.shape))
        if not isinstance(value, PerReplica):
            return value
        if value.num_replicas == 1 == self.num_replicas_in_sync:
            return value.values[0]  # TF's one value, handed back as a plain value is.
        value = self._extended._combinable(value)
        if value.ragged:
            return reduce_wing().ragged_gather(value.values, axis)
        if value.stacked.ndim == 1:
            raise errors.InvalidArgumentError(
                "gather needs per-replica values of rank >= 1 (got scalars); give each replica's "
                "value a leading axis first, e.g. x[None] in the replica function.")
        axis = reduce_wing().gather_axis(axis, value.stacked.ndim - 1)
        if isinstance(value.stacked, jax.core.Tracer):
            return reduce_wing().stacked_gather(value.stacked, axis)
        return self._extended._gather_per_replica(value, axis)

    def experimental_local_results(self, value: PyTree) -> tuple:
        """Returns the per-replica components of ``value`` held by this process, as a tuple.

        A nest gives one copy per local replica with each distributed leaf replaced by that
        replica's component; a plain value gives a 1-tuple.

        >>> import jdist
        >>> jdist.MirroredStrategy(["cpu:0", "cpu:1"]).experimental_local_results({"a": 1})
        ({'a': 1}, {'a': 1})
        """
        if isinstance(value, DistributedValues):
            return local_results(value)
        leaves, tree = jax.tree_util.tree_flatten(value, is_leaf=is_distributed)
        distributed = [x for x in leaves if isinstance(x, DistributedValues)]
        if not distributed and not isinstance(value, (tuple, list, collections.abc.Mapping)):
            return (value,)
        for x in distributed:
            check_replica_count(x, self.num_replicas_in_sync, "experimental_local_results")
        per_leaf = [local_results(x) if isinstance(x, DistributedValues) else None
                    for x in leaves]
        return tuple(
            jax.tree_util.tree_unflatten(tree, [x if r is None else r[i]
                                                for x, r in zip(leaves, per_leaf)])
            for i in range(len(self._extended._local_replica_ids())))

    def experimental_distribute_values_from_function(
            self, value_fn: Callable[["context.ValueContext"], PyTree]) -> PyTree:
        """Builds per-replica values by calling ``value_fn(ValueContext)`` once per replica.

        Shapes may differ between replicas. Returns the nest with `PerReplica` leaves (on one
        replica, the value itself, as in TF).

        Example:
          >>> import jdist
          >>> s = jdist.MirroredStrategy(["cpu:0", "cpu:1"])
          >>> v = s.experimental_distribute_values_from_function(
          ...     lambda ctx: ctx.replica_id_in_sync_group)
          >>> [int(x) for x in v.values]
          [0, 1]
        """
        n = self.num_replicas_in_sync
        per_replica = [value_fn(context.ValueContext(i, n))
                       for i in self._extended._local_replica_ids()]
        trees: list = [jax.tree_util.tree_structure(v) for v in per_replica]
        if any(t != trees[0] for t in trees[1:]):
            raise errors.InvalidArgumentError(
                "value_fn returned different structures for different replicas: "
                f"{trees[0]} vs {next(t for t in trees if t != trees[0])}.")
        for leaf in jax.tree_util.tree_leaves(per_replica):
            check_host_numbers(leaf)  # Before any transfer: JAX would wrap 64-bit integers.
        if n == 1:
            return jax.tree_util.tree_map(self._extended._one_replica_value, per_replica[0])
        if dispatch.under_a_staging_trace():
            raise errors.WrongContextError(
                "experimental_distribute_values_from_function was called while a function is "
                "traced (jax.jit, jdist.function, a replica or merge function); it places values "
                "on the devices, which a trace cannot. Call it outside and pass the values in.")
        columns = [list(c) for c in zip(*(jax.tree_util.tree_leaves(v) for v in per_replica))]
        for column in columns:
            check_placeable(column)
        leaves = [self._extended._distribute_components(  # Python numbers as TF types them.
            [python_numbers_as_tf(x) if is_python_number(x) else x for x in c]) for c in columns]
        return jax.tree_util.tree_unflatten(trees[0], leaves)

    def experimental_distribute_dataset(self, dataset: Any, options: Optional[Any] = None) -> Any:
        """Distributes a dataset of GLOBAL batches over the replicas.

        Each global batch of ``B`` rows is cut into consecutive chunks of ``ceil(B / N)`` rows,
        one per replica (trailing replicas get fewer or none), as TF does. ``dataset`` is a
        ``tf.data.Dataset``, a `NumpyDataset`, a re-iterable of batches, a function of no
        arguments returning a fresh iterable, or a one-shot iterator; ``options`` an
        `InputOptions`. Returns a `DistributedDataset`.

        Example:
          >>> import numpy as np, jdist
          >>> s = jdist.get_strategy()
          >>> [b.tolist() for b in s.experimental_distribute_dataset([np.arange(2), np.arange(1)])]
          [[0, 1], [0]]
        """
        context.require_not_mixed(self, "experimental_distribute_dataset")
        return input_wing().distribute_dataset(self, dataset, options)

    def distribute_datasets_from_function(self, dataset_fn: Callable[..., Any],
                                          options: Optional[Any] = None) -> Any:
        """Calls ``dataset_fn(InputContext)`` per input pipeline; deals its PER-REPLICA batches
        (replicas left without data at the end get empty batches)."""
        context.require_not_mixed(self, "distribute_datasets_from_function")
        return input_wing().distribute_datasets_from_function(self, dataset_fn, options)

    experimental_distribute_datasets_from_function = distribute_datasets_from_function

    def experimental_make_numpy_dataset(self, numpy_input: PyTree,
                                        session: Optional[Any] = None) -> Any:
        """An unbatched `NumpyDataset` of ``numpy_input``'s rows (``session``: TF1's, ignored)."""
        return input_wing().make_numpy_dataset(numpy_input)

    def __deepcopy__(self, memo):  # It owns devices and programs: copies share it, as in TF.
        return self

    def __repr__(self):
        return f"{type(self).__name__}(devices={list(self._extended._device_names)})"


class _DefaultStrategy(Strategy):
    """The strategy in effect when none is set: one replica, ``run`` calls ``fn`` directly."""

    def __init__(self):
        super().__init__(StrategyExtended(self, jax.local_devices()[:1]))

    def __repr__(self):
        return "DefaultStrategy()"


context.register_default_strategy_factory(_DefaultStrategy)


def _is_single_value(value):
    return isinstance(value, (DistributedValues, jax.Array, np.ndarray, np.generic, int, float))


def _number_list_as_tf(op, numbers):
    if op is ReduceOp.MEAN:  # TF reads the list's shape, which a list has not.
        raise errors.UnsupportedValueError(
            f"ReduceOp.MEAN along an axis of a {type(numbers).__name__} of numbers: TF raises "
            "here (AttributeError: it reads the value's shape). Pass an array instead, e.g. "
            "np.float32(numbers).")
    return python_numbers_as_tf(numbers)


def _is_number_list(value) -> bool:  # TF makes one tensor of it.
    return isinstance(value, (list, tuple)) and all(
        isinstance(leaf, (bool, int, float)) for leaf in jax.tree_util.tree_leaves(value))
