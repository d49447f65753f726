"""A replica mesh: devices in replica order, their shardings, and the host-side programs on them.

Every cross-replica operation outside a replica function runs on a `ReplicaMesh` (placement,
and the compiled reduce/gather programs; `collectives` holds their arithmetic). A
`CrossDeviceOps` gets values, not a strategy, so it finds a value's mesh in the registry
(`for_devices`, `of_array`): one mesh per device tuple, its compiled programs shared.
"""

import functools
import threading
from typing import Any, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.sharding import SingleDeviceSharding

from jdist._src.reduce import collectives
from jdist._src import dispatch
from jdist._src import errors
from jdist._src.base import Lengths
from jdist._src.base import REPLICA_AXIS
from jdist._src.host_values import check_host_numbers
from jdist._src.reduce_op import ReduceOp
from jdist._src.values import DistributedValues
from jdist._src.values import Mirrored
from jdist._src.values import PerReplica


class ReplicaMesh:
    """The mesh of a set of replicas and the compiled host-side programs on it.

    Args:
      mesh: a 1-D device mesh, one device per replica.
      axis_name: its axis name (``"replica"``).
      guard: the `DispatchGuard` every launch goes through.
    """

    def __init__(self, mesh: Mesh, axis_name: str, guard: dispatch.DispatchGuard):
        self.mesh = mesh
        self.axis_name = axis_name
        self.guard = guard
        self.devices = tuple(mesh.devices.flat)
        self.num_replicas = len(self.devices)
        self.per_replica_sharding = NamedSharding(mesh, P(axis_name))
        self.replicated_sharding = NamedSharding(mesh, P())
        self._lengths_cache: dict = {}

    def lengths_array(self, lengths: Tuple[int, ...]) -> jax.Array:
        """The per-replica lengths as an int32 array sharded over the replicas (cached)."""
        arr = self._lengths_cache.get(lengths)
        if arr is None:
            arr = jax.device_put(np.asarray(lengths, np.int32), self.per_replica_sharding)
            self._lengths_cache[lengths] = arr
        return arr

    def place_per_replica(self, stacked: Any) -> jax.Array:
        """``stacked`` sharded over the replica axis (no copy if it already is)."""
        if isinstance(stacked, jax.Array) and stacked.sharding == self.per_replica_sharding:
            return stacked
        if stacked.shape[0] != self.num_replicas:
            raise errors.InvalidArgumentError(
                f"a PerReplica value with {stacked.shape[0]} components was given to a strategy "
                f"with {self.num_replicas} replicas; create it with this strategy.")
        check_host_numbers(stacked)
        return jax.device_put(stacked, self.per_replica_sharding)

    def place_replicated(self, value: Any) -> jax.Array:
        """``value`` replicated on every replica's device (no copy if it already is)."""
        if self._is_replicated(value):
            return value
        check_host_numbers(value)
        return jax.device_put(value, self.replicated_sharding)

    def _is_replicated(self, value) -> bool:
        return isinstance(value, jax.Array) and value.sharding == self.replicated_sharding

    def place_replicated_all(self, values: Sequence) -> list:
        """`place_replicated` of each of ``values``, the ones not yet placed in one transfer."""
        values = list(values)
        unplaced = [i for i, x in enumerate(values) if not self._is_replicated(x)]
        if unplaced:
            for i in unplaced:
                check_host_numbers(values[i])
            placed = self._put_replicated([values[i] for i in unplaced])
            for i, x in zip(unplaced, placed):
                values[i] = x
        return values

    def _put_replicated(self, values: list) -> list:
        # On one device, host arrays enter through a compiled identity, whose C++ dispatch
        # transfers them: about 5x faster than jax.device_put's Python (a host batch per step).
        if self.num_replicas == 1 and all(isinstance(x, np.ndarray) for x in values):
            return list(self._identity(*values))
        return jax.device_put(values, self.replicated_sharding)

    @functools.cached_property
    def _identity(self):
        return jax.jit(lambda *xs: xs, in_shardings=self.replicated_sharding,
                       out_shardings=self.replicated_sharding)

    def tile(self, value: Any) -> jax.Array:
        """A replicated ``value`` as ``num_replicas`` stacked copies, sharded over the replicas."""
        return self.guard.dispatch(self._tile_program(), self.place_replicated(value))

    def slice_rows(self, stacked: jax.Array, rows: int) -> jax.Array:
        """``stacked`` with only the first ``rows`` rows of every replica's block."""
        return self.guard.dispatch(_slice_rows_program(rows), stacked)

    def strip_padding(self, stacked: jax.Array, lengths: Lengths, axes: Optional[Tuple[int, ...]],
                      what: str = "reduce") -> Tuple[jax.Array, Lengths]:
        """`collectives.strip_padding` with the rows cut by a compiled program on this mesh."""
        return collectives.strip_padding(stacked, lengths, axes, what, self.slice_rows)

    def reduce(self, op: ReduceOp, stacked: Any, axes: Optional[Tuple[int, ...]],
               lengths: Lengths = None) -> jax.Array:
        """Reduces a per-replica value to one array replicated on every device."""
        stacked = self.place_per_replica(stacked)
        stacked, lengths = self.strip_padding(stacked, lengths, axes)
        if stacked.size == 0:
            valid = None if lengths is None else jnp.asarray(lengths)
            return self.place_replicated(collectives.reduce_empty(
                lambda s: collectives.stacked_reduce(op, s, axes, valid), stacked.shape,
                stacked.dtype))
        program = self._reduce_program(op, axes, lengths is not None)
        return self.guard.dispatch(program, *self._with_lengths(stacked, lengths))

    def local_sums(self, stacked: jax.Array, axes: Optional[Tuple[int, ...]],
                   lengths: Lengths = None) -> jax.Array:
        """Each replica's sum over ``axes`` of its real rows, stacked (no communication);
        ``stacked`` is on this mesh, its padding stripped as `reduce` does."""
        program = self._local_sums_program(axes, lengths is not None)
        return self.guard.dispatch(program, *self._with_lengths(stacked, lengths))

    def finish(self, op: ReduceOp, total: jax.Array, count: Any) -> jax.Array:
        """`collectives.finish` of a replicated ``total`` on this mesh."""
        if op is ReduceOp.SUM:
            return total
        return self.guard.dispatch(_mean, total, np.asarray(count))

    def _with_lengths(self, stacked, lengths):
        return (stacked,) if lengths is None else (stacked, self.lengths_array(lengths))

    @functools.lru_cache(maxsize=None)
    def _reduce_program(self, op, axes, has_lengths):
        axis, n = self.axis_name, self.num_replicas

        def body(block, valid=None):
            valid_rows = None if valid is None else valid[0]
            partial = collectives.local_sum(block[0], axes, valid_rows)
            total = collectives.replica_sum(partial, axis)
            rows = None if valid is None else lax.psum(valid_rows, axis)
            return collectives.finish(op, total,
                                      collectives.mean_count(block.shape[1:], axes, n, rows))

        # Unchecked: a bfloat16 sum is a gather (`collectives.replica_sum`), the same on every
        # replica though shard_map types a gather as varying.
        return jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=self._specs(has_lengths),
                                     out_specs=P(), check_vma=False))

    @functools.lru_cache(maxsize=None)
    def _local_sums_program(self, axes, has_lengths):
        def body(block, valid=None):
            rows = None if valid is None else valid[0]
            return collectives.local_sum(block[0], axes, rows)[None]

        return jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=self._specs(has_lengths),
                                     out_specs=P(self.axis_name)))

    def _specs(self, has_lengths):
        return (P(self.axis_name),) * (2 if has_lengths else 1)

    @functools.lru_cache(maxsize=None)
    def _tile_program(self):
        n = self.num_replicas
        return jax.jit(lambda v: jnp.broadcast_to(v, (n,) + v.shape),
                       out_shardings=self.per_replica_sharding)

    def gather(self, stacked: Any, axis: int, lengths: Lengths = None) -> jax.Array:
        """Concatenates the replicas' real values along per-replica ``axis``, on ONE device.

        As in TF, the result lives on the first replica's device only; the blocks are joined in
        the buffer of their copy there, so the peak memory is the input plus the result.
        """
        stacked = self.place_per_replica(stacked)
        stacked, lengths = self.strip_padding(stacked, lengths, (axis,), "gather")
        device = SingleDeviceSharding(self.devices[0])
        if stacked.size == 0:
            rows = stacked.shape[0] * stacked.shape[axis + 1] if lengths is None else sum(lengths)
            return jax.device_put(
                collectives.empty_gather(stacked.shape[1:], stacked.dtype, axis, rows), device)
        if not stacked.is_fully_addressable:  # Across hosts: all-gather, every device a copy.
            gathered = self.guard.dispatch(self._all_gather_program(axis), stacked)
        else:
            on_one = self.guard.dispatch(jax.device_put, stacked, device)
            # A value already on that device alone is not copied: it is the caller's, kept.
            copied = stacked.sharding.device_set != {self.devices[0]}
            gathered = self.guard.dispatch(_gather_program(axis, copied), on_one)
        if lengths is None:
            return gathered
        padded = stacked.shape[1]
        rows = np.concatenate([r * padded + np.arange(n) for r, n in enumerate(lengths)])
        return self.guard.dispatch(_take_rows, gathered, rows.astype(np.int32))

    @functools.lru_cache(maxsize=None)
    def _all_gather_program(self, axis):
        """The replicas' blocks concatenated along ``axis`` on every device (multi-process)."""
        def body(block):
            return lax.all_gather(block[0], self.axis_name, axis=axis, tiled=True)
        return jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=(P(self.axis_name),),
                                     out_specs=P(), check_vma=False))


