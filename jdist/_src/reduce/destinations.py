"""Where cross-device results go: destinations, resolved once into a `Target`, and placement.

Destinations follow TF: a `DistributedValues` means "Mirrored on its devices", a device name or
``jax.Device`` means "an array on that device", a ``jax.Array`` means "an array on its devices".
`resolve` checks them at the API boundary (anything else is an `InvalidArgumentError`), so
everything below receives a `Target`. Under `MultiWorkerMirroredStrategy` only a `Mirrored`
target spans workers; an array result goes to this worker's devices.
"""

import functools
from typing import Any, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from jdist._src import devices as devices_lib
from jdist._src import errors
from jdist._src import host_values
from jdist._src.reduce import replica_mesh
from jdist._src.base import Destinations
from jdist._src.base import Target
from jdist._src.reduce.replica_mesh import ReplicaMesh
from jdist._src.values import DistributedValues
from jdist._src.values import Mirrored
from jdist._src.values import PerReplica


def mirrored_on(devices: Tuple[jax.Device, ...]) -> Target:
    """The target "`Mirrored` on ``devices``" (a strategy's own devices, for instance)."""
    return _mirrored_on_mesh(replica_mesh.for_devices(devices))


@functools.lru_cache(maxsize=None)
def _mirrored_on_mesh(mesh: ReplicaMesh) -> Target:
    return Target(mesh.num_replicas, True, mesh.devices, mesh)


def resolve(destinations: Destinations) -> Target:
    """Checks ``destinations`` and resolves them into a `Target` (a `Target` is returned as is).

    Args:
      destinations: a `DistributedValues`, a ``jax.Array``, a device name such as ``"CPU:0"``
        or ``"/job:worker/replica:0/task:0/device:CPU:0"``, or a ``jax.Device``.

    Returns:
      The `Target`.

    Raises:
      InvalidArgumentError: ``destinations`` is empty, of another type, or (under
        `MultiWorkerMirroredStrategy`) on another worker's devices.
      UnknownDeviceError: a device name that names no device of this job.
    """
    if isinstance(destinations, Target):
        return destinations
    if isinstance(destinations, DistributedValues):
        return _mirrored_on_mesh(replica_mesh.of_value(destinations))
    devices: Tuple[jax.Device, ...]
    if isinstance(destinations, jax.Array) and not isinstance(destinations, jax.core.Tracer):
        devices = replica_mesh.array_devices(destinations) or ()
    elif isinstance(destinations, jax.Device):
        devices = (destinations,)
    elif isinstance(destinations, str) and destinations.strip():
        devices = (devices_lib.resolve_any(destinations),)
    elif isinstance(destinations, str):
        raise errors.InvalidArgumentError(
            "destinations can not be empty; pass a device name such as 'CPU:0', a jax.Device "
            "or a DistributedValues.")
    else:
        raise errors.InvalidArgumentError(
            "destinations must be a DistributedValues, a jax.Array, a device name such as "
            f"'CPU:0' or a jax.Device; got {type(destinations).__name__}.")
    elsewhere = [d for d in devices if d.process_index != jax.process_index()]
    if elsewhere:
        raise errors.InvalidArgumentError(
            f"destinations {destinations!r} lie on another worker's devices ({elsewhere[0]}): "
            "under MultiWorkerMirroredStrategy results go to this worker's devices. Pass one of "
            "this worker's devices (e.g. 'CPU:0'), the strategy's devices (a DistributedValues "
            "as destinations: every worker gets the result), or use strategy.gather.")
    mesh = replica_mesh.for_devices(devices) if len(devices) > 1 else None
    return Target(1, False, devices, mesh)


