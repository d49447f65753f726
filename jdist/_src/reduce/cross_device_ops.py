"""CrossDeviceOps: how a strategy combines values across its devices.

`ReductionToOneDevice` combines the replicas on one device; `NcclAllReduce` /
`HierarchicalCopyAllReduce` (and the default) run one ``lax.psum`` program, batches packed by
`packing`. An op never sees a strategy: destinations resolve once into a `Target` and values'
devices come from their shardings (`replica_mesh`), so the ops also work standalone."""

import abc
import collections.abc
from typing import Any, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P
from jax.sharding import SingleDeviceSharding

from jdist._src import devices as devices_lib, errors
from jdist._src.base import Destinations, PyTree
from jdist._src.reduce import collectives, destinations as destinations_lib, packing, replica_mesh
from jdist._src.reduce.destinations import Target
from jdist._src.reduce.packing import CommunicationOptions, as_options
from jdist._src.reduce.replica_mesh import ReplicaMesh
from jdist._src.reduce_op import ReduceOp, check_reducible
from jdist._src.values import DistributedValues, Mirrored, PerReplica


class CrossDeviceOps(abc.ABC):
    """Base class of how values are combined across devices (``tf.distribute.CrossDeviceOps``).

    Subclasses implement ``reduce_implementation`` (the batch and broadcast ones have defaults),
    given checked arguments and resolved `Target` s. Destinations are a `DistributedValues` (a
    `Mirrored` result on its devices), a device name or ``jax.Device`` (an array there; under
    `MultiWorkerMirroredStrategy` this worker's), a ``jax.Array`` (an array on its devices) or a
    `Target`. A plain array is a one-replica value.

    Example:
      >>> import jax, numpy as np, jdist
      >>> s = jdist.MirroredStrategy(jax.devices()[:2])
      >>> v = s.experimental_distribute_values_from_function(
      ...     lambda ctx: np.float32(ctx.replica_id_in_sync_group + 1))
      >>> ops = jdist.NcclAllReduce()
      >>> float(ops.reduce(jdist.ReduceOp.SUM, v, destinations="cpu:0"))
      3.0
      >>> [float(x) for x in ops.broadcast(np.float32(7), v).values]
      [7.0, 7.0]
    """

    def reduce(self, reduce_op: ReduceOp, per_replica_value: Any, destinations: Destinations,
               options: Optional[CommunicationOptions] = None) -> Any:
        """Reduces ``per_replica_value`` across replicas onto ``destinations``.

        ``reduce_op`` is a `ReduceOp` (a name is a ValueError here, as in TF). Returns a
        `Mirrored` value for `DistributedValues` destinations, else an array.
        """
        op = ReduceOp.from_any(reduce_op, allow_strings=False)
        target = destinations_lib.resolve(destinations)
        if per_replica_value is None or isinstance(per_replica_value, collections.abc.Mapping):
            raise errors.InvalidArgumentError(  # TF converts it to one tensor, and cannot.
                f"reduce takes one value, got {type(per_replica_value).__name__}; reduce each "
                "leaf, or several values at once with batch_reduce.")
        check_reducible(op, per_replica_value, adds=_adds(per_replica_value))
        return self._reduce(op, per_replica_value, target, as_options(options))

    def batch_reduce(self, reduce_op: ReduceOp, value_destination_pairs: Sequence[tuple],
                     options: Optional[CommunicationOptions] = None) -> List[Any]:
        """Reduces a sequence of ``(value, destinations)`` pairs, packing them where it can;
        returns one result per pair, as `reduce` would give."""
        op = ReduceOp.from_any(reduce_op, allow_strings=False)
        pairs = check_pairs(value_destination_pairs)
        pairs = [(value, destinations_lib.resolve(d)) for value, d in pairs]
        values = [value for value, _ in pairs]
        check_reducible(op, [v for v in values if _adds(v)])  # One walk for the batch.
        check_reducible(op, [v for v in values if not _adds(v)], adds=False)
        return self._batch_reduce(op, pairs, as_options(options))

    def broadcast(self, tensor: Any, destinations: Destinations) -> Any:
        """Copies ``tensor`` (an array or a `Mirrored`) to ``destinations``; returns a `Mirrored`
        value for `DistributedValues` destinations, else an array."""
        return self.broadcast_implementation(tensor, destinations_lib.resolve(destinations))

    @abc.abstractmethod
    def reduce_implementation(self, reduce_op: ReduceOp, per_replica_value: PerReplica,
                              destinations: Target, options: CommunicationOptions) -> Any:
        """Reduces a `PerReplica` with >= 2 replicas (arguments already checked)."""

    def batch_reduce_implementation(self, reduce_op: ReduceOp,
                                    value_destination_pairs: Sequence[Tuple[PerReplica, Target]],
                                    options: CommunicationOptions) -> List[Any]:
        """Reduces checked pairs of `PerReplica` values; by default one by one."""
        return [self.reduce_implementation(reduce_op, v, d, options)
                for v, d in value_destination_pairs]

    def broadcast_implementation(self, tensor: Any, destinations: Target) -> Any:
        """Copies ``tensor`` to resolved ``destinations``."""
        return destinations_lib.place(tensor, destinations)

    def _reduce_to_mesh(self, mesh: ReplicaMesh, op: ReduceOp, value: PerReplica,
                       axes: Optional[Tuple[int, ...]]) -> jax.Array:
        """``strategy.reduce(op, value, axis)`` replicated over ``mesh``: each replica's partial
        sums along ``axes``, added by `reduce_implementation`, MEAN divided by the count."""
        here = destinations_lib.mirrored_on(mesh.devices)
        stacked = mesh.place_per_replica(value.stacked)
        stacked, lengths = mesh.strip_padding(stacked, value._lengths, axes)
        if axes is None:
            return self.reduce_implementation(op, PerReplica._from_stacked(stacked), here,
                                              as_options(None)).value
        partials = mesh.local_sums(stacked, axes, lengths)
        total = self.reduce_implementation(ReduceOp.SUM, PerReplica._from_stacked(partials), here,
                                           as_options(None)).value
        rows = None if lengths is None else sum(lengths)
        return mesh.finish(op, total, collectives.mean_count(stacked.shape[1:], axes,
                                                             stacked.shape[0], rows))

    #: Whether `_replica_all_reduce` sums with ``psum`` (else a custom VJP gives TF's gradient).
    _sums_by_psum = True

    def _replica_all_reduce(self, axis_name: str, num_replicas: int, op: ReduceOp, value: PyTree,
                           options: Optional[CommunicationOptions] = None) -> PyTree:
        """``ReplicaContext.all_reduce`` inside ``run`` (packed if ``options.bytes_per_pack``)."""
        options = as_options(options)
        if options.bytes_per_pack <= 0:
            return collectives.replica_all_reduce(axis_name, op, value)
        return packing.packed_replica_all_reduce(axis_name, num_replicas, op, value,
                                                 options.bytes_per_pack)

    def _reduce(self, op, value, target, options):
        if isinstance(value, PerReplica) and isinstance(value.stacked, jax.core.Tracer):
            # A merge_call view, inside a trace: the program places the result.
            return destinations_lib.place(self._reduce_view(op, value), target)
        per_replica = replica_mesh.as_per_replica(value)
        if per_replica is None or per_replica.num_replicas == 1:
            return self._reduce_one(op, value if per_replica is None else per_replica.values[0],
                                    target)
        return self.reduce_implementation(op, per_replica, target, options)

    def _reduce_one(self, op, one, target):
        """One value (TF's shortcut): returned as it is on the destinations' devices, else
        reduced (a MEAN divides by 1); a host value lies on the first CPU, as in TF."""
        one = one if isinstance(one, (jax.Array, np.ndarray)) else jnp.asarray(one)
        here = (set(one.devices()) if isinstance(one, jax.Array)
                else {jax.local_devices(backend="cpu")[0]})
        if here != set(target.devices):
            if op is ReduceOp.MEAN:  # TF divides the value by 1 (no bool division).
                check_reducible(op, one)
            one = collectives.finish(op, one, 1)
        return self.broadcast_implementation(one, target)

    def _batch_reduce(self, op, pairs, options):
        placed = [(replica_mesh.as_per_replica(v), t) for v, t in pairs]
        batch = [i for i, (v, _) in enumerate(placed) if v is not None and v.num_replicas > 1]
        results = dict(zip(batch, self.batch_reduce_implementation(
            op, [placed[i] for i in batch], options) if batch else []))
        return [results[i] if i in results else self._reduce(op, v, t, options)
                for i, (v, t) in enumerate(pairs)]

    def _reduce_view(self, op, value):  # A merge_call view: replicas stacked on a tracer.
        return collectives.stacked_reduce(op, value.stacked, None)

    def __repr__(self):
        return f"{type(self).__name__}()"