@functools.lru_cache(maxsize=None)
def _gather_program(axis, donated):
    def concatenate(stacked):  # (N, *shape) on one device: the N blocks joined along axis.
        moved = jnp.moveaxis(stacked, 0, axis)
        return moved.reshape(moved.shape[:axis] + (-1,) + moved.shape[axis + 2:])
    # Donated where it is a copy: it becomes the result (no second buffer of its size).
    return jax.jit(concatenate, donate_argnums=0 if donated else ())


@jax.jit
def _take_rows(gathered, rows):
    return jnp.take(gathered, rows, axis=0)


@jax.jit
def _mean(total, count):
    return collectives.finish(ReduceOp.MEAN, total, count)


@functools.lru_cache(maxsize=None)
def _slice_rows_program(rows):
    return jax.jit(lambda stacked: stacked[:, :rows])


def guard_for(devices: Sequence[jax.Device]) -> dispatch.DispatchGuard:
    """The dispatch guard of launches on ``devices`` (their platform's, over its local devices)."""
    platform = devices[0].platform
    return dispatch.guard_for(platform, len(jax.local_devices(backend=platform)))


_meshes: dict = {}  # Device tuple -> ReplicaMesh over them.
_by_sharding: dict = {}  # (sharding, n) -> ReplicaMesh: the cheap lookup of a value's devices.
_lock = threading.Lock()


