"""`StrategyExtended`: the lower-level API every strategy shares (``strategy.extended``).

``reduce_to`` / ``batch_reduce_to`` / ``broadcast_to`` resolve their destinations once, at the
API boundary, into a `Target` and hand values and targets to the strategy's `CrossDeviceOps`,
which never calls back; the default strategy has none and reduces and places values itself.
This class is also the default (one-replica, eager) strategy's; subclasses
(`jdist._src.mirrored`, `jdist._src.multi_worker.strategy`) override the underscored hooks.
"""

from typing import Any, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jdist._src import context, errors
from jdist._src import devices as devices_lib
from jdist._src.base import (Axis, Destinations, PyTree, ReduceOpLike, ReplicaCollectives, Target,
                             reduce_wing)
from jdist._src.reduce_op import ReduceOp, check_reducible
from jdist._src.values import (DistributedValues, SCALARS, Mirrored, PerReplica,
                               check_replica_count, is_distributed, is_python_number,
                               is_step_output, local_results)
from jdist._src.host_values import check_placeable


# The dtypes TF's collective all-reduce and all-gather ops take (their "T" attribute).
_COLLECTIVE_REDUCE_DTYPES = frozenset(np.dtype(d) for d in (
    jnp.bfloat16, np.float16, np.float32, np.float64, np.int32, np.int64))
_COLLECTIVE_GATHER_DTYPES = _COLLECTIVE_REDUCE_DTYPES - {np.dtype(jnp.bfloat16)}


