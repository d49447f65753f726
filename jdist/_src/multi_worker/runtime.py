"""The multi-worker runtime: which worker this is, ``jax.distributed``, and agreement.

* `Cluster` reads a cluster resolver as TF does: the ``chief`` (if any) then the ``worker``
  tasks; the first hosts JAX's coordination service.
* `initialize` starts ``jax.distributed`` once per process, or checks the running one matches.
* `Agreement` exchanges small JSON payloads through the coordination service's key-value store,
  never an XLA collective (whose mismatched shapes abort): what must be equal is compared there.
"""

import json
import threading
from typing import Any

import jax

from jdist._src import errors
from jdist._src import jax_internals

DEFAULT_TIMEOUT_SECONDS = 300.0
UNAVAILABLE_EXIT_CODE = 14  # TF's error code for UNAVAILABLE.
_JOBS = ("chief", "worker")


class Cluster:
    """The workers of a job, in process order, and this process's place among them.

    Raises:
      InvalidArgumentError: the cluster has jobs a multi-worker strategy cannot run (``ps``),
        or this task is not one of its workers.
    """

    def __init__(self, resolver: Any):
        spec = resolver.cluster_spec()
        jobs = spec.as_dict() if spec else {}
        unknown = sorted(set(jobs) - set(_JOBS) - {"evaluator"})
        if unknown:
            raise errors.InvalidArgumentError(
                f"MultiWorkerMirroredStrategy runs 'chief' and 'worker' tasks; the cluster also "
                f"has {unknown}. Parameter servers need ParameterServerStrategy, which jdist does "
                "not provide.")
        self.tasks = [(job, i) for job in _JOBS if job in jobs for i in spec.task_indices(job)]
        self.addresses = [spec.task_address(job, i) for job, i in self.tasks]
        task = (resolver.task_type, resolver.task_id)
        if len(self.tasks) <= 1 or task[0] == "evaluator":
            self.tasks, self.addresses, self.index = [("worker", 0)], [""], 0
        elif task not in self.tasks:
            raise errors.InvalidArgumentError(
                f"this process is task {task[0]}:{task[1]}, which is not among the cluster's "
                f"workers {self.tasks}; set TF_CONFIG's task (type, index) to one of them.")
        else:
            self.index = self.tasks.index(task)

    @property
    def num_workers(self) -> int:
        return len(self.tasks)

    @property
    def coordinator(self) -> str:
        """The address of the first worker (the chief when there is one)."""
        return self.addresses[0]

    def name(self, index: int) -> str:
        """A worker's name for messages: ``"worker 1 (task worker:0, host:port)"``."""
        job, i = self.tasks[index]
        return f"worker {index} (task {job}:{i}, {self.addresses[index]})"


def initialize(cluster: Cluster, timeout_seconds: float) -> None:
    """Starts ``jax.distributed`` for ``cluster`` (once per process); checks a running one.

    Raises:
      ClusterMismatchError: JAX runs already, with other processes or without distribution.
    """
    if jax.distributed.is_initialized():
        running = (jax.process_count(), jax.process_index())
        if running != (cluster.num_workers, cluster.index):
            raise errors.ClusterMismatchError(
                f"jax.distributed is already initialised as process {running[1]} of {running[0]}, "
                f"but the cluster makes this process worker {cluster.index} of "
                f"{cluster.num_workers}; initialise JAX from the same cluster, or let "
                "MultiWorkerMirroredStrategy do it.")
        return
    try:
        jax.distributed.initialize(
            coordinator_address=cluster.coordinator, num_processes=cluster.num_workers,
            process_id=cluster.index, initialization_timeout=int(max(timeout_seconds, 30)),
            heartbeat_timeout_seconds=int(timeout_seconds) + 30,
            shutdown_timeout_seconds=int(max(timeout_seconds, 10)))
    except RuntimeError as e:
        raise errors.ClusterMismatchError(
            f"cannot start jax.distributed for {cluster.num_workers} workers: {e}. Create "
            "MultiWorkerMirroredStrategy before anything uses JAX devices (jax.devices(), "
            "arrays, jit) in this process.") from e


class Agreement:
    """Exchanges small JSON payloads between all workers, in lockstep (see module doc)."""

    def __init__(self, cluster: Cluster, timeout_seconds: float):
        self._cluster = cluster
        self._timeout_ms = int(timeout_seconds * 1000)
        self._seq = 0
        self._lock = threading.Lock()

    def exchange(self, what: str, payload: Any) -> list:
        """Every worker's JSON-able ``payload``, in worker order; ``what`` names the operation.

        Raises:
          UnavailableError: a peer did not publish its payload within the timeout.
          InvalidArgumentError: a peer reached another exchange here (the workers run
            different sequences of distributed calls).
        """
        client, me = jax_internals.distributed_client(), self._cluster.index
        with self._lock:
            seq, self._seq = self._seq, self._seq + 1
            client.key_value_set(f"jdist/agree/{seq}/{me}", json.dumps([what, payload]))
            if seq >= 2:  # Every peer has read it: they all published seq - 1 after reading it.
                client.key_value_delete(f"jdist/agree/{seq - 2}/{me}")
            values = []
            for w in range(self._cluster.num_workers):
                try:
                    text = client.blocking_key_value_get(f"jdist/agree/{seq}/{w}",
                                                         self._timeout_ms)
                except Exception as e:  # pylint: disable=broad-except
                    raise errors.UnavailableError(
                        f"{what}: {self._cluster.name(w)} did not reach the same point within "
                        f"{self._timeout_ms / 1000:g} s ({type(e).__name__}); it has died, is "
                        "stuck, or runs a different sequence of distributed calls.") from e
                values.append(json.loads(text))
        whats = [w for w, _ in values]
        if len(set(whats)) != 1:
            raise errors.InvalidArgumentError(
                f"the workers are out of step: at distributed call #{seq} they reached "
                + "; ".join(f"{self._cluster.name(w)}: {x}" for w, x in enumerate(whats))
                + ". Every worker must make the same sequence of distributed calls (run, "
                "iterators of distributed datasets, distribute_values_from_function).")
        return [p for _, p in values]
