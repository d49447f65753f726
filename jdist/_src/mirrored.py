"""`MirroredStrategy` and `OneDeviceStrategy`: synchronous replicas on this process's devices.

Both keep one mesh over their devices with the axis ``"replica"``: values are arrays sharded
over it, ``run`` compiles to one SPMD program (the run wing), ``reduce`` / ``gather`` are
compiled collectives through the strategy's `CrossDeviceOps` (the reduce wing), and every
launch goes through the platform's dispatch guard (`jdist._src.dispatch`).
"""

from typing import Any, Optional, Sequence, Union

import jax
import numpy as np
from jax.sharding import Mesh

from jdist._src import devices as devices_lib
from jdist._src import dispatch, errors
from jdist._src.base import REPLICA_AXIS, reduce_wing, run_wing
from jdist._src.strategy import Strategy
from jdist._src.strategy_extended import StrategyExtended
from jdist._src.values import ARRAYS, PerReplica


class MirroredExtended(StrategyExtended):
    """`StrategyExtended` over a mesh of local devices, one replica per device."""

    _mesh_class: Optional[type] = None  # None: the reduce wing's `ReplicaMesh`.
    # TF's MirroredStrategy runs merge_fn outside the replica's gradient tape (OneDevice inside).
    _gradients_through_merge_call = False
    _ops_per_value = True  # TF's MirroredStrategy: int32 values go to ReductionToOneDevice.
    _one_replica_values_wrapped = True
    _all_reduce_options = None  # What a replica's all_reduce options merge into (TF's).

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
        self._cross_device_ops = reduce_wing().resolve_ops(cross_device_ops, self._devices)
        # TF's default on several devices is CollectiveAllReduce.
        self._tf_collective_ops = cross_device_ops is None and len(self._devices) > 1
        reduce_wing().register_mesh(self._programs)
        self._mirrored_target = reduce_wing().mirrored_on(self._devices)

    @property
    def mesh(self) -> Mesh:  # type: ignore[override]
        """The ``jax.sharding.Mesh`` of the replicas, with the single axis ``"replica"``."""
        return self._mesh

    @property
    def replica_axis(self) -> str:
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
        # TF's MirroredStrategy reduces int32 values, and reduce_to's to CPU, on one device.
        return self._tf_collective_ops and dtype != np.int32 and not reduces_one

    def _gather_per_replica(self, value, axis):
        return self._programs.gather(value.stacked, axis, value._lengths)

    def _check_host_arguments(self, in_tree, leaves):
        """Before ``run`` compiles for new arguments (multi-worker: every worker's agree)."""

    def _agree_uneven_step(self, signature):
        """Before each exact step on ragged values (multi-worker: every worker's agree)."""

    def _distribute_components(self, components):
        """One value per replica on its device: one sharded array, or ragged ones."""
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
        """Arrays onto the replica's device as `run` takes them; other objects as they are."""
        if isinstance(value, ARRAYS):
            return self._programs.place_replicated(value)
        return value


class MirroredStrategy(Strategy):
    """Synchronous data parallelism over this process's devices (``tf.distribute.MirroredStrategy``).

    One replica per device; ``run`` compiles the replica function once into an SPMD program.

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
      >>> jdist.MirroredStrategy(["cpu:0", "cpu:1"]).num_replicas_in_sync
      2
    """

    def __init__(self, devices: Optional[Sequence[Union[str, jax.Device]]] = None,
                 cross_device_ops: Optional[Any] = None) -> None:
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

    Values are placed on ``device`` and ``run`` compiles for it.

    Args:
      device: a jax device or a TF-style name such as ``"/gpu:0"``.

    Example:
      >>> import jax.numpy as jnp, jdist
      >>> s = jdist.OneDeviceStrategy("cpu:0")
      >>> float(s.reduce("sum", s.run(lambda: jnp.float32(2.0))))
      2.0
    """

    def __init__(self, device: Union[str, jax.Device]) -> None:
        super().__init__(_OneDeviceExtended(self, [devices_lib.resolve(device)]))


class _OneDeviceExtended(MirroredExtended):
    """`OneDeviceStrategy`'s: TF runs its merge_fn inside the replica's gradient tape."""

    _gradients_through_merge_call = True
    _ops_per_value = False
    _one_replica_values_wrapped = False