class StrategyExtended:
    """Lower-level strategy API (``strategy.extended``): devices, reduce_to, broadcast_to.

    Args:
      container_strategy: the `Strategy` this object extends.
      devices: the jax devices of the replicas, one per replica, in replica order.
    """

    _cross_device_ops: Optional[Any] = None  # A `CrossDeviceOps`; None: combined here.
    # TF's default CollectiveAllReduce is in use (several devices, no ops given).
    _tf_collective_ops: bool = False
    _ops_per_value: bool = False  # TF picks cross-device ops value by value (MirroredStrategy).
    # One replica's value-function values are `PerReplica`s of one (TF's MirroredStrategy).
    _one_replica_values_wrapped: bool = False
    #: The ``jax.sharding.Mesh`` of the replicas; None for the default strategy (no mesh).
    mesh: Optional[jax.sharding.Mesh] = None
    #: Whether this process writes checkpoints / summaries (a multi-worker chief only).
    should_checkpoint: bool = True
    should_save_summary: bool = True
    #: Every worker initialises its own copy, as in TF.
    experimental_should_init: bool = True
    should_init: bool = True
    #: Whether every worker runs its own copy of the program (several workers).
    experimental_between_graph: bool = False

    def __init__(self, container_strategy: Any, devices: Sequence[jax.Device]) -> None:
        self._container_strategy_ref = container_strategy
        self._devices = tuple(devices)
        self._device_names = tuple(devices_lib.name(d) for d in self._devices)
        self._mirrored_target = Target(len(self._devices), True, self._devices, None)

    @property
    def replica_devices(self) -> Tuple[jax.Device, ...]:
        """Every replica's device, in replica order, on every worker (jdist's; not TF's)."""
        return self._devices

    @property
    def worker_devices(self) -> Tuple[jax.Device, ...]:
        """The devices of this worker's replicas, as in TF."""
        return tuple(self._devices[i] for i in self._local_replica_ids())

    @property
    def parameter_devices(self) -> Tuple[jax.Device, ...]:
        """The devices that hold this worker's copies of mirrored values: `worker_devices`."""
        return self.worker_devices

    @property
    def device_names(self) -> Tuple[str, ...]:
        """The TF-style names of `replica_devices` (``"/cpu:0"``)."""
        return self._device_names

    @property
    def experimental_require_static_shapes(self) -> bool:
        """True: XLA compiles one program per shape, so per-replica shapes must be static."""
        return True

    @property
    def _num_replicas(self):
        return len(self._devices)

    def _local_replica_ids(self) -> Sequence[int]:
        """The replicas whose devices this process holds (all of them on one worker)."""
        return range(self._num_replicas)

    def _input_pipeline(self) -> Tuple[int, int]:
        """``(num_input_pipelines, input_pipeline_id)`` of this process: one pipeline here."""
        return (1, 0)

    def _input_placer(self, strategy: Any, options: Any) -> Optional[Any]:
        """The `input_batches.Placer` for this strategy's datasets; None: the default one."""
        del strategy, options
        return None

    def _replica_collectives(self, binding: Optional[Any]) -> ReplicaCollectives:
        """The collectives a `ReplicaContext` calls; ``binding`` is None outside a traced replica
        function, where there is one replica (several are an error)."""
        return _OneReplica(self._container_strategy_ref, self._num_replicas)

    def _run(self, fn, args, kwargs):
        args, kwargs = jax.tree_util.tree_map(lambda v: local_results(v)[0], (args, kwargs),
                                              is_leaf=is_distributed)
        with context.ReplicaContext(self._container_strategy_ref, 0):
            return fn(*args, **kwargs)

    def _reduce_per_replica(self, op, value, axes):
        stacked, lengths = reduce_wing().strip_padding(jnp.asarray(value.stacked), value._lengths,
                                                     axes, "reduce")
        valid = None if lengths is None else jnp.asarray(lengths)
        return reduce_wing().stacked_reduce(op, stacked, axes, valid)

    def _as_worker_value(self, value: Any) -> Any:
        """A plain value to reduce or gather, as TF takes it: here as it is (across workers, this
        worker's replica value)."""
        return value

    def _as_worker_values(self, value: PyTree) -> PyTree:
        """`_as_worker_value` of each leaf of the nest ``value`` (one worker: no walk)."""
        return value

    def _check_collective_dtypes(self, value: PyTree, what: str, gathers: bool = False,
                                reduces_one: bool = False) -> None:
        """Raises where TF hands a value to its ``CollectiveAllReduce`` (`_by_collective_ops`),
        whose ops take only the dtypes of `_COLLECTIVE_REDUCE_DTYPES` / `_GATHER_`.
        ``reduces_one``: ``reduce`` / ``reduce_to`` of one value (not those ops on CPUs)."""
        allowed = _COLLECTIVE_GATHER_DTYPES if gathers else _COLLECTIVE_REDUCE_DTYPES
        for leaf in jax.tree_util.tree_leaves(value):
            dtype = getattr(leaf, "dtype", None)  # A set lookup first: reduce runs every step.
            if (dtype is None or dtype in allowed or isinstance(leaf, SCALARS)
                    or jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)  # Not TF's: no rule.
                    or not self._by_collective_ops(np.dtype(dtype), reduces_one)):
                continue
            names = ", ".join(sorted(str(d) for d in allowed))
            verb = "gathers" if gathers else "reduces"
            raise errors.InvalidArgumentError(
                f"{what} of a {np.dtype(dtype)} value: TensorFlow {verb} it here with its "
                f"collective ops (CollectiveAllReduce), which take {names} "
                "values only and raise on others. Cast it first (x.astype(jnp.float32) or "
                "jnp.int32); a MirroredStrategy given cross_device_ops=jdist.ReductionToOneDevice()"
                " takes every dtype, as in TF.")

    def _check_gather(self, value: PyTree, axis: int, what: str) -> None:
        """Raises where TF's own gather of ``value`` fails: a dtype its collective ops refuse, or
        a negative ``axis`` (``CollectiveAllReduce`` moves it first with ``range(axis)``)."""
        self._check_collective_dtypes(value, what, gathers=True)
        if not _negative(axis):
            return
        for leaf in jax.tree_util.tree_leaves(value, is_leaf=is_distributed):
            one = leaf.values[0] if is_distributed(leaf) else leaf  # One replica's value.
            if not hasattr(one, "dtype"):
                continue
            if self._by_collective_ops(np.dtype(one.dtype)):
                raise errors.InvalidArgumentError(
                    f"{what}(axis={axis}): TensorFlow gathers this value with its collective "
                    "ops (CollectiveAllReduce), which raise on a negative axis. Count it from "
                    f"the front: axis={axis % max(np.ndim(one), 1)} for this rank-{np.ndim(one)} "
                    "value.")

    def _check_batch_reduce(self, values: Sequence, what: str) -> None:
        """Raises where TF's ``batch_reduce_to`` (or ``all_reduce`` of a nest) refuses a batch:
        ``MirroredStrategy`` reduces an int32 value with ops of its own, so a batch of two or
        more values with an int32 one among them fails (`_ops_per_value`)."""
        if not self._ops_per_value:
            return
        ones = [x for x in jax.tree_util.tree_leaves(values) if not isinstance(x, SCALARS)]
        if len(ones) < 2 or not any(np.dtype(x.dtype) == np.int32 for x in ones):
            return
        raise errors.InvalidArgumentError(
            f"{what} of {len(ones)} values, some int32: TensorFlow's MirroredStrategy reduces an "
            "int32 value with a ReductionToOneDevice of its own and refuses the batch (\"Inputs "
            "to batch_reduce_to must be either all on the host or all on the compute devices\"). "
            "Reduce each int32 value in a call of its own, or cast it to float32.")

    def _by_collective_ops(self, dtype: np.dtype, reduces_one: bool = False) -> bool:
        """Whether TF reduces or gathers a value of ``dtype`` with ``CollectiveAllReduce``: not
        with one device (the default strategy, `OneDeviceStrategy`)."""
        return False

    def _gather_per_replica(self, value, axis):
        return jnp.concatenate(value.values, axis=axis)

    def _distribute_components(self, components):
        return PerReplica._from_stacked(np.stack([np.asarray(c) for c in components]))

    def _place_one_replica_value(self, value):
        """A one-replica value-function value where `run` takes it (here: no devices, as it is)."""
        return value

    def _one_replica_value(self, host):
        """A one-replica value-function value as TF holds it: a `PerReplica` of one
        (`_one_replica_values_wrapped`), else the value placed where `run` takes it."""
        if self._one_replica_values_wrapped:
            check_placeable([host])
            return self._distribute_components([host])
        if is_python_number(host):
            return host
        return self._place_one_replica_value(host)

    def _combinable(self, value: PerReplica) -> PerReplica:
        """``value`` as ``reduce`` and ``gather`` combine it (multi-worker pads ragged ones)."""
        return value

    def reduce_to(self, reduce_op: ReduceOpLike, value: Any, destinations: Destinations,
                  options: Optional[Any] = None) -> Any:
        """Reduces ``value`` across replicas and places the result on ``destinations``.

        Args:
          reduce_op: a `ReduceOp` or its name.
          value: a `DistributedValues` or an array (an array counts as a one-replica value).
          destinations: a `DistributedValues` (the result is `Mirrored` on the strategy's
            devices), a device (name or ``jax.Device``) or a ``jax.Array`` (its devices).
          options: a `CommunicationOptions` for the strategy's cross-device ops, or None.

        Returns:
          A `Mirrored` value or an array, as ``destinations`` says (as in TF, a MEAN of a
          `Mirrored` or non-distributed value is that value as it is).

        Example:
          >>> import jax, numpy as np, jdist
          >>> s = jdist.MirroredStrategy(jax.devices()[:2])
          >>> v = jdist.PerReplica([np.float32(1), np.float32(2)])
          >>> float(s.extended.reduce_to("sum", v, "cpu:1"))
          3.0
          >>> s.extended.reduce_to("mean", 0.1, "cpu:1")  # TF's one value, as it is.
          0.1
        """
        context.require_cross_replica(self._container_strategy_ref, "extended.reduce_to")
        op = ReduceOp.from_any(reduce_op)
        value = self._as_worker_value(value)
        if not is_distributed(value):  # Before the destinations are read, as in TF.
            return reduce_plain(op, value, self._num_replicas)
        check_reducible(op, value, adds=self._num_replicas > 1)
        self._check_collective_dtypes(value, "extended.reduce_to", reduces_one=True)
        if isinstance(value, Mirrored) and not is_step_output(value) and op is ReduceOp.MEAN:
            return value
        return self._reduce_to(op, value, self._target(destinations), options)

    def batch_reduce_to(self, reduce_op: ReduceOpLike, value_destination_pairs: Sequence[tuple],
                        options: Optional[Any] = None) -> List[Any]:
        """`reduce_to` for a sequence of ``(value, destinations)`` pairs; returns a list.

        The values are reduced as one batch by the strategy's cross-device ops. With the default
        ops on several replicas every result is `Mirrored` on all replica devices, as in TF.

        Args:
          reduce_op: a `ReduceOp` or its name.
          value_destination_pairs: a non-empty sequence of ``(value, destinations)`` tuples.
          options: a `CommunicationOptions`, or None.

        Returns:
          A list with one result per pair.

        Example:
          >>> import jax, numpy as np, jdist
          >>> s = jdist.MirroredStrategy(jax.devices()[:2])
          >>> v = jdist.PerReplica([np.float32(1), np.float32(2)])
          >>> _, on_device = s.extended.batch_reduce_to("mean", [(v, v), (v, "cpu:0")])
          >>> [float(x) for x in s.experimental_local_results(on_device)]
          [1.5, 1.5]
        """
        context.require_cross_replica(self._container_strategy_ref, "extended.batch_reduce_to")
        op = ReduceOp.from_any(reduce_op)
        pairs = reduce_wing().check_pairs(value_destination_pairs)
        reduce_wing().as_options(options)  # Checked on one replica too, which reduces nothing.
        pairs = [(self._as_worker_value(value), d) for value, d in pairs]
        check_reducible(op, [value for value, _ in pairs], adds=self._num_replicas > 1)
        self._check_collective_dtypes([value for value, _ in pairs], "extended.batch_reduce_to")
        self._check_batch_reduce([value for value, _ in pairs], "extended.batch_reduce_to")
        targets = [self._target(d) for _, d in pairs]
        if self._tf_collective_ops:  # TF's collective ops put results on every replica device;
            targets = [  # a value it gives another op (MirroredStrategy's int32) on its own.
                self._mirrored_target if self._by_collective_ops(_dtype_of(v)) else t
                for (v, _), t in zip(pairs, targets)]
        ops = self._cross_device_ops
        # TF's batch_reduce SUMs plain and Mirrored values too (reduce_to raises); their MEAN
        # is reduce_to's, as are one replica's values and traced merge_call views.
        batch = [] if ops is None or self._num_replicas == 1 else [
            i for i, (v, _) in enumerate(pairs)
            if not isinstance(getattr(v, "stacked", v), jax.core.Tracer)
            and (isinstance(v, PerReplica) or op is ReduceOp.SUM)]
        for value, _ in pairs:
            if isinstance(value, DistributedValues):
                check_replica_count(value, self._num_replicas, "extended.batch_reduce_to")
        results = dict(zip(batch, ops.batch_reduce(  # `batch` is empty without ops.
            op, [(pairs[i][0], targets[i]) for i in batch], options) if ops and batch else []))
        return [results[i] if i in results else self._reduce_to(op, v, t, options)
                for i, ((v, _), t) in enumerate(zip(pairs, targets))]

    def broadcast_to(self, tensor: Any, destinations: Destinations) -> Any:
        """Copies ``tensor`` to ``destinations`` (a `DistributedValues` or a device).

        Args:
          tensor: an array, a number or a `Mirrored` value.
          destinations: as for `reduce_to`.

        Returns:
          A `Mirrored` value for `DistributedValues` destinations, else an array.
        """
        context.require_cross_replica(self._container_strategy_ref, "extended.broadcast_to")
        if self._num_replicas > 1:  # One replica's PerReplica is a plain array here.
            _check_broadcast_destinations(destinations)
        return self._place(tensor, self._target(destinations))

    def _target(self, destinations):
        """``destinations`` resolved; a `DistributedValues` or a traced array (a merge function's
        value) stands for the strategy's devices."""
        if isinstance(destinations, (DistributedValues, jax.core.Tracer)):
            return self._mirrored_target
        return reduce_wing().resolve_destinations(destinations)

    def _reduce_to(self, op, value, target, options):
        ops = self._cross_device_ops
        if ops is None or not isinstance(value, PerReplica):
            return self._place(self._reduce_value(op, value, None), target)
        check_replica_count(value, self._num_replicas, "reduce")
        return ops.reduce(op, value, target, options)

    def _place(self, result, target):
        """``result`` on ``target``, through the strategy's cross-device ops if it has them."""
        if isinstance(result, jax.core.Tracer):  # Inside a merge function: the program places it.
            return reduce_wing().place(result, target)
        if self._cross_device_ops is not None:
            return self._cross_device_ops.broadcast(result, target)
        if target.mirrored:
            return Mirrored._from_value(jnp.asarray(result), self._num_replicas)
        return reduce_wing().place(result, target)

    def _reduce_value(self, op: ReduceOp, value: PyTree, axis: Axis):
        """The reduce rules of ``docs/semantics.md`` for one value (not a nest)."""
        n = self._num_replicas
        asked = op
        value = self._as_worker_value(value)
        if n == 1 and axis is None and not isinstance(value, PerReplica):
            op = ReduceOp.SUM  # TF returns one replica's plain value as it is (an int MEAN
        if isinstance(value, PerReplica):  # stays int); a PerReplica of one it divides.
            check_replica_count(value, self._num_replicas, "reduce")
            if n == 1 and axis is None and op is ReduceOp.SUM and not value.ragged:
                return value.stacked[0]  # TF's add_n of one value: the value (a bool too).
            value = self._combinable(value)
            if value.ragged:  # Sum inside each replica, combine the sums with the strategy's ops.
                partials, count = reduce_wing().ragged_partials(value.values, axis)
                total = self._reduce_value(ReduceOp.SUM, PerReplica._from_components(partials),
                                           None)
                return reduce_wing().finish(op, total, count)
            axes = reduce_wing().normalize_axis(axis, value.stacked.ndim - 1)
            if isinstance(value.stacked, jax.core.Tracer):  # A merge_call view.
                return reduce_wing().stacked_reduce(op, value.stacked, axes)
            return self._reduce_per_replica(op, value, axes)
        step_output = is_step_output(value)
        if isinstance(value, Mirrored):
            check_replica_count(value, n, "reduce")
            if op is ReduceOp.SUM and axis is None and n > 1 and not step_output:
                raise errors.InvalidArgumentError(
                    "A Mirrored value (a reduce_to or broadcast_to result, a jdist.Mirrored) "
                    "cannot be reduced with ReduceOp.SUM, as in TF: it is one value, not one per "
                    "replica. Reduce it with MEAN (the value itself), or multiply it by "
                    "strategy.num_replicas_in_sync.")
            value = value.value
        elif axis is None:
            return reduce_plain(asked, value, n)
        # The same value on every replica (TF runs the within-replica reduce on each of them).
        value = jnp.asarray(value)
        axes = reduce_wing().normalize_axis(axis, value.ndim)
        return reduce_wing().replicated_reduce(op, value, axes, n, mean_is_value=not step_output)


