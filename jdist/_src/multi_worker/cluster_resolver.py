"""Cluster resolvers: the workers of a multi-worker job (``tf.distribute.cluster_resolver``).

A resolver gives `MultiWorkerMirroredStrategy` the cluster (a `ClusterSpec`), this process's
task (``task_type``, ``task_id``) and its accelerators. All are pure Python: nothing starts JAX.
"""

import json
import os
from typing import Any, Optional, Union

import jax

from jdist._src import errors

_TF_CONFIG = "TF_CONFIG"


class ClusterSpec:
    """A cluster: job names mapped to task addresses (``tf.train.ClusterSpec``).

    Args:
      cluster: a dict mapping job names to a list of ``"host:port"`` addresses (task ``i`` is
        the ``i``-th) or to a dict ``{task_index: address}`` (sparse jobs), or a `ClusterSpec`.
        Job names and addresses are strings, task indices non-negative ints.

    Example:
      >>> spec = ClusterSpec({"worker": ["h0:2222", "h1:2222"], "chief": {0: "c:2222"}})
      >>> spec.jobs, spec.num_tasks("worker"), spec.task_address("worker", 1)
      (['worker', 'chief'], 2, 'h1:2222')
      >>> spec.as_dict()
      {'worker': ['h0:2222', 'h1:2222'], 'chief': ['c:2222']}
    """

    def __init__(self, cluster: Union[dict, "ClusterSpec"]):
        if isinstance(cluster, ClusterSpec):
            cluster = cluster.as_dict()
        if not isinstance(cluster, dict):
            raise errors.InvalidArgumentError(
                f"ClusterSpec takes a dict of job name -> addresses, got {type(cluster).__name__}.")
        self._jobs = {}
        for job, tasks in cluster.items():
            if not isinstance(job, str):
                raise errors.InvalidArgumentError(f"job names must be strings, got {job!r}.")
            self._jobs[job] = _job_tasks(job, tasks)

    @property
    def jobs(self) -> list[str]:
        """The job names, in the order they were given."""
        return list(self._jobs)

    def num_tasks(self, job_name: str) -> int:
        """How many tasks ``job_name`` has."""
        return len(self._tasks(job_name))

    def task_indices(self, job_name: str) -> list[int]:
        """The task indices of ``job_name``, sorted."""
        return sorted(self._tasks(job_name))

    def task_address(self, job_name: str, task_index: int) -> str:
        """The address of task ``task_index`` of ``job_name`` (`InvalidArgumentError` if none)."""
        tasks = self._tasks(job_name)
        if task_index not in tasks:
            raise errors.InvalidArgumentError(
                f"no task with index {task_index!r} in job {job_name!r} (it has tasks "
                f"{sorted(tasks)}).")
        return tasks[task_index]

    def job_tasks(self, job_name: str) -> list[Optional[str]]:
        """The addresses of ``job_name`` by index, None where a sparse job has no task."""
        tasks = self._tasks(job_name)
        return [tasks.get(i) for i in range(max(tasks) + 1)] if tasks else []

    def as_dict(self) -> dict:
        """The cluster as a dict: a list of addresses for dense jobs, ``{index: address}`` else."""
        out: dict = {}
        for job, tasks in self._jobs.items():
            dense = sorted(tasks) == list(range(len(tasks)))
            out[job] = [tasks[i] for i in range(len(tasks))] if dense else dict(tasks)
        return out

    def _tasks(self, job_name):
        if job_name not in self._jobs:
            raise errors.InvalidArgumentError(
                f"no such job in the cluster: {job_name!r} (jobs: {self.jobs}).")
        return self._jobs[job_name]

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ClusterSpec) and self.as_dict() == other.as_dict()

    def __hash__(self) -> int:
        return hash(json.dumps(self.as_dict(), sort_keys=True, default=str))

    def __repr__(self) -> str:
        return f"ClusterSpec({self.as_dict()!r})"


def _job_tasks(job, tasks):
    if isinstance(tasks, dict):
        items = list(tasks.items())
    elif isinstance(tasks, (list, tuple)):
        items = list(enumerate(tasks))
    else:
        raise errors.InvalidArgumentError(
            f"the tasks of job {job!r} must be a list of addresses or a dict of index -> address, "
            f"got {type(tasks).__name__}.")
    out = {}
    for index, address in items:
        if isinstance(index, str) and index.isdigit():
            index = int(index)
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise errors.InvalidArgumentError(
                f"task indices of job {job!r} must be non-negative ints, got {index!r}.")
        if not isinstance(address, str):
            raise errors.InvalidArgumentError(
                f"task {index} of job {job!r} has address {address!r}; addresses are strings "
                "such as 'host:port'.")
        out[index] = address
    return out


