"""Results on the devices of other workers: placement across processes and remote arrays.

Under `MultiWorkerMirroredStrategy` a destination may be a device of another worker
(``"/job:worker/replica:0/task:1/device:CPU:0"``, a ``jax.Device`` of another process). Every
worker makes the same call (TF's between-graph replication), so placement works on the global
``jax.Array`` every worker describes alike:

* a global result replicated over the mesh keeps the shards of the destination devices
  (`keep_shards`): no communication, each worker keeps what it holds;
* a global value that lies elsewhere (on another worker's device) is first copied to every
  device by one collective program that EVERY process enters (`spread`);
* a local value (a host array, this worker's own ``jax.Array``) is taken to be the same on
  every worker, as for ``run``'s host arguments: each worker places its own copy on its own
  destination devices.

What a worker gets (`as_result`): the owner of a one-device destination a plain array on that
device; a worker holding some of several destination devices the global array (readable: it is
replicated); a worker holding none a `RemoteArray`, TF's remote tensor: it can be passed on to
``broadcast_to`` / ``reduce_to`` on every worker, and reading it raises
`errors.RemoteValueError` (its data lies only on the owner; a read would need a collective the
other workers do not enter).
"""

import functools
from typing import Any, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P
from jax.sharding import SingleDeviceSharding

from jdist._src import errors
from jdist._src.reduce import replica_mesh


class RemoteArray:
    """An array whose data lies only on other workers' devices (TF's remote tensor).

    Returned on the workers that hold none of the destination devices of ``reduce_to`` /
    ``broadcast_to``. Its shape, dtype and devices are known; reading it (``np.asarray``,
    ``float``, indexing, arithmetic, ``tolist``) raises `errors.RemoteValueError` (``jnp``
    functions reject it as a non-array, a ``TypeError``).
    Pass it (on every worker) to ``broadcast_to`` / ``reduce_to`` to bring the value to this
    worker's devices.

    Args:
      array: the global ``jax.Array`` (no shard of it on this process).

    Example:
      >>> import jax, numpy as np
      >>> r = RemoteArray(jax.numpy.zeros(2))   # A local array only stands in, for the example.
      >>> r.shape, str(r.dtype)
      ((2,), 'float32')
    """

    def __init__(self, array: jax.Array):
        self._array = array

    @property
    def array(self) -> jax.Array:
        """The global ``jax.Array`` (to pass to programs that every worker enters)."""
        return self._array

    shape = property(lambda self: self._array.shape, doc="The global shape.")
    dtype = property(lambda self: self._array.dtype, doc="The dtype.")
    ndim = property(lambda self: self._array.ndim, doc="The rank.")
    size = property(lambda self: self._array.size, doc="The number of elements.")
    sharding = property(lambda self: self._array.sharding, doc="The global sharding.")

    def devices(self) -> set:
        """The devices that hold the data (of other workers)."""
        return set(self._array.sharding.device_set)

    @property
    def owners(self) -> tuple:
        """The process indices (worker indices) that hold the data."""
        return tuple(sorted({d.process_index for d in self.devices()}))

    def block_until_ready(self) -> "RemoteArray":
        """Returns ``self``: nothing of it is computed on this worker."""
        return self

    def _read(self, *args, **kwargs):
        del args, kwargs
        raise errors.RemoteValueError(
            f"this value lies on {sorted(str(d) for d in self.devices())} of worker(s) "
            f"{list(self.owners)}, not on worker {jax.process_index()}: only its owner can "
            "read it. Reduce or broadcast to a DistributedValues (every worker's devices) or to "
            "one of this worker's devices instead, or pass it to strategy.extended.broadcast_to "
            "on every worker.")

    def __repr__(self):
        return (f"RemoteArray(shape={self.shape}, dtype={self.dtype}, on worker(s) "
                f"{list(self.owners)})")


for _name in ("__array__", "__float__", "__int__", "__bool__", "__index__",
              "__complex__", "__getitem__", "__iter__", "__neg__", "__pos__", "__abs__",
              "__invert__", "__lt__", "__le__", "__gt__", "__ge__", "item", "tolist", "numpy",
              "astype", "reshape", "sum", "mean") + tuple(
                  f"__{r}{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod",
                                            "pow", "matmul", "and", "or", "xor")
                  for r in ("", "r")):
    setattr(RemoteArray, _name, RemoteArray._read)


_exchange: list = []  # The multi-worker strategy's agreement: (what, payload) -> every payload.


def register_exchange(exchange) -> None:
    """Lets placement agree with the other workers (`multi_worker_runtime.Agreement.exchange`):
    a multi-worker strategy registers it; one process has none."""
    _exchange[:] = [exchange]


def active() -> bool:
    """Whether this process is one worker of several (placement may span processes)."""
    return bool(_exchange) and jax.process_count() > 1


def is_global(x: Any) -> bool:
    """Whether ``x`` is a concrete ``jax.Array`` with shards on other processes' devices."""
    return (isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
            and not x.is_fully_addressable)


def unwrap(x: Any) -> Any:
    """The global array of a `RemoteArray`; anything else as it is."""
    return x.array if isinstance(x, RemoteArray) else x


