"""Where cross-device results go: destinations, resolved once into a `Target`, and placement.

Destinations follow TF: a `DistributedValues` means "Mirrored on its devices", a device name or
``jax.Device`` means "an array on that device", a ``jax.Array`` means "an array on its devices";
anything else is an `InvalidArgumentError` (a ``ValueError``). `resolve` checks them at the API
boundary and gives a `Target`, which everything below receives instead of the destinations.
Under `MultiWorkerMirroredStrategy` destinations may be devices of other workers; `place` then
works on global arrays (`cross_host`), and a worker holding none of the target devices gets a
`cross_host.RemoteArray`.
"""

import functools
from typing import Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from jdist._src.multi_worker import cross_host
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


def mirrored_on(devices) -> Target:
    """The target "`Mirrored` on ``devices``" (a strategy's own devices, for instance)."""
    return _mirrored_on_mesh(replica_mesh.for_devices(devices))


@functools.lru_cache(maxsize=None)
def _mirrored_on_mesh(mesh: ReplicaMesh) -> Target:
    # One per mesh (meshes are kept for good): a batch of values resolves each destination.
    return Target(mesh.num_replicas, True, mesh.devices, mesh)


def resolve(destinations: Destinations) -> Target:
    """Checks ``destinations`` and resolves them into a `Target` (a `Target` is returned as is).

    Args:
      destinations: a `DistributedValues`, a ``jax.Array`` (or a `cross_host.RemoteArray`), a
        device name such as ``"CPU:0"`` or ``"/job:worker/replica:0/task:1/device:CPU:0"``
        (another worker's device under `MultiWorkerMirroredStrategy`) or a ``jax.Device`` (of
        any process).

    Returns:
      The `Target`.

    Raises:
      InvalidArgumentError: ``destinations`` is empty or of another type.
      UnknownDeviceError: a device name that names no device of this job.
    """
    if isinstance(destinations, Target):
        return destinations
    if isinstance(destinations, DistributedValues):
        return _mirrored_on_mesh(replica_mesh.of_value(destinations))
    destinations = cross_host.unwrap(destinations)
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
    mesh = replica_mesh.for_devices(devices) if len(devices) > 1 else None
    return Target(1, False, devices, mesh)


def place(tensor, target: Target):
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
    x = cross_host.unwrap(tensor.value if isinstance(tensor, Mirrored) else tensor)
    x = x if isinstance(x, (jax.Array, np.ndarray)) else jnp.asarray(x)
    if isinstance(x, jax.core.Tracer):  # Inside a merge function: the program places it.
        return Mirrored._from_value(x, target.num_replicas) if target.mirrored else x
    if cross_host.is_global(x) or cross_host.active():
        return _place_across_processes(x, target)
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


def _place_across_processes(x, target):
    """`place` where ``x`` or the target spans processes (`cross_host`): a `Mirrored` value, an
    array, or on a worker that holds none of the target's devices a `cross_host.RemoteArray`."""
    if target.mesh is not None:
        sharding = target.mesh.replicated_sharding
    else:
        sharding = SingleDeviceSharding(target.devices[0])
    placed = cross_host.place(x, target.devices, sharding)
    if target.mirrored:
        return Mirrored._from_value(placed, target.num_replicas)
    return cross_host.as_result(placed)