def format_master_url(master: str, rpc_layer: Optional[str] = None) -> str:
    """``"rpc_layer://master"``, or ``master`` alone without an rpc layer."""
    return f"{rpc_layer}://{master}" if rpc_layer else master


def local_accelerators() -> dict[str, int]:
    """This process's accelerators by TF device type, e.g. ``{"GPU": 2}`` (CPUs are not counted)."""
    counts: dict[str, int] = {}
    for device in jax.local_devices():
        if device.platform != "cpu":
            kind = "GPU" if device.platform in ("gpu", "cuda", "rocm") else device.platform.upper()
            counts[kind] = counts.get(kind, 0) + 1
    return counts


class ClusterResolver:
    """Base class of cluster resolvers (``tf.distribute.cluster_resolver.ClusterResolver``).

    Subclasses implement `cluster_spec` and `master` and set ``task_type``, ``task_id`` and
    ``rpc_layer``.
    """

    task_type: Optional[str] = None
    task_id: Optional[int] = None
    rpc_layer: Optional[str] = None

    def cluster_spec(self) -> ClusterSpec:
        """The `ClusterSpec` of the job."""
        raise errors.UnsupportedValueError(
            f"{type(self).__name__} does not describe a cluster; implement cluster_spec().")

    def master(self, task_type: Optional[str] = None, task_id: Optional[int] = None,
               rpc_layer: Optional[str] = None) -> str:
        """The address of the master task (a TF 1.x notion); ``''`` when there is none."""
        raise errors.UnsupportedValueError(
            f"{type(self).__name__} does not name a master; implement master().")

    def num_accelerators(self, task_type: Optional[str] = None, task_id: Optional[int] = None,
                         config_proto: Any = None) -> dict[str, int]:
        """This process's accelerators by device type, e.g. ``{"GPU": 1}`` (``{}`` on CPU).

        JAX sees only its own process's devices, so only this task can be asked about.
        """
        return local_accelerators()

    @property
    def environment(self) -> str:
        """The environment TF would run in: ``''`` (not Google-internal)."""
        return ""