def reduce_plain(op: ReduceOp, value: Any, num_replicas: int) -> Any:
    """``reduce`` (no axis) or ``reduce_to`` of a non-distributed value: its MEAN is the value,
    its SUM is the value on one replica and raises on several (TF's).

    Example:
      >>> reduce_plain(ReduceOp.MEAN, 0.5, 3), reduce_plain(ReduceOp.SUM, 0.5, 1)
      (0.5, 0.5)
    """
    if op is ReduceOp.SUM and num_replicas > 1:
        text = repr(value)
        raise errors.InvalidArgumentError(
            f"A non-DistributedValues value {text[:57] + '...' if len(text) > 60 else text} "
            "cannot be reduced with ReduceOp.SUM on a strategy with several replicas: it is one "
            "value, not one per replica (TF raises too). Reduce the PerReplica value returned "
            "by strategy.run, or use MEAN, which gives the value back.")
    return value


def _check_broadcast_destinations(destinations):
    """Raises where TF's ``broadcast_to`` refuses an array as its destinations (it tests their
    truth, which fails for several elements, a zero or an empty array)."""
    if isinstance(destinations, DistributedValues) or not hasattr(destinations, "size"):
        return
    traced = isinstance(destinations, jax.core.Tracer)  # One element: its truth is unknown.
    if destinations.size > 1 or not traced and not (destinations.size and np.all(destinations)):
        raise errors.InvalidArgumentError(
            "extended.broadcast_to got an array as its destinations, which TF refuses (it "
            "tests their truth: ValueError); pass a DistributedValues (the strategy's devices) "
            "or a device.")