def _adds(value) -> bool:
    """Whether ``value``'s replicas are added (one replica's is handed back: `_reduce_one`)."""
    return isinstance(value, DistributedValues) and value.num_replicas > 1


def check_pairs(value_destination_pairs: Sequence[tuple]) -> List[tuple]:
    """Returns the pairs as a list; raises unless each is a ``(value, destinations)`` tuple."""
    if isinstance(value_destination_pairs, (str, DistributedValues)) or not hasattr(
            value_destination_pairs, "__iter__"):
        raise errors.InvalidArgumentError(
            "value_destination_pairs must be a sequence of (value, destinations) tuples, got "
            f"{type(value_destination_pairs).__name__}.")
    pairs = list(value_destination_pairs)
    if not pairs:
        raise errors.InvalidArgumentError(
            "value_destination_pairs is empty; pass at least one (value, destinations) tuple.")
    if not all(isinstance(p, tuple) and len(p) == 2 for p in pairs):
        raise errors.InvalidArgumentError(
            "value_destination_pairs must be a sequence of (value, destinations) tuples.")
    return pairs


class ReductionToOneDevice(CrossDeviceOps):
    """Copies values to one device, combines them there, and broadcasts the result.

    ``tf.distribute.ReductionToOneDevice``: ``accumulation_fn`` combines the values on
    ``reduce_to_device`` (MEAN divides by their count). Inside ``run``, and for a value spread
    over several workers, every device gathers the values in replica order and applies
    ``accumulation_fn`` (one SPMD program has no single reducing device).

    Args:
      reduce_to_device: the device to reduce on: a name such as ``"CPU:0"`` (or, with several
        workers, ``"/job:worker/replica:0/task:1/device:CPU:0"``) or a ``jax.Device``.
        Default: the first device of the destinations.
      accumulation_fn: a jax-traceable function from a list of arrays to one array. Default:
        their sum (``tf.math.add_n``).

    Example:
      >>> import functools, jax, jax.numpy as jnp, numpy as np, jdist
      >>> ops = jdist.ReductionToOneDevice(
      ...     accumulation_fn=lambda xs: functools.reduce(jnp.maximum, xs))
      >>> s = jdist.MirroredStrategy(jax.devices()[:2], cross_device_ops=ops)
      >>> v = s.experimental_distribute_values_from_function(
      ...     lambda ctx: np.array([1.0, 5.0], np.float32) * (-1) ** ctx.replica_id_in_sync_group)
      >>> s.reduce("sum", v, axis=None).tolist()
      [1.0, 5.0]
    """

    def __init__(self, reduce_to_device: Any = None,
                 accumulation_fn: Optional[Any] = None) -> None:
        if reduce_to_device is not None and not isinstance(reduce_to_device, (str, jax.Device)):
            raise errors.InvalidArgumentError(
                "reduce_to_device must be a device name such as 'CPU:0' or a jax.Device, got "
                f"{type(reduce_to_device).__name__}.")
        if isinstance(reduce_to_device, str) and not reduce_to_device.strip():
            raise errors.InvalidArgumentError("reduce_to_device can not be empty.")
        if accumulation_fn is not None and not callable(accumulation_fn):
            raise errors.InvalidArgumentError("accumulation_fn must be callable.")
        self.reduce_to_device = reduce_to_device
        self.accumulation_fn = accumulation_fn
        self._programs_cache: dict = {}

    def _device(self, destinations):
        return (destinations_lib.resolve(destinations).devices[0] if self.reduce_to_device is None
                else devices_lib.resolve_any(self.reduce_to_device))

    def _accumulate_fn(self, op, n):
        combine = collectives.add_in_order if self.accumulation_fn is None else self.accumulation_fn
        return lambda stacked: collectives.finish(op, combine([stacked[i] for i in range(n)]), n)

    def reduce_implementation(self, reduce_op: ReduceOp, per_replica_value: PerReplica,
                              destinations: Target, options: CommunicationOptions) -> Any:
        value = per_replica_value
        mesh = replica_mesh.of_array(value.stacked, value.num_replicas)
        stacked, _ = mesh.strip_padding(value.stacked, value._lengths, None)
        device = self._device(destinations)
        if destinations_lib.is_global(stacked):
            reduced = self._accumulate_everywhere(mesh, reduce_op, stacked)
        elif device.process_index != jax.process_index():
            raise errors.InvalidArgumentError(
                f"reduce_to_device {device} belongs to another worker, but the value lies on this "
                "worker's devices only; reduce a value of the MultiWorkerMirroredStrategy (every "
                "worker makes the call), or reduce on one of this worker's devices.")
        else:
            on_device = mesh.guard.dispatch(jax.device_put, stacked, SingleDeviceSharding(device))
            key = (reduce_op, stacked.shape[0])
            if key not in self._programs_cache:
                self._programs_cache[key] = jax.jit(self._accumulate_fn(*key))
            reduced = mesh.guard.dispatch(self._programs_cache[key], on_device)
        return self.broadcast_implementation(reduced, destinations)

    def _accumulate_everywhere(self, mesh, op, stacked):
        """Accumulates a value over several processes on every device (one program for all)."""
        n = stacked.shape[0]
        if stacked.size == 0:
            return collectives.reduce_empty(self._accumulate_fn(op, n), stacked.shape,
                                            stacked.dtype)
        key = (mesh, op, n)
        if key not in self._programs_cache:
            accumulate, axis = self._accumulate_fn(op, n), mesh.axis_name
            self._programs_cache[key] = jax.jit(jax.shard_map(
                lambda block: accumulate(lax.all_gather(block[0], axis)), mesh=mesh.mesh,
                in_specs=(P(axis),), out_specs=P(), check_vma=False))
        return mesh.guard.dispatch(self._programs_cache[key], stacked)

    def _reduce_view(self, op, value):
        if self.accumulation_fn is None:
            return super()._reduce_view(op, value)
        return self._accumulate_fn(op, value.stacked.shape[0])(value.stacked)

    @property
    def _sums_by_psum(self):
        return self.accumulation_fn is None  # add_n of every replica's value is a psum.

    def _replica_all_reduce(self, axis_name, num_replicas, op, value, options=None):
        if self.accumulation_fn is None:  # add_n of every replica's value is a psum.
            return super()._replica_all_reduce(axis_name, num_replicas, op, value, options)
        accumulate = self._accumulate_fn(op, num_replicas)

        def reduce_leaf(x):
            x = jnp.asarray(x)
            if x.size == 0:
                return collectives.reduce_empty(accumulate, (num_replicas,) + x.shape, x.dtype)
            return accumulate(lax.all_gather(x, axis_name))
        return jax.tree_util.tree_map(reduce_leaf, value)

    def __repr__(self):
        return (f"ReductionToOneDevice(reduce_to_device={self.reduce_to_device!r}, "
                f"accumulation_fn={self.accumulation_fn!r})")