class TFConfigClusterResolver(ClusterResolver):
    """Reads the cluster from the ``TF_CONFIG`` environment variable, at each access (as TF).

    ``TF_CONFIG`` is a JSON object with ``cluster`` (job -> addresses), ``task`` (``type``,
    ``index``), and optionally ``rpc_layer`` and ``session_master``. Unset or empty, it means a
    single local worker: an empty `ClusterSpec` and ``task_type``/``task_id`` None. The
    constructor's arguments override ``task.type``, ``task.index``, ``rpc_layer`` and the
    environment (``''``).

    Example:
      >>> import json, os
      >>> os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": ["a:1", "b:2"]},
      ...                                       "task": {"type": "worker", "index": 1}})
      >>> r = TFConfigClusterResolver()
      >>> r.task_type, r.task_id, r.master(), r.cluster_spec().num_tasks("worker")
      ('worker', 1, 'b:2', 2)
      >>> del os.environ["TF_CONFIG"]
      >>> r.task_type is None, r.cluster_spec().as_dict()
      (True, {})
    """

    def __init__(self, task_type: Optional[str] = None, task_id: Optional[int] = None,
                 rpc_layer: Optional[str] = None, environment: Optional[str] = None):
        self._task_type = task_type
        self._task_id = task_id
        self._rpc_layer = rpc_layer
        self._environment = environment

    @property  # type: ignore[override]
    def task_type(self) -> Optional[str]:
        """This task's job name: the override, else ``TF_CONFIG``'s ``task.type``, else None."""
        if self._task_type is not None:
            return str(self._task_type)
        task = _tf_config().get("task", {})
        return str(task["type"]) if "type" in task else None

    @task_type.setter
    def task_type(self, task_type: Optional[str]) -> None:
        self._task_type = task_type

    @property  # type: ignore[override]
    def task_id(self) -> Optional[int]:
        """This task's index in its job: the override, else ``task.index``, else None."""
        if self._task_id is not None:
            return int(self._task_id)
        task = _tf_config().get("task", {})
        return int(task["index"]) if "index" in task else None

    @task_id.setter
    def task_id(self, task_id: Optional[int]) -> None:
        self._task_id = task_id

    @property  # type: ignore[override]
    def rpc_layer(self) -> Optional[str]:
        """The override, else ``TF_CONFIG``'s ``rpc_layer``, else None."""
        if self._rpc_layer is not None:
            return self._rpc_layer
        return _tf_config().get("rpc_layer")

    @rpc_layer.setter
    def rpc_layer(self, rpc_layer: Optional[str]) -> None:
        self._rpc_layer = rpc_layer

    @property
    def environment(self) -> Optional[str]:  # type: ignore[override]
        """The override given to the constructor (None without one)."""
        return self._environment

    def cluster_spec(self) -> ClusterSpec:
        """The `ClusterSpec` of ``TF_CONFIG``'s ``cluster`` (empty when there is none)."""
        return ClusterSpec(_tf_config().get("cluster", {}))

    def master(self, task_type: Optional[str] = None, task_id: Optional[int] = None,
               rpc_layer: Optional[str] = None) -> str:
        """``session_master`` when set; ``''`` for a one-task cluster; else the address of the
        task (default: this one), as ``"rpc_layer://host:port"`` with an rpc layer."""
        session_master = _tf_config().get("session_master")
        if session_master is not None:
            return session_master
        spec = self.cluster_spec()
        if not spec.jobs or (len(spec.jobs) == 1 and len(spec.job_tasks(spec.jobs[0])) == 1):
            return ""
        task_type = self.task_type if task_type is None else task_type
        task_id = self.task_id if task_id is None else task_id
        rpc_layer = self.rpc_layer if rpc_layer is None else rpc_layer
        address = spec.task_address(task_type, task_id)  # type: ignore[arg-type]  # None raises.
        return format_master_url(address, rpc_layer)


def _tf_config():
    text = os.environ.get(_TF_CONFIG, "")
    if not text.strip():
        return {}
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise errors.InvalidArgumentError(f"TF_CONFIG is not valid JSON ({e}): {text!r}.") from e
    if not isinstance(config, dict):
        raise errors.InvalidArgumentError(f"TF_CONFIG must be a JSON object, got {text!r}.")
    return config


class SimpleClusterResolver(ClusterResolver):
    """A resolver that returns what it was given (``SimpleClusterResolver``): ``master`` is what
    `master` returns without a task; ``num_accelerators`` (``{"GPU": 2}``) None asks this
    process's devices.

    Example:
      >>> r = SimpleClusterResolver({"worker": ["a:1", "b:2"]}, task_type="worker", task_id=0)
      >>> r.master(), r.master("worker", 1, rpc_layer="grpc")
      ('', 'grpc://b:2')
    """

    def __init__(self, cluster_spec: Union[dict, ClusterSpec], master: str = "",
                 task_type: Optional[str] = None, task_id: Optional[int] = None,
                 environment: str = "", num_accelerators: Optional[dict[str, int]] = None,
                 rpc_layer: Optional[str] = None):
        self._cluster_spec = ClusterSpec(cluster_spec)
        self._master = master
        self.task_type = task_type
        self.task_id = task_id
        self._environment = environment
        self._num_accelerators = num_accelerators
        self.rpc_layer = rpc_layer

    def cluster_spec(self) -> ClusterSpec:
        """The `ClusterSpec` given to the constructor."""
        return self._cluster_spec

    def master(self, task_type: Optional[str] = None, task_id: Optional[int] = None,
               rpc_layer: Optional[str] = None) -> str:
        """The given task's address if both are given, else the constructor's ``master``."""
        if task_type is not None and task_id is not None:
            address = self._cluster_spec.task_address(task_type, task_id)
        else:
            address = self._master
        return format_master_url(address, rpc_layer or self.rpc_layer)

    @property
    def environment(self) -> str:
        """The environment given to the constructor."""
        return self._environment

    def num_accelerators(self, task_type: Optional[str] = None, task_id: Optional[int] = None,
                         config_proto: Any = None) -> dict[str, int]:
        """The constructor's ``num_accelerators``, else this process's accelerators."""
        if self._num_accelerators is None:
            return local_accelerators()
        return dict(self._num_accelerators)