def _dtype_of(value):
    """The dtype of a value's arrays (a `PerReplica` flattens to them); None for a number."""
    leaves = jax.tree_util.tree_leaves(value)
    return np.dtype(leaves[0].dtype) if leaves and hasattr(leaves[0], "dtype") else None


class _OneReplica(ReplicaCollectives):
    """`base.ReplicaCollectives` outside a traced replica function: there is one replica."""

    def __init__(self, strategy, num_replicas):
        self._strategy = strategy
        self._num_replicas = num_replicas

    def _require_one(self, what, value):
        if self._num_replicas != 1:
            raise errors.WrongContextError(
                f"{what} was called on a replica context that is not inside strategy.run; call "
                "it from the replica function.")
        return value

    def all_reduce(self, op, value, options=None):
        return self._require_one("all_reduce", value)

    def all_gather(self, value, axis):
        return self._require_one("all_gather", value)

    def merge_call(self, merge_fn, args, kwargs):
        with context.cross_replica_scope(self._strategy, in_merge=True):
            return merge_fn(self._strategy, *args, **kwargs)


def _negative(axis) -> bool:
    """Whether ``axis`` is a negative integer (which TF's collective gathers refuse)."""
    return bool(isinstance(axis, (int, np.integer)) and not isinstance(axis, bool) and axis < 0)
