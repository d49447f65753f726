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