class AllReduceCrossDeviceOps(CrossDeviceOps):
    """All-reduce over the replicas' devices: one compiled program with ``lax.psum``.

    The base of `NcclAllReduce` and `HierarchicalCopyAllReduce`, and the default off GPUs
    (``all_reduce_alg="xla"``). Batches are packed as `jdist._src.reduce.packing` says.

    Args:
      all_reduce_alg: ``"nccl"``, ``"hierarchical_copy"`` or ``"xla"`` (a name: XLA lowers every
        one to its backend's all-reduce).
      num_packs: how many packs a batch is split into (>= 0; 0 means no packing).
    """

    _ALGORITHMS = {"nccl": "NCCL all-reduce", "hierarchical_copy": "HierarchicalCopy",
                   "xla": "XLA all-reduce"}
    _NCCL_DTYPES = frozenset({"float16", "float32", "float64", "int32", "int64"})

    def __init__(self, all_reduce_alg: str = "nccl", num_packs: int = 1) -> None:
        if all_reduce_alg not in self._ALGORITHMS:
            raise errors.InvalidArgumentError(
                f"unknown all_reduce_alg {all_reduce_alg!r}; use one of "
                f"{sorted(self._ALGORITHMS)}.")
        if isinstance(num_packs, bool) or not isinstance(num_packs, (int, np.integer)) or (
                num_packs < 0):
            raise errors.InvalidArgumentError(
                f"{self._ALGORITHMS[all_reduce_alg]} requires num_packs >= 0, but {num_packs!r} "
                "is specified.")
        self._all_reduce_alg = all_reduce_alg
        self._num_packs = int(num_packs)

    def _reduce_to_mesh(self, mesh, op, value, axes):
        return mesh.reduce(op, value.stacked, axes, value._lengths)

    def reduce_implementation(self, reduce_op: ReduceOp, per_replica_value: PerReplica,
                              destinations: Target, options: CommunicationOptions) -> Any:
        mesh = replica_mesh.of_array(per_replica_value.stacked, per_replica_value.num_replicas)
        if mesh.devices[0].platform != "cpu" and set(destinations.devices) == set(mesh.devices):
            # TF all-reduces one value only there; elsewhere it reduces to one device.
            self._check_tf_all_reduce(mesh.num_replicas, [per_replica_value.stacked.dtype])
        reduced = self._reduce_to_mesh(mesh, reduce_op, per_replica_value, None)
        return self._place(mesh, reduced, destinations)

    def _replica_all_reduce(self, axis_name, num_replicas, op, value, options=None):
        self._check_tf_all_reduce(num_replicas, [jax.dtypes.result_type(x)
                                                for x in jax.tree_util.tree_leaves(value)])
        return super()._replica_all_reduce(axis_name, num_replicas, op, value, options)

    def _check_tf_all_reduce(self, num_replicas: int, dtypes: Sequence) -> None:
        """Raises where TF's all-reduce of ``dtypes`` raises or gives a sum jdist does not match."""
        name = self._ALGORITHMS[self._all_reduce_alg]
        if self._all_reduce_alg == "xla" or num_replicas == 1:
            return
        dtypes = sorted({np.dtype(d).name for d in dtypes})
        instead = "use ReductionToOneDevice or the strategy's default cross_device_ops"
        if self._all_reduce_alg == "hierarchical_copy" and num_replicas % 2:
            raise errors.InvalidArgumentError(
                f"{name} over {num_replicas} replicas: TF's hierarchical copy adds two groups "
                f"of {num_replicas // 2} replicas and leaves the last one out of the sum (TF "
                f"returns the sum of {num_replicas - 1} replicas). Use an even number of "
                f"replicas or NcclAllReduce, or {instead}.")
        refused = [d for d in dtypes if d not in self._NCCL_DTYPES]
        if self._all_reduce_alg == "nccl" and refused:
            raise errors.InvalidArgumentError(
                f"{name} of {', '.join(refused)} values: TF's NCCL all-reduce takes "
                f"{', '.join(sorted(self._NCCL_DTYPES))} only (it raises TypeError); cast "
                f"them, or {instead}.")
        if self._num_packs > 0 and len(dtypes) > 1:
            raise errors.InvalidArgumentError(
                f"{name} with num_packs={self._num_packs} of values of several dtypes "
                f"({', '.join(dtypes)}): TF concatenates the batch into one buffer, which "
                f"needs one dtype (it raises). Reduce each dtype in a batch of its own, pass "
                f"num_packs=0, or {instead}.")

    def _place(self, mesh, reduced, target):
        """``reduced`` (replicated on ``mesh``) on ``target``; no copy on the same devices."""
        if target.mirrored and target.mesh is mesh:
            return Mirrored._from_value(reduced, mesh.num_replicas)
        return self.broadcast_implementation(reduced, target)

    def batch_reduce_implementation(self, reduce_op: ReduceOp,
                                    value_destination_pairs: Sequence[Tuple[PerReplica, Target]],
                                    options: CommunicationOptions) -> List[Any]:
        by_mesh: dict = {}
        for i, (value, _) in enumerate(value_destination_pairs):
            by_mesh.setdefault(replica_mesh.of_array(value.stacked, value.num_replicas),
                               []).append(i)
        results = [None] * len(value_destination_pairs)
        if len(by_mesh) == 1 and all(set(t.devices) == set(next(iter(by_mesh)).devices)
                                     for _, t in value_destination_pairs):
            # TF all-reduces the batch at once there; elsewhere each value on its own.
            self._check_tf_all_reduce(next(iter(by_mesh)).num_replicas,
                                     [v.stacked.dtype for v, _ in value_destination_pairs])
        for mesh, indices in by_mesh.items():
            values = [value_destination_pairs[i][0] for i in indices]
            stacked = [mesh.strip_padding(v.stacked, v._lengths, None)[0] for v in values]
            program, _ = self._packed_program(mesh, reduce_op, stacked, options)
            reduced = mesh.guard.dispatch(program, *stacked)
            for i, r in zip(indices, reduced):
                results[i] = self._place(mesh, r, value_destination_pairs[i][1])
        return results

    def _packed_program(self, mesh, op, stacked, options):
        return packing.all_reduce_program(mesh.per_replica_sharding, op, options.bytes_per_pack,
                                          self._num_packs,
                                          tuple((s.shape, s.dtype) for s in stacked))

    def _lower_packed_all_reduce(self, mesh: ReplicaMesh, reduce_op: ReduceOp, stacked: Sequence,
                                options: Optional[CommunicationOptions] = None):
        """The ``jax.stages.Lowered`` packed program for ``stacked`` and its `packing.PackPlan`."""
        program, plan = self._packed_program(mesh, reduce_op, stacked, as_options(options))
        return program.lower(*stacked), plan

    def __repr__(self):
        if type(self) is AllReduceCrossDeviceOps:
            return (f"AllReduceCrossDeviceOps(all_reduce_alg={self._all_reduce_alg!r}, "
                    f"num_packs={self._num_packs})")
        return f"{type(self).__name__}(num_packs={self._num_packs})"


