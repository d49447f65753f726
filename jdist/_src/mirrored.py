"""`MirroredStrategy` and `OneDeviceStrategy`: synchronous replicas on this process's devices.

Both keep one `ReplicaMesh` over their devices with the replica axis ``"replica"``
(the reduce wing's `ReplicaMesh`); values live as arrays sharded over it (`jdist._src.values`),
``run`` compiles to one SPMD program (the run wing's `ReplicatedRunner`), and ``reduce`` /
``gather`` are compiled collectives on the mesh, through the strategy's `CrossDeviceOps`. Every
launch goes through the platform's dispatch guard (`jdist._src.dispatch`), which on CPU keeps
collective programs from overlapping. The wings are reached through `jdist._src.base`.
"""

from typing import Optional

import jax
import numpy as np
from jax.sharding import Mesh

from jdist._src import devices as devices_lib
from jdist._src import dispatch
from jdist._src import errors
from jdist._src.base import REPLICA_AXIS
from jdist._src.base import reduce_wing
from jdist._src.base import run_wing
from jdist._src.strategy import Strategy
from jdist._src.strategy_extended import StrategyExtended
from jdist._src.values import ARRAYS
from jdist._src.values import PerReplica


class MirroredExtended(StrategyExtended):
    """`StrategyExtended` over a mesh of local devices, one replica per device."""

    # MultiWorkerExtended places values through a subclass (`multi_worker.MultiProcessMesh`);
    # None: the reduce wing's `ReplicaMesh`.
    _mesh_class: Optional[type] = None
    # TF's MirroredStrategy runs merge_fn on another thread than the replica's, outside its
    # gradient tape; OneDeviceStrategy's runs inline, where gradients flow (`merge`).
    _gradients_through_merge_call = False
    _ops_per_value = True  # TF's MirroredStrategy: int32 values go to ReductionToOneDevice.
    _one_replica_values_wrapped = True
    # The options a replica context's all_reduce merges its own into (TF: the strategy's).
    _all_reduce_options = None

    def __init__(self, container_strategy, devices, cross_device_ops=None):
        super().__init__(container_strategy, devices)
        platforms = {d.platform for d in self._devices}
        if len(platforms) != 1:
            raise errors.InvalidArgumentError(
                f"all replicas must be on one platform, got devices on {sorted(platforms)}.")
        self._platform = platforms.pop()
        self._mesh = Mesh(np.array(self._devices), (REPLICA_AXIS,))
        self._guard = dispatch.guard_for(self._platform, len(self._devices))
        mesh_class = self._mesh_class or reduce_wing().ReplicaMesh
        self._programs = mesh_class(self._mesh, REPLICA_AXIS, self._guard)
        self._runner = run_wing().ReplicatedRunner(container_strategy, self._programs)
        self._run = self._runner.run  # `run`'s path on every step: one Python frame fewer.
        # None picks the backend's all-reduce; the strategy's mesh serves ops on its devices.
        self._cross_device_ops = reduce_wing().resolve_ops(cross_device_ops, self._devices)
        # TF's default on several devices is CollectiveAllReduce: it all-reduces batch_reduce_to
        # results onto every replica device, and gathers all but int32 values itself.
        self._tf_collective_ops = cross_device_ops is None and len(self._devices) > 1
        reduce_wing().register_mesh(self._programs)
        self._mirrored_target = reduce_wing().mirrored_on(self._devices)

    @property
    def mesh(self):
        """The ``jax.sharding.Mesh`` of the replicas, with the single axis ``"replica"``."""
        return self._mesh

    @property
    def replica_axis(self):
        """The name of the mesh axis the replicas are laid along (``"replica"``)."""
        return REPLICA_AXIS

    def _replica_collectives(self, binding):
        if binding is None:
            return super()._replica_collectives(binding)
        return run_wing().replica_axis_collectives(
            binding, self._cross_device_ops, self._runner, self._num_replicas,
            self._gradients_through_merge_call, self._all_reduce_options)

    def _reduce_per_replica(self, op, value, axes):
        return self._cross_device_ops._reduce_to_mesh(self._programs, op, value, axes)

    def _by_collective_ops(self, dtype, reduces_one=False):
        # TF's MirroredStrategy hands int32 values to ReductionToOneDevice, and so every value
        # that one reduce_to sends to CPU destinations (all of them, on CPU devices).
        return self._tf_collective_ops and dtype != np.int32 and not reduces_one

    def _gather_per_replica(self, value, axis):
        return self._programs.gather(value.stacked, axis, value._lengths)

    def _check_host_arguments(self, in_tree, leaves):
        """Called by ``run`` before compiling a program for new arguments; one process has
        nothing to compare (`MultiWorkerExtended` checks that every worker passes the same)."""

    def _agree_uneven_step(self, signature):
        """Called by ``run`` before every exact step on ragged values; one process has no one
        to agree with (`MultiWorkerExtended` compares every worker's view of the shapes)."""

    def _distribute_components(self, components):
        """One value per replica, each on its replica's device: one sharded array when their
        shapes agree, else a ragged `PerReplica` (TF holds replicas of different shapes)."""
        arrays = [np.asarray(c) if not isinstance(c, jax.Array) else c for c in components]
        dtypes = {a.dtype for a in arrays}  # JAX's dtypes: typed PRNG keys too.
        if len(dtypes) != 1:
            raise errors.InvalidArgumentError(
                f"replica values must share a dtype, got {sorted(map(str, dtypes))}.")
        if len({tuple(a.shape) for a in arrays}) != 1:
            return PerReplica._from_components(jax.device_put(arrays, list(self._devices)))
        blocks = [jax.device_put(a[None], d) for a, d in zip(arrays, self._devices)]
        return PerReplica._from_stacked(jax.make_array_from_single_device_arrays(
            (len(blocks),) + tuple(blocks[0].shape[1:]), self._programs.per_replica_sharding,
            blocks))

    def _place_one_replica_value(self, value):
        """Arrays go onto the replica's device as `run`'s programs take them (no transfer per
        step); other objects stay as they are."""
        if isinstance(value, ARRAYS):
            return self._programs.place_replicated(value)
        return value

    def _wait_all(self):
        self._guard.wait()


