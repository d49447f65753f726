"""`MultiWorkerMirroredStrategy`: synchronous replicas on the devices of several processes.

ONE replica axis over ``jax.devices()`` (every process's devices, in process order) makes
``run`` the same ``jit(shard_map)`` program as `MirroredStrategy`'s, its collectives spanning
all workers. What differs is how host data enters and leaves global arrays: each worker holds
only its own replicas' blocks, and what must agree across workers is compared through the
coordination service before a collective needs it (`multi_worker_runtime.Agreement`). With one
worker (no ``TF_CONFIG``) it is `MirroredStrategy` over the local devices.
"""

import atexit
import functools
from typing import Any, Optional

import jax
import numpy as np

from jdist._src import devices as devices_lib
from jdist._src import errors
from jdist._src.input import batches as input_batches
from jdist._src.multi_worker import arguments as multi_worker_arguments
from jdist._src.multi_worker import input as multi_worker_input
from jdist._src.multi_worker import runtime
from jdist._src.reduce import packing
from jdist._src.reduce import replica_mesh
from jdist._src.multi_worker import ragged as uneven_multi_worker
from jdist._src.multi_worker.cluster_resolver import TFConfigClusterResolver
from jdist._src.host_values import check_host_numbers
from jdist._src.host_values import python_numbers_as_tf
from jdist._src.mirrored import MirroredExtended
from jdist._src.strategy import Strategy
from jdist._src.values import ARRAYS
from jdist._src.values import Mirrored
from jdist._src.values import PerReplica
from jdist._src.values import SCALARS
from jdist._src.values import spans_workers
from jdist._src.values import is_distributed
from jdist._src.values import is_step_output
from jdist._src.multi_worker.watchdog import Watchdog


class MultiProcessMesh(replica_mesh.ReplicaMesh):
    """A `replica_mesh.ReplicaMesh` spanning processes: a local value (taken to be equal on every
    worker) is placed from host memory, since JAX cannot copy a device array to another host; a
    global array is resharded by a compiled identity."""

    def place_per_replica(self, stacked):
        if isinstance(stacked, jax.Array) and not stacked.is_fully_addressable:
            return self._resharded(stacked, self.per_replica_sharding)
        return super().place_per_replica(np.asarray(stacked))

    def place_replicated(self, value):
        if isinstance(value, jax.Array) and not value.is_fully_addressable:
            return self._resharded(value, self.replicated_sharding)
        return super().place_replicated(np.asarray(value))

    def _resharded(self, value, sharding):
        return value if value.sharding == sharding else self.guard.dispatch(
            _reshard(sharding), value)


# bytes_per_pack that puts every value of a dtype into one pack: one all-reduce per dtype.
_ONE_PACK = 1 << 40


def _in_step_options(options, cluster, platform):
    """``all_reduce``'s default options: across CPU processes one pack per dtype (gloo: ~1 ms)."""
    if cluster.num_workers == 1 or platform != "cpu" or options.bytes_per_pack:
        return options
    return packing.CommunicationOptions(_ONE_PACK, options.timeout_seconds,
                                        options.implementation)


