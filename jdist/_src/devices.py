"""Naming devices the way TensorFlow does: ``"CPU:0"``, ``"/gpu:1"``, ``"/job:w/task:0/device:GPU:0"``."""

import re
from typing import Any, Optional, Sequence

import jax

from jdist._src import errors

_DEVICE_RE = re.compile(r"(?:^|/)(?:device:)?(?P<kind>[A-Za-z]+):(?P<index>\d+)$")
_PLATFORM = {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}


def resolve(spec: Any) -> jax.Device:
    """Returns the local jax device that ``spec`` names.

    Args:
      spec: a ``jax.Device``, or a TF-style name such as ``"CPU:0"`` or ``"/gpu:1"`` (the
        index counts that platform's local devices).

    Returns:
      The ``jax.Device``.

    Raises:
      UnknownDeviceError: ``spec`` names no device of this process.

    Example:
      >>> resolve("/cpu:1") == jax.local_devices()[1]
      True
    """
    if isinstance(spec, jax.Device):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise errors.UnknownDeviceError(
            f"{spec!r} is not a device; pass a jax.Device or a name such as 'CPU:0' or '/gpu:1'.")
    kind, index = _kind_index(spec, "'CPU:0', '/gpu:1' or "
                                    "'/job:localhost/replica:0/task:0/device:GPU:0'")
    platform = _PLATFORM[kind]
    try:
        local = jax.local_devices(backend=platform)
    except RuntimeError:
        local = []
    if index >= len(local):
        raise errors.UnknownDeviceError(
            f"{spec!r} names {platform} device {index}, but this process has {len(local)} "
            f"{platform} device(s). For simulated CPU devices set "
            "XLA_FLAGS=--xla_force_host_platform_device_count=N before importing jax.")
    return local[index]


def name(device: jax.Device) -> str:
    """The TF-style name of a jax device, e.g. ``"/cpu:0"`` (index among its platform's devices)."""
    local = jax.local_devices(backend=device.platform)
    index = local.index(device) if device in local else device.id
    return f"/{device.platform}:{index}"


# Devices of every process.
_TASK_RE = re.compile(r"/job:(?P<job>[^/]+)(?:/replica:\d+)?/task:(?P<task>\d+)")
_cluster_tasks: list = []  # The workers' (job, task) in process order; empty for one process.


def register_cluster(tasks: Sequence[tuple]) -> None:
    """Sets the workers' ``(job, task)`` in process order (a multi-worker strategy's), so that
    ``"/job:worker/task:1/device:CPU:0"`` names process 1's device."""
    _cluster_tasks[:] = [tuple(t) for t in tasks]


def resolve_any(spec: Any) -> jax.Device:
    """Returns the device of ANY process that ``spec`` names (a destination, not a replica):
    a name with a job and task names that worker's device; others resolve as `resolve` does.

    Example:
      >>> resolve_any("/job:localhost/replica:0/task:0/device:CPU:1") == jax.devices()[1]
      True
    """
    if isinstance(spec, jax.Device) or not isinstance(spec, str):
        return resolve(spec)
    task = _TASK_RE.search(spec)
    if task is None or (task.group("job"), int(task.group("task"))) == ("localhost", 0):
        return resolve(spec)
    process = find_process(task.group("job"), int(task.group("task")), _cluster_tasks)
    kind, index = _kind_index(spec, "'/job:worker/replica:0/task:1/device:CPU:0'")
    return find_device(jax.devices(), process, _PLATFORM.get(kind), index, spec)


def find_process(job: str, task: int, tasks: Sequence[tuple]) -> int:
    """The process index of worker ``job:task`` among ``tasks`` (in process order; none: one
    process, ``worker:0``); raises `UnknownDeviceError` for another task.

    Example:
      >>> find_process("worker", 1, [("chief", 0), ("worker", 0), ("worker", 1)])
      2
    """
    known = list(tasks) or [("worker", 0)]
    if (job, task) in known:
        return known.index((job, task))
    raise errors.UnknownDeviceError(
        f"/job:{job}/task:{task} is not a worker of this job (workers: "
        f"{', '.join(f'/job:{j}/task:{t}' for j, t in known)}); name one of them, or a local "
        "device such as 'CPU:0'.")


def find_device(devices: Sequence[Any], process: int, platform: Optional[str], index: int,
                spec: str) -> Any:
    """The ``index``-th ``platform`` device of ``process`` among ``devices``; raises
    `UnknownDeviceError` where that worker has fewer."""
    own = [d for d in devices if d.process_index == process and d.platform == platform]
    if platform is None or index >= len(own):
        raise errors.UnknownDeviceError(
            f"{spec!r} names {platform} device {index} of worker {process}, which has "
            f"{len(own)} {platform} device(s).")
    return own[index]


def _kind_index(spec, forms):
    match = _DEVICE_RE.search(spec.strip())
    if match is None:
        raise errors.UnknownDeviceError(f"cannot parse device name {spec!r}; use the form {forms}.")
    kind = match.group("kind").lower()
    if kind not in _PLATFORM:
        raise errors.UnknownDeviceError(f"unknown device type {kind!r} in {spec!r}.")
    return kind, int(match.group("index"))