class MirroredStrategy(Strategy):
    """Synchronous data parallelism over this process's devices (``tf.distribute.MirroredStrategy``).

    One replica per device; ``run`` compiles the replica function once into an SPMD program
    over all of them, and collectives lower to XLA's (``psum`` becomes NCCL on GPUs).

    Args:
      devices: the devices to use: jax devices or TF-style names (``"CPU:0"``, ``"/gpu:1"``).
        Default: every local device of the default backend.
      cross_device_ops: how values are combined across devices (a ``CrossDeviceOps``); None
        picks the backend's all-reduce.

    Raises:
      InvalidArgumentError: ``devices`` is empty, repeats a device or mixes platforms.
      UnknownDeviceError: a name does not match a local device.

    Example:
      >>> import jdist
      >>> s = jdist.MirroredStrategy(["cpu:0"])
      >>> s.num_replicas_in_sync
      1
    """

    def __init__(self, devices=None, cross_device_ops=None):
        if devices is None:
            resolved = jax.local_devices()
        else:
            if isinstance(devices, (str, jax.Device)):
                devices = [devices]
            try:
                devices = list(devices)
            except TypeError:
                raise errors.InvalidArgumentError(
                    "devices must be a list of devices or device names, got "
                    f"{type(devices).__name__}.") from None
            resolved = [devices_lib.resolve(d) for d in devices]
            if not resolved:
                raise errors.InvalidArgumentError("MirroredStrategy needs at least one device.")
            if len(set(resolved)) != len(resolved):
                raise errors.InvalidArgumentError(
                    f"devices must not repeat, got {list(devices)}; each replica needs its own "
                    "device.")
        super().__init__(MirroredExtended(self, resolved, cross_device_ops))


class OneDeviceStrategy(Strategy):
    """Runs on one device (``tf.distribute.OneDeviceStrategy``): same API, one replica.

    Useful to write code once and switch to `MirroredStrategy` later; values are placed on
    ``device`` and ``run`` compiles for it.

    Args:
      device: a jax device or a TF-style name such as ``"/gpu:0"``.

    Example:
      >>> import jax.numpy as jnp, jdist
      >>> s = jdist.OneDeviceStrategy("cpu:0")
      >>> float(s.reduce("sum", s.run(lambda: jnp.float32(2.0))))
      2.0
    """

    def __init__(self, device):
        super().__init__(_OneDeviceExtended(self, [devices_lib.resolve(device)]))


class _OneDeviceExtended(MirroredExtended):
    """`OneDeviceStrategy`'s: TF runs its merge_fn inline, inside the replica's gradient tape,
    and hands every value of a batch reduce back as it is (no cross-device ops to pick)."""

    _gradients_through_merge_call = True
    _ops_per_value = False
    _one_replica_values_wrapped = False
