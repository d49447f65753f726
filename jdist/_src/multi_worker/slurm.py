"""`SlurmClusterResolver`: the cluster of a SLURM job step, from the variables ``srun`` sets.

As TF's resolver: tasks are packed onto the hosts in order, task ``k`` of a host listening on
``port_base + k``, and ranks are dealt to the jobs in the order of their names.
"""

import itertools
import os
import re
from typing import Any, Optional, Sequence, Union

from jdist._src import errors
from jdist._src.multi_worker.cluster_resolver import ClusterResolver
from jdist._src.multi_worker.cluster_resolver import ClusterSpec
from jdist._src.multi_worker.cluster_resolver import format_master_url

_RANGE = re.compile(r"^(?P<prefix>[^\[\],]*)\[(?P<ranges>[^\]]+)\](?P<rest>.*)$")
_REPEAT = re.compile(r"^(?P<count>\d+)(?:\(x(?P<times>\d+)\))?$")


def expand_hostlist(hostlist: str) -> list[str]:
    """Expands SLURM's compressed host list (``SLURM_STEP_NODELIST``).

    Example:
      >>> expand_hostlist("gpu[01-02,5],login")
      ['gpu01', 'gpu02', 'gpu5', 'login']
    """
    hosts = []
    for item in _split_top_level(hostlist):
        hosts.extend(_expand_item(item))
    return hosts


def _split_top_level(text):
    items, depth, current = [], 0, ""
    for ch in text.strip():
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += ch
    if current:
        items.append(current)
    return [i for i in items if i]


def _expand_item(item):
    match = _RANGE.match(item)
    if match is None:
        return [item]
    values = []
    for part in match.group("ranges").split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise errors.InvalidArgumentError(f"cannot parse the SLURM host list item {item!r}.")
        width = len(lo)
        values.extend(str(v).zfill(width) for v in range(int(lo), int(hi or lo) + 1))
    rests = _expand_item(match.group("rest")) if match.group("rest") else [""]
    return [match.group("prefix") + v + r for v, r in itertools.product(values, rests)]


def expand_tasks_per_node(text: str) -> list[int]:
    """Expands SLURM's tasks-per-node list (``SLURM_STEP_TASKS_PER_NODE``).

    Example:
      >>> expand_tasks_per_node("2(x2),1")
      [2, 2, 1]
    """
    counts = []
    for item in text.strip().split(","):
        match = _REPEAT.match(item.strip())
        if match is None:
            raise errors.InvalidArgumentError(f"cannot parse SLURM tasks per node {text!r}.")
        counts.extend([int(match.group("count"))] * int(match.group("times") or 1))
    return counts


def _env(name, *fallbacks):
    for key in (name,) + fallbacks:
        if key in os.environ:
            return os.environ[key]
    raise errors.InvalidArgumentError(
        f"{name} is not set: SlurmClusterResolver must run inside a SLURM job step (srun).")