def for_devices(devices: Sequence[jax.Device]) -> ReplicaMesh:
    """The `ReplicaMesh` over ``devices`` in that order (one per device tuple, shared)."""
    devices = tuple(devices)
    with _lock:
        if devices not in _meshes:
            mesh = Mesh(np.array(devices), (REPLICA_AXIS,))
            _meshes[devices] = ReplicaMesh(mesh, REPLICA_AXIS, guard_for(devices))
        return _meshes[devices]


def register(replica_mesh: ReplicaMesh) -> None:
    """Lets a strategy's mesh serve its devices, so its compiled programs are shared."""
    with _lock:
        _meshes.setdefault(replica_mesh.devices, replica_mesh)


def array_devices(x: Any) -> Optional[Tuple[jax.Device, ...]]:
    """The devices of a concrete array, in mesh order when it has a mesh; None otherwise."""
    if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
        return None
    if isinstance(x.sharding, NamedSharding):
        return tuple(x.sharding.mesh.devices.flat)
    return tuple(sorted(x.sharding.device_set, key=lambda d: d.id))


def of_array(array: Any, n: int) -> ReplicaMesh:
    """The mesh of the ``n`` devices ``array`` spans; the first ``n`` local devices' for a host
    value (or one on other devices)."""
    concrete = isinstance(array, jax.Array) and not isinstance(array, jax.core.Tracer)
    key = (array.sharding, n) if concrete else None
    known = _by_sharding.get(key)  # Looked up before the devices: this runs per value.
    if known is not None:
        return known
    devices = array_devices(array)
    if devices is None or len(devices) != n:
        if n > len(jax.local_devices()):
            raise errors.InvalidArgumentError(
                f"a value with {n} replicas needs {n} devices; this process has fewer.")
        devices = jax.local_devices()[:n]
    replica_mesh = for_devices(devices)
    if key is not None:
        _by_sharding[key] = replica_mesh
    return replica_mesh


def of_value(value: DistributedValues) -> ReplicaMesh:
    """The mesh of the devices a distributed value lives on."""
    array = value.stacked if isinstance(value, PerReplica) else (
        value.value if isinstance(value, Mirrored) else None)
    return of_array(array, value.num_replicas)


def as_per_replica(value: Any) -> Optional[PerReplica]:
    """``value`` as a `PerReplica` sharded over its mesh (a `Mirrored` one is tiled); None for
    a plain tensor.

    Raises:
      UnsupportedValueError: another kind of `DistributedValues`.
    """
    if isinstance(value, PerReplica):
        stacked = value.stacked
        placed = of_array(stacked, value.num_replicas).place_per_replica(stacked)
        return value if placed is stacked else PerReplica._from_stacked(placed, value._lengths)
    if isinstance(value, Mirrored):
        return PerReplica._from_stacked(of_array(value.value, value.num_replicas).tile(value.value))
    if isinstance(value, DistributedValues):
        raise errors.UnsupportedValueError(f"cannot reduce a {type(value).__name__}.")
    return None