class NcclAllReduce(AllReduceCrossDeviceOps):
    """All-reduce with NCCL (``tf.distribute.NcclAllReduce``): XLA's psum, which is NCCL on GPUs.

    ``num_packs`` as in `AllReduceCrossDeviceOps`.

    Example:
      >>> import jax, numpy as np, jdist
      >>> s = jdist.MirroredStrategy(jax.devices()[:2], cross_device_ops=jdist.NcclAllReduce())
      >>> v = s.experimental_distribute_values_from_function(
      ...     lambda ctx: np.full(3, ctx.replica_id_in_sync_group + 1.0, np.float32))
      >>> s.reduce("mean", v, axis=None).tolist()
      [1.5, 1.5, 1.5]
    """

    def __init__(self, num_packs: int = 1) -> None:
        super().__init__("nccl", num_packs)


class HierarchicalCopyAllReduce(AllReduceCrossDeviceOps):
    """``tf.distribute.HierarchicalCopyAllReduce``: XLA's all-reduce, whose algorithm XLA picks.

    ``num_packs`` as in `AllReduceCrossDeviceOps`.

    Example:
      >>> import jax, numpy as np, jdist
      >>> ops = jdist.HierarchicalCopyAllReduce(num_packs=2)
      >>> s = jdist.MirroredStrategy(jax.devices()[:2], cross_device_ops=ops)
      >>> v = s.experimental_distribute_values_from_function(
      ...     lambda ctx: np.float32(ctx.replica_id_in_sync_group + 1))
      >>> [float(x) for x in ops.batch_reduce(jdist.ReduceOp.SUM, [(v, v), (v, "cpu:1")])]
      [3.0, 3.0]
    """

    def __init__(self, num_packs: int = 1) -> None:
        super().__init__("hierarchical_copy", num_packs)


def resolve(cross_device_ops, devices):
    """``cross_device_ops`` checked; None: `NcclAllReduce` on GPUs, else the ``"xla"`` psum."""
    if cross_device_ops is None:
        gpus = all(d.platform == "gpu" for d in devices)
        return NcclAllReduce() if gpus else AllReduceCrossDeviceOps("xla")
    if not isinstance(cross_device_ops, CrossDeviceOps):
        raise errors.InvalidArgumentError(
            "cross_device_ops must be a CrossDeviceOps (e.g. jdist.NcclAllReduce()), got "
            f"{type(cross_device_ops).__name__}.")
    return cross_device_ops