class SlurmClusterResolver(ClusterResolver):
    """The cluster of a SLURM job step (``tf.distribute.cluster_resolver.SlurmClusterResolver``).

    Args:
      jobs: job name -> number of tasks; default ``{"worker": SLURM_STEP_NUM_TASKS}``.
      port_base: the port of the first task on each host.
      gpus_per_node: GPUs per host; default ``SLURM_GPUS_ON_NODE``, else the count in
        ``CUDA_VISIBLE_DEVICES``, else 0.
      gpus_per_task: GPUs per task; default ``gpus_per_node // tasks on the node``.
      tasks_per_node: tasks per host (an int for every host, or a list); default from
        ``SLURM_STEP_TASKS_PER_NODE``.
      auto_set_gpu: set ``CUDA_VISIBLE_DEVICES`` to this task's GPUs (before JAX starts).
      rpc_layer: prefix of `master` addresses.

    Raises:
      InvalidArgumentError: not inside a SLURM step, the jobs do not add up to the step's
        tasks, or more GPUs are asked for than a node has.

    Example:
      >>> import os
      >>> env = dict(SLURM_PROCID="1", SLURM_STEP_NUM_TASKS="2", SLURM_STEP_NODELIST="n[1-2]",
      ...            SLURM_STEP_TASKS_PER_NODE="1(x2)")
      >>> os.environ.update(env)
      >>> r = SlurmClusterResolver(auto_set_gpu=False)
      >>> r.cluster_spec().as_dict(), r.task_type, r.task_id
      ({'worker': ['n1:8888', 'n2:8888']}, 'worker', 1)
      >>> for k in env: del os.environ[k]
    """

    def __init__(self, jobs: Optional[dict[str, int]] = None, port_base: int = 8888,
                 gpus_per_node: Optional[int] = None, gpus_per_task: Optional[int] = None,
                 tasks_per_node: Union[int, Sequence[int], None] = None,
                 auto_set_gpu: bool = True, rpc_layer: Optional[str] = "grpc"):
        self._rank = int(_env("SLURM_PROCID"))
        num_tasks = int(_env("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"))
        hosts = expand_hostlist(_env("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"))
        if tasks_per_node is None:
            per_node = expand_tasks_per_node(
                _env("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"))
        elif isinstance(tasks_per_node, int):
            per_node = [tasks_per_node] * len(hosts)
        else:
            per_node = list(tasks_per_node)
        jobs = {"worker": num_tasks} if jobs is None else dict(jobs)
        if sum(jobs.values()) != num_tasks:
            raise errors.InvalidArgumentError(
                f"the jobs {jobs} ask for {sum(jobs.values())} tasks but the SLURM step has "
                f"{num_tasks}.")
        self.rpc_layer = rpc_layer
        self._gpus_per_node = _default_gpus() if gpus_per_node is None else int(gpus_per_node)
        addresses, local_slot = self._place_tasks(hosts, per_node, port_base)
        slots = per_node[hosts.index(addresses[self._rank].rsplit(":", 1)[0])]
        self._gpus_per_task = (self._gpus_per_node // max(slots, 1) if gpus_per_task is None
                               else int(gpus_per_task))
        if max(per_node) * self._gpus_per_task > self._gpus_per_node:
            raise errors.InvalidArgumentError(
                f"{max(per_node)} tasks x {self._gpus_per_task} GPUs per task is more than the "
                f"{self._gpus_per_node} GPUs of a node.")
        self._cluster = self._assign_jobs(jobs, addresses)
        if auto_set_gpu and self._gpus_per_task > 0:
            first = local_slot[self._rank] * self._gpus_per_task
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(
                str(g) for g in range(first, first + self._gpus_per_task))

    @staticmethod
    def _place_tasks(hosts, per_node, port_base):
        if len(per_node) != len(hosts):
            raise errors.InvalidArgumentError(
                f"SLURM lists {len(hosts)} hosts but tasks per node for {len(per_node)}.")
        addresses, local_slot = [], []
        for host, count in zip(hosts, per_node):
            for k in range(count):
                addresses.append(f"{host}:{port_base + k}")
                local_slot.append(k)
        return addresses, local_slot

    def _assign_jobs(self, jobs, addresses):
        cluster, start = {}, 0
        self.task_type, self.task_id = None, None
        for job in sorted(jobs):
            cluster[job] = addresses[start:start + jobs[job]]
            if start <= self._rank < start + jobs[job]:
                self.task_type, self.task_id = job, self._rank - start
            start += jobs[job]
        return ClusterSpec(cluster)

    def cluster_spec(self) -> ClusterSpec:
        """The `ClusterSpec` of the step's tasks."""
        return self._cluster

    def get_task_info(self) -> tuple[Optional[str], Optional[int]]:
        """``(task_type, task_id)`` of this process."""
        return self.task_type, self.task_id

    def master(self, task_type: Optional[str] = None, task_id: Optional[int] = None,
               rpc_layer: Optional[str] = None) -> str:
        """The address of the given task (default: this one), prefixed with the rpc layer."""
        task_type = self.task_type if task_type is None else task_type
        task_id = self.task_id if task_id is None else task_id
        if task_type is None or task_id is None:
            return ""
        return format_master_url(self._cluster.task_address(task_type, task_id),
                                 rpc_layer or self.rpc_layer)

    def num_accelerators(self, task_type: Optional[str] = None, task_id: Optional[int] = None,
                         config_proto: Any = None) -> dict[str, int]:
        """``{"GPU": gpus_per_task}`` (``{}`` without GPUs)."""
        return {"GPU": self._gpus_per_task} if self._gpus_per_task else {}


def _default_gpus():
    if "SLURM_GPUS_ON_NODE" in os.environ:
        return int(os.environ["SLURM_GPUS_ON_NODE"])
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    return len([g for g in visible.split(",") if g.strip()]) if visible else 0
