"""Naming devices the way TensorFlow does: ``"CPU:0"``, ``"/gpu:1"``, ``"/job:w/task:0/device:GPU:0"``."""

import re

import jax

from jdist._src import errors

_DEVICE_RE = re.compile(r"(?:^|/)(?:device:)?(?P<kind>[A-Za-z]+):(?P<index>\d+)$")
_PLATFORM = {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}


def resolve(spec):
    """Returns the local jax device that ``spec`` names.

    Args:
      spec: a ``jax.Device``, or a TF-style name such as ``"CPU:0"``, ``"/gpu:1"`` or
        ``"/job:localhost/replica:0/task:0/device:GPU:0"`` (the index counts that platform's
        local devices).

    Returns:
      The ``jax.Device``.

    Raises:
      UnknownDeviceError: ``spec`` is not a device, names an unknown platform, or an index this
        process does not have.
    """
    if isinstance(spec, jax.Device):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise errors.UnknownDeviceError(
            f"{spec!r} is not a device; pass a jax.Device or a name such as 'CPU:0' or '/gpu:1'.")
    match = _DEVICE_RE.search(spec.strip())
    if match is None:
        raise errors.UnknownDeviceError(
            f"cannot parse device name {spec!r}; use the form 'CPU:0', '/gpu:1' or "
            "'/job:localhost/replica:0/task:0/device:GPU:0'.")
    kind, index = match.group("kind").lower(), int(match.group("index"))
    platform = _PLATFORM.get(kind)
    if platform is None:
        raise errors.UnknownDeviceError(f"unknown device type {kind!r} in {spec!r}.")
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


def name(device):
    """The TF-style name of a jax device, e.g. ``"/cpu:0"`` (index among its platform's devices)."""
    local = jax.local_devices(backend=device.platform)
    index = local.index(device) if device in local else device.id
    return f"/{device.platform}:{index}"


# ----------------------------------------------------------------- devices of every process
_TASK_RE = re.compile(r"/job:(?P<job>[^/]+)(?:/replica:\d+)?/task:(?P<task>\d+)")
_cluster_tasks: list = []  # The workers' (job, task) in process order; empty for one process.


def register_cluster(tasks):
    """Tells device naming the workers' ``(job, task)`` in process order (a multi-worker
    strategy calls it), so that ``"/job:worker/task:1/device:CPU:0"`` names process 1's device."""
    _cluster_tasks[:] = [tuple(t) for t in tasks]


def resolve_any(spec):
    """Returns the device of ANY process that ``spec`` names (a destination, not a replica).

    A name with a job and task (``"/job:worker/replica:0/task:1/device:CPU:0"``) names that
    worker's device (its index counts that worker's devices of the platform); a name without
    them, or with ``/job:localhost/task:0``, names a local device as `resolve` does.

    Args:
      spec: a ``jax.Device`` (of any process) or a TF-style device name.

    Returns:
      The ``jax.Device``.

    Raises:
      UnknownDeviceError: no such worker or device.

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
    kind, index = _kind_index(spec)
    return find_device(jax.devices(), process, _PLATFORM.get(kind), index, spec)


def find_process(job, task, tasks):
    """The process index of worker ``job:task`` among ``tasks`` (the cluster's, in process
    order); one process (no tasks) is ``localhost:0`` or ``worker:0``.

    Raises:
      UnknownDeviceError: the task is not one of the workers.

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


def find_device(devices, process, platform, index, spec):
    """The ``index``-th ``platform`` device of ``process`` among ``devices`` (jax's, or any
    objects with ``process_index`` and ``platform``).

    Raises:
      UnknownDeviceError: that worker has fewer such devices.
    """
    own = [d for d in devices if d.process_index == process and d.platform == platform]
    if platform is None or index >= len(own):
        raise errors.UnknownDeviceError(
            f"{spec!r} names {platform} device {index} of worker {process}, which has "
            f"{len(own)} {platform} device(s).")
    return own[index]


def _kind_index(spec):
    match = _DEVICE_RE.search(spec.strip())
    if match is None:
        raise errors.UnknownDeviceError(
            f"cannot parse device name {spec!r}; use the form "
            "'/job:worker/replica:0/task:1/device:CPU:0'.")
    kind = match.group("kind").lower()
    if kind not in _PLATFORM:
        raise errors.UnknownDeviceError(f"unknown device type {kind!r} in {spec!r}.")
    return kind, int(match.group("index"))
