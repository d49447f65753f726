"""Where cross-device results go: destinations, the device sets behind values, their programs.

A `CrossDeviceOps` method receives values and destinations, not a strategy, so it finds the
devices from the values themselves (the mesh of a sharded array) and shares one
`collectives.ReplicaPrograms` per device tuple with the strategy over those devices (compiled
programs are reused). Destinations follow TF: a `DistributedValues` means "Mirrored on its
devices", a device name or ``jax.Device`` means "an array on that device", a ``jax.Array`` means
"on its devices"; anything else is an `InvalidArgumentError`.
"""

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import SingleDeviceSharding
from jax.sharding import NamedSharding

from jdist._src import collectives
from jdist._src import devices as devices_lib
from jdist._src import dispatch
from jdist._src import errors
from jdist._src.reduce_op import ReduceOp
from jdist._src.values import DistributedValues
from jdist._src.values import Mirrored
from jdist._src.values import PerReplica

AXIS = "replica"


class DeviceSet(DistributedValues):
    """A destination standing for "Mirrored over these devices" (the strategy's, or a mesh's)."""
    __slots__ = ("devices",)

    def __init__(self, devices):
        self.devices = tuple(devices)

    @property
    def num_replicas(self):
        return len(self.devices)


def validate_destinations(destinations):
    """Raises `InvalidArgumentError` unless ``destinations`` names devices (`CrossDeviceOps`)."""
    if isinstance(destinations, (DistributedValues, jax.Device)):
        return
    if isinstance(destinations, jax.Array) and not isinstance(destinations, jax.core.Tracer):
        return
    if isinstance(destinations, str):
        if not destinations.strip():
            raise errors.InvalidArgumentError(
                "destinations can not be empty; pass a device name such as 'CPU:0', a jax.Device "
                "or a DistributedValues.")
        devices_lib.resolve(destinations)
        return
    raise errors.InvalidArgumentError(
        "destinations must be a DistributedValues, a jax.Array, a device name such as 'CPU:0' "
        f"or a jax.Device; got {type(destinations).__name__}.")


def array_devices(x):
    """The devices of a concrete array, in mesh order when it has a mesh; None otherwise."""
    if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
        return None
    if isinstance(x.sharding, NamedSharding):
        return tuple(x.sharding.mesh.devices.flat)
    return tuple(sorted(x.sharding.device_set, key=lambda d: d.id))


def guard_for(devices):
    platform = devices[0].platform
    return dispatch.guard_for(platform, len(jax.local_devices(backend=platform)))


_programs = {}  # Device tuple -> ReplicaPrograms of a mesh over them.
_by_sharding = {}  # (sharding, n) -> ReplicaPrograms: the cheap lookup of a value's devices.
_programs_lock = threading.Lock()


def programs_for(devices):
    """The `collectives.ReplicaPrograms` of a 1-D mesh over ``devices`` (one per device tuple)."""
    devices = tuple(devices)
    with _programs_lock:
        if devices not in _programs:
            mesh = Mesh(np.array(devices), (AXIS,))
            _programs[devices] = collectives.ReplicaPrograms(mesh, AXIS, guard_for(devices))
        return _programs[devices]


def register_programs(programs):
    """Lets a strategy's `ReplicaPrograms` serve its devices, so compiled programs are shared."""
    with _programs_lock:
        _programs.setdefault(mesh_devices(programs), programs)


def mesh_devices(programs):
    return tuple(programs.per_replica_sharding.mesh.devices.flat)


def programs_of(array, n):
    """The programs of the ``n`` devices ``array`` spans; the first ``n`` local devices for a
    host value."""
    key = (array.sharding, n) if array_devices(array) is not None else None
    if key in _by_sharding:
        return _by_sharding[key]
    devices = array_devices(array)
    if devices is None or len(devices) != n:
        if n > len(jax.local_devices()):
            raise errors.InvalidArgumentError(
                f"a value with {n} replicas needs {n} devices; this process has fewer.")
        devices = jax.local_devices()[:n]
    programs = programs_for(devices)
    if key is not None:
        _by_sharding[key] = programs
    return programs