@functools.lru_cache(maxsize=None)
def _reshard(sharding):
    return jax.jit(lambda x: x, out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _max_program(sharding):
    return jax.jit(lambda x: x.max(), out_shardings=sharding)


class MultiWorkerExtended(MirroredExtended):
    """`MirroredExtended` over the global ``devices`` of every worker, process by process."""

    _mesh_class = MultiProcessMesh
    _ops_per_value = False  # TF's collective strategy all-reduces every value alike.

    def __init__(self, container_strategy, devices, cluster, options):
        super().__init__(container_strategy, devices)
        self._cluster = cluster
        self._options = options
        self._all_reduce_options = _in_step_options(options, cluster, self._platform)
        self._agreement = _runtime_services(cluster, options, self._guard)
        me = jax.process_index()
        self._local_ids = tuple(i for i, d in enumerate(self._devices) if d.process_index == me)
        self._device_names = tuple(_tf_name(cluster, d) for d in self._devices)
        if cluster.num_workers > 1:  # "/job:worker/task:1/device:CPU:0" names worker 1's device.
            devices_lib.register_cluster(cluster.tasks)

    def _by_collective_ops(self, dtype, reduces_one=False):  # TF's, for every value.
        return self._num_replicas > 1

    def _as_worker_values(self, value):
        return jax.tree_util.tree_map(self._as_worker_value, value, is_leaf=is_distributed)

    def _as_worker_value(self, value):
        """A plain value reduced or gathered across workers is this worker's, as in TF: a
        `PerReplica` of it with one replica per worker (refused with several); so is a
        `Mirrored` result of ``reduce_to`` / ``broadcast_to`` there (``run``'s are not)."""
        if self._cluster.num_workers == 1 or isinstance(value, PerReplica):
            return value
        if isinstance(value, Mirrored):
            if (len(self._local_ids) != 1 or is_step_output(value)
                    or isinstance(value.value, jax.core.Tracer)):
                return value  # TF's Mirrored (MEAN: itself, SUM refused), or run's result.
            value = value.values[0]
        if isinstance(value, jax.core.Tracer) or not isinstance(value, (*ARRAYS, *SCALARS)):
            return value  # A merge function's traced value; None, objects: the usual rules.
        if len(self._local_ids) != 1:
            raise errors.InvalidArgumentError(
                f"a non-distributed value ({type(value).__name__}) reduced or gathered across "
                "workers with several replicas per worker: TF takes it as this worker's value, "
                "and its result then depends on the call (a SUM along an axis counts it once per "
                "local replica). Pass a PerReplica instead, e.g. "
                "strategy.experimental_distribute_values_from_function(lambda ctx: value).")
        # Host numbers stay on the host: the exchange records every worker's int64 numbers.
        host = python_numbers_as_tf(value) if isinstance(value, SCALARS) else value
        check_host_numbers(host)  # Before it is placed: JAX would narrow 64-bit numbers.
        return self._distribute_components([host])

    @property
    def should_checkpoint(self):
        """True on the chief (worker 0 when there is no chief): only it saves checkpoints."""
        return self._cluster.index == 0

    should_save_summary = should_checkpoint  # should_init stays true: every worker initialises.

    @property
    def experimental_between_graph(self):
        """True: every worker runs its own copy of the program (TF's between-graph replication)."""
        return True

    @property
    def worker_index(self) -> int:
        """This worker's index: the process index, 0 for the chief."""
        return self._cluster.index

    @property
    def num_workers(self) -> int:
        """How many workers (processes) the strategy spans."""
        return self._cluster.num_workers

    def _local_replica_ids(self):
        return self._local_ids

    def _input_pipeline(self):
        return self._cluster.num_workers, self._cluster.index

    @property
    def cluster(self) -> runtime.Cluster:
        """The `multi_worker_runtime.Cluster` of this worker."""
        return self._cluster

    @property
    def agreement(self) -> Optional[runtime.Agreement]:
        """The `multi_worker_runtime.Agreement` (None with one worker)."""
        return self._agreement

    def _any_worker(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any worker: one tiny compiled max over the replicas (no
        exchange), so every worker calling it at the same point reads the same value."""
        local = np.full((len(self._local_ids),), flag, np.int32)
        flags = jax.make_array_from_process_local_data(
            self._programs.per_replica_sharding, local, (self._num_replicas,))
        program = _max_program(self._programs.replicated_sharding)
        return bool(np.asarray(self._guard.dispatch(program, flags).addressable_data(0)))

    def _replica_ids_by_worker(self):
        """Per worker, the global ids of its replicas (its devices in ``jax.devices()``)."""
        return [tuple(i for i, d in enumerate(self._devices) if d.process_index == w)
                for w in range(self._cluster.num_workers)]

    def _input_placer(self, strategy, options):
        placer = (input_batches.Placer if self._cluster.num_workers == 1
                  else uneven_multi_worker.RaggedRowsPlacer)
        return placer(strategy, options.experimental_fetch_to_device)

    def _per_worker_feed(self, source, dealer):
        """A PER_WORKER pipeline kept in step with the other workers'."""
        return multi_worker_input.per_worker_feed(self, source, dealer)

    def _check_host_arguments(self, in_tree, leaves):
        """At each new program of ``run``: raises on every worker unless the arguments agree."""
        if self._agreement is not None:
            multi_worker_arguments.check_equal(self._agreement, self._cluster, in_tree, leaves)

    def _agree_uneven_step(self, signature):
        """Before every exact step on ragged values: every worker must see the same shapes."""
        if self._agreement is not None:
            uneven_multi_worker.agree_step(self._agreement, self._cluster, signature)

    def _combinable(self, value):
        """A ragged value spanning workers, padded: reduce and gather combine it across hosts."""
        if not value.ragged or not spans_workers(value):
            return value
        return uneven_multi_worker.as_padded(self.mesh, self.replica_axis, value)

    def _distribute_components(self, components):
        """One global array from THIS worker's components; shapes agreed with the other workers."""
        if self._agreement is None:
            return super()._distribute_components(components)
        arrays = [np.asarray(c) for c in components]
        shapes = self._agreement.exchange(
            "experimental_distribute_values_from_function",
            [[list(a.shape), str(a.dtype)] for a in arrays])
        _check_one_dtype(self._cluster, shapes)
        everyone = [tuple(s) for worker in shapes for s, _ in worker]
        if len(set(everyone)) != 1:  # Ragged (TF holds replicas of different shapes).
            return uneven_multi_worker.ragged_from_local(
                self._devices, self._local_ids, arrays, everyone, arrays[0].dtype)
        local = np.stack(arrays)
        return PerReplica._from_stacked(jax.make_array_from_process_local_data(
            self._programs.per_replica_sharding, local, (self._num_replicas,) + local.shape[1:]))


def _check_one_dtype(cluster, shapes):
    """Raises (on every worker alike) unless every worker's replica values share one dtype."""
    if len({d for worker in shapes for _, d in worker}) != 1:
        by_worker = "; ".join(f"{cluster.name(w)}: {[d for _, d in worker]}"
                              for w, worker in enumerate(shapes))
        raise errors.InvalidArgumentError(f"replica values must share a dtype, got {by_worker}.")


def _tf_name(cluster, device):
    one = cluster.num_workers == 1
    job, task = ("localhost", 0) if one else cluster.tasks[device.process_index]
    local = [d for d in jax.devices() if d.process_index == device.process_index]
    return (f"/job:{job}/replica:0/task:{task}/device:{device.platform.upper()}:"
            f"{local.index(device)}")


_services: dict = {}


def _runtime_services(cluster, options, guard):
    """The process's `Agreement` and started `Watchdog` (one each), or None for one worker."""
    if cluster.num_workers == 1:
        return None
    if "agreement" not in _services:
        timeout = options.timeout_seconds or runtime.DEFAULT_TIMEOUT_SECONDS
        watchdog = Watchdog(cluster, timeout)
        guard.observer = watchdog.note_launch
        watchdog.start()
        _register_exit(watchdog.stop)
        _services["agreement"] = runtime.Agreement(cluster, timeout)
    return _services["agreement"]


def _register_exit(fn):
    """Before jax.distributed's own atexit shutdown barrier: threading's exit hooks run first."""
    try:
        import threading  # pylint: disable=import-outside-toplevel
        threading._register_atexit(fn)  # pylint: disable=protected-access
    except (AttributeError, RuntimeError):  # pragma: no cover - other Pythons / late import.
        atexit.register(fn)


class MultiWorkerMirroredStrategy(Strategy):
    """Synchronous data parallelism over the devices of several workers.

    ``tf.distribute.MultiWorkerMirroredStrategy`` on ``jax.distributed``: one replica per
    device of every worker; ``run``, ``reduce``, ``gather`` and the replica context's
    collectives combine all of them. Every worker runs the same script; start them with
    ``python -m jdist.launch --nproc N script.py`` locally, or with ``TF_CONFIG`` (or a
    `SlurmClusterResolver`) on a cluster. Create the strategy before anything else uses JAX.

    A peer that dies or never reaches a collective ends every other worker after
    ``communication_options.timeout_seconds`` (default 300 s): `errors.UnavailableError`, exit
    status 14 (``docs/multi_worker.md``).

    Args:
      cluster_resolver: default `TFConfigClusterResolver` (``TF_CONFIG``; unset: one worker).
      communication_options: a `CommunicationOptions` (``timeout_seconds``: see above).

    Raises:
      ClusterMismatchError: JAX was started already with another cluster, or used before.
      InvalidArgumentError: the cluster has tasks other than chief/worker, or lacks this task.

    Example:
      >>> import jdist
      >>> s = jdist.MultiWorkerMirroredStrategy()   # No TF_CONFIG: this process's devices.
      >>> s.num_replicas_in_sync, s.extended.should_checkpoint, s.cluster_resolver.task_type
      (8, True, None)
    """

    def __init__(self, cluster_resolver: Any = None,
                 communication_options: Optional[packing.CommunicationOptions] = None) -> None:
        resolver = TFConfigClusterResolver() if cluster_resolver is None else cluster_resolver
        options = packing.as_options(communication_options)
        cluster = runtime.Cluster(resolver)
        if cluster.num_workers > 1:
            runtime.initialize(cluster, options.timeout_seconds or runtime.DEFAULT_TIMEOUT_SECONDS)
            devices = jax.devices()
        else:
            devices = jax.local_devices()
        self._cluster_resolver = resolver
        super().__init__(MultiWorkerExtended(self, devices, cluster, options))

    @property
    def cluster_resolver(self) -> Any:
        """The cluster resolver the strategy was built from."""
        return self._cluster_resolver

    def configure(self, session_config: Any = None, cluster_spec: Any = None,
                  task_type: Optional[str] = None, task_id: Optional[int] = None) -> None:
        """Checks that ``cluster_spec`` / ``task_type`` / ``task_id`` describe this strategy's job.

        JAX's distributed runtime starts once per process, with the strategy, so the cluster
        cannot change (`errors.ClusterMismatchError`); ``session_config`` has no JAX meaning.
        """
        if cluster_spec is None:
            return
        from jdist._src.multi_worker.cluster_resolver import SimpleClusterResolver  # pylint: disable=import-outside-toplevel
        cluster = self._extended._cluster
        own_type, own_id = cluster.tasks[cluster.index]
        asked = runtime.Cluster(SimpleClusterResolver(
            cluster_spec, task_type=own_type if task_type is None else task_type,
            task_id=own_id if task_id is None else task_id))
        if (asked.tasks, asked.index) != (cluster.tasks, cluster.index) and (
                asked.num_workers > 1 or cluster.num_workers > 1):
            raise errors.ClusterMismatchError(
                f"configure() describes worker {asked.index} of {asked.tasks}, but the strategy "
                f"runs as worker {cluster.index} of {cluster.tasks}; jax.distributed starts once "
                "per process: pass the cluster when creating the strategy (cluster_resolver=).")