def place(tensor: Any, target: Target) -> Any:
    """Copies ``tensor`` to ``target``: a `Mirrored` value for a mirrored target, else an array.

    Args:
      tensor: an array, a number or a `Mirrored` value.
      target: a resolved `Target`.

    Returns:
      The placed value; no copy is made when ``tensor`` is already there.

    Raises:
      UnsupportedValueError: ``tensor`` is a `PerReplica` value (reduce it first).
    """
    if isinstance(tensor, PerReplica):
        raise errors.UnsupportedValueError(
            "broadcast takes one tensor, not a PerReplica value; reduce it first.")
    if not isinstance(tensor, Mirrored) and not host_values.is_placeable(tensor):
        raise errors.UnsupportedValueError(
            f"broadcast takes one array or number, got {type(tensor).__name__} (a device holds "
            "arrays and numbers of a numeric or bool dtype; broadcast each leaf of a nest).")
    x = tensor.value if isinstance(tensor, Mirrored) else tensor
    x = x if isinstance(x, (jax.Array, np.ndarray)) else jnp.asarray(x)
    if isinstance(x, jax.core.Tracer):  # Inside a merge function: the program places it.
        return Mirrored._from_value(x, target.num_replicas) if target.mirrored else x
    if is_global(x) or _spans_processes(target.devices):
        x = _across_processes(x, target)
    if target.mirrored:
        mesh = target.mesh
        assert mesh is not None  # A mirrored target has its mesh.
        if not (isinstance(x, jax.Array) and x.sharding == mesh.replicated_sharding):
            x = mesh.guard.dispatch(jax.device_put, x, mesh.replicated_sharding)
        return Mirrored._from_value(x, mesh.num_replicas)
    sharding: jax.sharding.Sharding
    if target.mesh is not None:
        sharding, guard = target.mesh.replicated_sharding, target.mesh.guard
    else:
        (device,) = target.devices
        if isinstance(x, jax.Array) and x.sharding.is_fully_replicated and (
                device in x.devices()):  # Already there: no copy.
            return next(s.data for s in x.addressable_shards if s.device == device)
        sharding, guard = SingleDeviceSharding(device), replica_mesh.guard_for(target.devices)
    if not (isinstance(x, jax.Array) and x.sharding == sharding):
        x = guard.dispatch(jax.device_put, x, sharding)
    return x


def is_global(x) -> bool:
    """Whether ``x`` is a concrete ``jax.Array`` with shards on other processes' devices."""
    return (isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
            and not x.is_fully_addressable)


def _spans_processes(devices) -> bool:
    return any(d.process_index != jax.process_index() for d in devices)


def _across_processes(x, target: Target):
    """``x`` for `place` under `MultiWorkerMirroredStrategy` (every worker makes the call): a
    replicated global value keeps this worker's shards of a target it covers; otherwise this
    worker's copy (a local value is each worker's own, as in TF) goes on its target devices."""
    if is_global(x) and not x.sharding.is_fully_replicated:
        raise errors.UnsupportedValueError(
            f"broadcast takes one tensor; got a global array split over its devices "
            f"({x.sharding}). Reduce or gather it first.")
    if not _spans_processes(target.devices):  # This worker's own devices: a local copy.
        return _local_copy(x, target.devices[0]) if is_global(x) else x
    assert target.mesh is not None  # Only a mirrored target spans processes.
    sharding = target.mesh.replicated_sharding
    if is_global(x) and set(target.devices) <= x.sharding.device_set:
        return _keep_shards(x, target.devices, sharding)
    if is_global(x):
        x = _local_copy(x, target.devices[0])
    elif not isinstance(x, jax.Array):  # A host value, in the dtype JAX will give it.
        x = np.asarray(x)
        x = x.astype(jax.dtypes.canonicalize_dtype(x.dtype), copy=False)
    me = jax.process_index()
    local = [jax.device_put(x, d) for d in target.devices if d.process_index == me]
    return jax.make_array_from_single_device_arrays(x.shape, sharding, local, dtype=x.dtype)


def _local_copy(x: jax.Array, device) -> jax.Array:
    """This worker's copy of a replicated global ``x``: its shard on ``device`` if it has one."""
    shards = {s.device: s.data for s in x.addressable_shards}
    if not shards:
        raise errors.InvalidArgumentError(
            f"this value lies only on other workers' devices ({x.sharding}); under "
            "MultiWorkerMirroredStrategy pass values of this worker or of the strategy.")
    return shards.get(device, next(iter(shards.values())))


def _keep_shards(x, devices, sharding):
    """A replicated global ``x`` restricted to ``devices`` (a subset of its devices): each
    worker keeps the shards it holds; no communication."""
    if x.sharding == sharding:
        return x
    wanted = set(devices)
    local = [s.data for s in x.addressable_shards if s.device in wanted]
    return jax.make_array_from_single_device_arrays(x.shape, sharding, local, dtype=x.dtype)