def destination_programs(destinations):
    """The programs of the devices a `DistributedValues` destination stands for."""
    if isinstance(destinations, DeviceSet):
        return programs_for(destinations.devices)
    array = destinations.stacked if isinstance(destinations, PerReplica) else (
        getattr(destinations, "value", None))
    return programs_of(array, destinations.num_replicas)


def destination_devices(destinations):
    if isinstance(destinations, DistributedValues):
        return mesh_devices(destination_programs(destinations))
    if isinstance(destinations, jax.Array):
        return array_devices(destinations)
    return (devices_lib.resolve(destinations),)


def as_per_replica(value):
    """``value`` as a `PerReplica` sharded over its devices (a Mirrored one is tiled); None for
    a plain tensor."""
    if isinstance(value, PerReplica):
        programs = programs_of(value.stacked, value.num_replicas)
        return PerReplica._from_stacked(programs.place_per_replica(value.stacked), value.lengths)
    if isinstance(value, Mirrored):
        programs = programs_of(value.value, value.num_replicas)
        tile = _tile_program(programs, value.num_replicas)
        return PerReplica._from_stacked(
            programs.guard.dispatch(tile, programs.place_replicated(value.value)))
    if isinstance(value, DistributedValues):
        raise errors.UnsupportedValueError(f"cannot reduce a {type(value).__name__}.")
    return None


@functools.lru_cache(maxsize=None)
def _tile_program(programs, n):
    return jax.jit(lambda v: jnp.broadcast_to(v, (n,) + v.shape),
                   out_shardings=programs.per_replica_sharding)


def strip_padding(programs, value):
    """The stacked array of ``value`` without padding rows (their lengths must agree)."""
    stacked, lengths = value.stacked, value.lengths
    if lengths is None:
        return stacked
    common = collectives.equal_lengths_or_raise(lengths, stacked.shape[1], "reduce")
    return stacked if common is None else programs.slice_rows(stacked, common)


def one_replica_value(op, x):
    x = x if isinstance(x, (jax.Array, np.ndarray)) else jnp.asarray(x)
    if op is ReduceOp.MEAN and not jnp.issubdtype(x.dtype, jnp.inexact):
        x = jnp.asarray(x).astype(collectives.mean_dtype(x.dtype))
    return x


def simple_broadcast(tensor, destinations):
    """Copies ``tensor`` to ``destinations``: `Mirrored` for a DistributedValues, else an array."""
    if isinstance(tensor, PerReplica):
        raise errors.UnsupportedValueError(
            "broadcast takes one tensor, not a PerReplica value; reduce it first.")
    x = tensor.value if isinstance(tensor, Mirrored) else tensor
    x = x if isinstance(x, (jax.Array, np.ndarray)) else jnp.asarray(x)
    if isinstance(destinations, DistributedValues):
        programs = destination_programs(destinations)
        if not (isinstance(x, jax.Array) and x.sharding == programs.replicated_sharding):
            x = programs.guard.dispatch(jax.device_put, x, programs.replicated_sharding)
        return Mirrored._from_value(x, programs.num_replicas)
    devices = destination_devices(destinations)
    if len(devices) == 1:
        sharding = SingleDeviceSharding(devices[0])
        if isinstance(x, jax.Array) and x.sharding.is_fully_replicated and (
                devices[0] in x.devices()):  # Already there: no copy.
            return next(s.data for s in x.addressable_shards if s.device == devices[0])
    else:
        sharding = programs_for(devices).replicated_sharding
    if not (isinstance(x, jax.Array) and x.sharding == sharding):
        x = guard_for(devices).dispatch(jax.device_put, x, sharding)
    return x