def place(x: Any, devices: Sequence[jax.Device], sharding: jax.sharding.Sharding) -> jax.Array:
    """``x`` replicated on ``devices`` (with ``sharding``), when several processes run.

    Every worker makes the same call. A global ``x`` on a device of every process (a reduce
    result, a `Mirrored` value) keeps the destinations' shards. Otherwise the workers first
    agree, through the coordination service, on where the value lies: if some hold it as a
    global array (a `RemoteArray`: the owner holds it as a local array), that copy is the
    value, moved by one collective program all processes enter when the destinations are
    elsewhere (`spread`); if every worker holds a local value, each places its own copy on its
    own destination devices (TF: each worker broadcasts its tensor).

    Args:
      x: a global array replicated on its devices, or a local value.
      devices: the destination devices, of any processes.
      sharding: the replicated sharding over ``devices``.

    Returns:
      The global array on ``devices`` (see `as_result` for what a worker is given).

    Raises:
      UnsupportedValueError: ``x`` is a global array that is not replicated.
      InvalidArgumentError: the workers passed values of different shapes or places.
    """
    if is_global(x) and not x.sharding.is_fully_replicated:
        raise errors.UnsupportedValueError(
            f"broadcast takes one tensor; got a global array split over its devices "
            f"({x.sharding}). Reduce or gather it first.")
    if is_global(x) and _on_every_process(x) and set(devices) <= x.sharding.device_set:
        return keep_shards(x, devices, sharding)
    if not isinstance(x, jax.Array):  # A host value, in the dtype JAX will give it.
        x = np.asarray(x)
        x = x.astype(jax.dtypes.canonicalize_dtype(x.dtype), copy=False)
    source = _agree_on_source(x)
    if source is None:  # Every worker holds its own value: each places its copy.
        return _assemble(x, devices, sharding)
    if not is_global(x):  # The owner's local copy, as the global array the others hold.
        x = _assemble(x, source, _replicated_on(source))
    if not set(devices) <= set(source):
        x = spread(x)
    return keep_shards(x, devices, sharding)


def _on_every_process(x):
    return len({d.process_index for d in x.sharding.device_set}) == jax.process_count()


def _agree_on_source(x):
    """The devices every worker agrees hold the value (None: each worker's own local value)."""
    order = jax.devices()
    mine = {"on": sorted(order.index(d) for d in x.sharding.device_set) if is_global(x) else
            None, "shape": list(x.shape), "dtype": str(x.dtype)}
    everyone = _exchange[0]("broadcast", mine)
    kinds = {(tuple(p["shape"]), p["dtype"]) for p in everyone}
    sources = {tuple(p["on"]) for p in everyone if p["on"] is not None}
    if len(kinds) != 1 or len(sources) > 1:
        raise errors.InvalidArgumentError(
            "broadcast: the workers passed different tensors (shape, dtype, devices: "
            f"{[(p['shape'], p['dtype'], p['on']) for p in everyone]}); every worker must pass "
            "the same value, e.g. the result of the same reduce_to.")
    return [order[i] for i in sources.pop()] if sources else None


def _replicated_on(devices):
    if len(devices) == 1:
        return SingleDeviceSharding(devices[0])
    return replica_mesh.for_devices(devices).replicated_sharding


def _assemble(x, devices, sharding):
    """``x`` (this worker's local value) on ``devices``: copies on this worker's ones only."""
    me = jax.process_index()
    local = [jax.device_put(x, d) for d in devices if d.process_index == me]
    return jax.make_array_from_single_device_arrays(x.shape, sharding, local, dtype=x.dtype)


def keep_shards(x: jax.Array, devices: Sequence[jax.Device],
                sharding: jax.sharding.Sharding) -> jax.Array:
    """A replicated global ``x`` restricted to ``devices`` (a subset of its devices): each
    worker keeps the shards it holds; no communication. A worker that keeps none waits for its
    part of the program that computed ``x`` (it would never wait for it otherwise, and could
    leave while its peers still need it in that collective)."""
    if x.sharding == sharding:
        return x
    wanted = set(devices)
    local = [s.data for s in x.addressable_shards if s.device in wanted]
    if not local:  # This worker keeps nothing it could wait on later: wait for its part now.
        jax.block_until_ready(x)
    return jax.make_array_from_single_device_arrays(x.shape, sharding, local, dtype=x.dtype)


def spread(x: jax.Array) -> jax.Array:
    """A global ``x`` replicated on some devices, copied to every device of every process.

    One compiled program over all devices (every process enters it): each device contributes
    its copy of ``x`` or zeros, an all-gather collects them and every device keeps the copy of
    ``x``'s first device, bit for bit.
    """
    mesh = replica_mesh.for_devices(jax.devices())
    everywhere = mesh.replicated_sharding
    if x.size == 0:
        return _assemble(np.zeros(x.shape, x.dtype), mesh.devices, everywhere)
    source = min(mesh.devices.index(d) for d in x.sharding.device_set)
    held = {s.device: s.data for s in x.addressable_shards}
    blocks = [jnp.expand_dims(held[d], 0) if d in held
              else jax.device_put(np.zeros((1,) + x.shape, x.dtype), d)
              for d in mesh.per_replica_sharding.addressable_devices]
    stacked = jax.make_array_from_single_device_arrays(
        (mesh.num_replicas,) + x.shape, mesh.per_replica_sharding, blocks)
    return mesh.guard.dispatch(_pick_program(mesh, source), stacked)


@functools.lru_cache(maxsize=None)
def _pick_program(mesh, source):
    def body(block):
        return lax.all_gather(block[0], mesh.axis_name)[source]
    return jax.jit(jax.shard_map(body, mesh=mesh.mesh, in_specs=(P(mesh.axis_name),),
                                 out_specs=P(), check_vma=False))


def as_result(x: jax.Array) -> Union[jax.Array, RemoteArray]:
    """What a worker is given for a placed array result (see the module doc)."""
    if not is_global(x):
        return x
    shards = x.addressable_shards
    if not shards:
        return RemoteArray(x)
    if len(x.sharding.device_set) == 1:
        return shards[0].data
    return x
