"""What a device can hold, host numbers it would hold as other numbers, and fast placement.

Every value jdist places on devices passes here first, so that a string or an object
(`is_placeable`) or a 64-bit number JAX would narrow (`check_host_numbers`) raises a typed
error at the call that placed it. The placement helpers let JAX's CPU client alias host memory.
"""

import functools
import os
import sys
import types
import warnings
from typing import Any, Iterator, Optional, Sequence

import jax
import numpy as np

from jdist._src import errors, jax_internals

# The dtype kinds a PerReplica may hold: its components must all be of one (TF's rule).
_KINDS = (("bool", np.bool_), ("signed integer", np.signedinteger),
          ("unsigned integer", np.unsignedinteger), ("floating-point", np.floating),
          ("complex", np.complexfloating), ("PRNG key", jax.dtypes.prng_key))


@functools.lru_cache(maxsize=None)  # jnp.issubdtype costs microseconds, read per value.
def dtype_kind(dtype: Any) -> Optional[str]:
    """The kind of ``dtype`` ("bool", "signed integer", ...); None where no device holds it."""
    return next((name for name, category in _KINDS if jax.numpy.issubdtype(dtype, category)),
                None)


_NUMPY = (np.ndarray, np.generic)  # Host values: what JAX converts to its own dtypes.
SCALARS = (bool, int, float, complex)  # Python numbers (NumPy's are arrays).


def held_narrower(value: Any) -> "np.dtype | None":
    """The narrower dtype JAX holds NumPy ``value`` in (64-bit without x64), else None."""
    if not isinstance(value, _NUMPY) or value.dtype.kind not in "iufc":
        return None
    held = jax.dtypes.canonicalize_dtype(value.dtype)
    return None if held == value.dtype else held


ALIGNMENT = 64  # Bytes: host memory at such an address is what XLA's CPU buffers can alias.


def aligned_empty(shape: Sequence[int], dtype: Any) -> np.ndarray:
    """An uninitialised host array at an `ALIGNMENT`-aligned address (placed without a copy)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def owned_copy(array: np.ndarray) -> np.ndarray:
    """A read-only, aligned copy of ``array`` that later writes to it leave as it is (TF's
    ``from_tensor_slices`` keeps one).

    Example:
      >>> x = np.ones(3); kept = owned_copy(x); x[:] = 7
      >>> kept.tolist(), kept.flags.writeable
      ([1.0, 1.0, 1.0], False)
    """
    if array.dtype.hasobject or not array.dtype.itemsize:  # Not viewable from raw bytes.
        copy = np.array(array, copy=True)
    else:
        copy = aligned_empty(array.shape, array.dtype)
        np.copyto(copy, array)
    return read_only(copy)


def read_only(array: Any) -> Any:
    """``array`` made read-only where it is a NumPy array (device buffers may alias it)."""
    if isinstance(array, np.ndarray):
        array.flags.writeable = False
    return array


def held_copy(array: np.ndarray) -> np.ndarray:
    """``array`` in the dtype JAX holds it in, in aligned memory (placed without another copy);
    ``array`` itself where JAX holds it as it is."""
    if held_narrower(array) is None:
        return array
    copy = aligned_empty(array.shape, held_narrower(array))
    np.copyto(copy, array, casting="unsafe")
    return copy


def placed_as_is(array: np.ndarray) -> bool:
    """Whether JAX's CPU client can use ``array``'s own memory as its device buffers with
    nothing writing to it: C-contiguous, aligned, read-only, in a dtype JAX holds as it is."""
    return (array.flags.c_contiguous and not array.flags.writeable
            and array.ctypes.data % ALIGNMENT == 0 and held_narrower(array) is None)


def aliased(arrays: np.ndarray, sharding: jax.sharding.Sharding) -> Iterator[jax.Array]:
    """Each of ``arrays`` (along its first axis) on ``sharding``'s one CPU device, placed as
    iterated, in its own memory where JAX's CPU client can alias it (nothing may write to it).
    The batched placement under ``jax.device_put``, without its Python cost per call.

    Example:
      >>> x = aligned_empty((4, 16), np.float32); x[:] = 1; x.flags.writeable = False
      >>> cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
      >>> rows = list(aliased(x, cpu))  # Rows of 64 bytes: every row is aligned.
      >>> float(rows[2].sum()), rows[2].unsafe_buffer_pointer() == x[2].ctypes.data
      (16.0, True)
    """
    device, = sharding.device_set
    return (_placed(array, sharding, [device]) for array in arrays)


def placed_replicated(arrays: Sequence[np.ndarray], sharding: jax.sharding.Sharding) -> list:
    """Each of ``arrays`` (in dtypes JAX holds as they are) whole on every device of
    ``sharding``, aliasing host memory as `aliased` does."""
    devices = list(sharding._addressable_device_assignment)
    return [_placed(array, sharding, devices) for array in arrays]


def placed_split(arrays: Sequence[np.ndarray], sharding: jax.sharding.Sharding) -> list:
    """Each of ``arrays`` split along its first axis into equal parts, one per device of
    ``sharding`` in its order, aliasing host memory as `aliased` does."""
    devices = list(sharding._addressable_device_assignment)

    def parts(array):  # Iterated in C: views of ``size`` rows each.
        size = array.shape[0] // len(devices)
        return list(array.reshape((len(devices), size) + array.shape[1:]))
    return [_placed(array, sharding, devices, parts(array)) for array in arrays]


def _placed(array, sharding, devices, parts=None):
    """``array`` whole on each of ``devices``, or each device's one of ``parts`` (host arrays)."""
    aval = jax.core.ShapedArray(array.shape, array.dtype)
    return jax_internals.batched_device_put(aval, sharding, parts or [array] * len(devices),
                                            devices, True)


def check_host_numbers(value: Any) -> None:
    """Checks host numbers JAX without ``jax_enable_x64`` holds in 32 bits.

    float64 and complex128 values warn once per dtype (`X64CastWarning`); an int64 value that
    int32 cannot hold raises `X64RequiredError` (JAX would keep only its low bits). Only NumPy
    arrays and scalars of 64-bit dtypes are looked at.

    Example:
      >>> check_host_numbers(np.arange(3))  # int64 values that fit in 32 bits: int32.
      >>> check_host_numbers(np.array([2**40]))  # doctest: +IGNORE_EXCEPTION_DETAIL
      Traceback (most recent call last):
      jdist.errors.X64RequiredError: a host value of dtype int64 ...
    """
    held = held_narrower(value)
    if held is None:
        return
    if value.dtype.kind not in "iu":
        _warn_narrowed(value.dtype, held)
        return
    if not value.size:
        return
    low, high, limits = value.min(), value.max(), np.iinfo(held)
    if low < limits.min or high > limits.max:
        raise errors.X64RequiredError(
            f"a host value of dtype {value.dtype} holds numbers from {low} to {high}; JAX "
            f"without 64-bit mode holds it as {held} and would wrap them to other numbers. "
            "Enable 64-bit mode before creating arrays (jax.config.update('jax_enable_x64', "
            "True)), or bring the values into range in the input pipeline (e.g. ids modulo a "
            "table size).")


@functools.lru_cache(maxsize=None)
def _warn_narrowed(dtype, held) -> None:
    """Warns once per process and dtype that JAX holds ``dtype`` host values as ``held``."""
    warnings.warn(
        f"jdist holds {dtype} host values as {held}, as jax.jit does without 64-bit mode (TF "
        f"computes with {dtype}). Enable jax_enable_x64 for TF's 64-bit numbers, or cast the "
        f"data to {held} where it is made (x.astype(np.{held})) to silence this.",
        errors.X64CastWarning, stacklevel=_caller_level())


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside jdist: the user's call that placed it."""
    frame: Optional[types.FrameType] = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../jdist


def check_host_leaves(leaves: Sequence[Any]) -> None:
    """`check_host_numbers` of each of ``leaves``, cheap where none is a NumPy value
    (``jdist.function`` checks its arguments on every call)."""
    if jax.config.read("jax_enable_x64"):
        return  # JAX holds every host value as it is.
    if any(issubclass(kind, _NUMPY) for kind in set(map(type, leaves))):
        for leaf in leaves:
            check_host_numbers(leaf)


def python_numbers_as_tf(value: Any) -> np.ndarray:
    """Python numbers (or nested lists of them) typed as TF's ``convert_to_tensor`` types them:
    floats float32, ints int32 (int64 beyond its range).

    Example:
      >>> python_numbers_as_tf([1, 2]).dtype, python_numbers_as_tf(0.5).dtype
      (dtype('int32'), dtype('float32'))
    """
    array = np.asarray(value)
    if array.dtype.kind == "f":
        array = array.astype(np.float32)
    elif array.dtype.kind == "i" and array.size and -2**31 <= array.min() <= array.max() < 2**31:
        array = array.astype(np.int32)
    check_host_numbers(array)
    return array


def check_arrays(value: Any, what: str) -> None:
    """Raises `UnsupportedValueError` when a leaf of the nest ``value`` is something no device
    holds (a string, an object)."""
    for leaf in jax.tree_util.tree_leaves(value):
        check_array(leaf, what)


def check_array(leaf: Any, what: str) -> None:
    """`check_arrays` of one leaf (for callers that walk the leaves anyway)."""
    if not is_placeable(leaf):
        raise errors.UnsupportedValueError(
            f"{what} of a {type(leaf).__name__} value: a device holds arrays and numbers of "
            "a numeric or bool dtype only (JAX has no strings or objects).")


def check_placeable(values: Sequence[Any]) -> None:
    """Raises `UnsupportedValueError` unless a device can hold each of ``values`` (replicas')."""
    for i, v in enumerate(values):
        if not is_placeable(v):
            raise errors.UnsupportedValueError(
                f"replica {i}'s value is {_short_repr(v)}; a device holds arrays and numbers of "
                "a numeric or bool dtype only (JAX has no strings or objects). Keep such values "
                "outside the distributed values (a Python object passes to strategy.run as it "
                "is), or encode them as numbers in the input pipeline.")


def is_placeable(value: Any) -> bool:
    """Whether a device can hold ``value``: a JAX array, a number, or an array of a numeric or
    bool dtype (NumPy's, or another library's tensor)."""
    if isinstance(value, jax.Array):
        return True
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        return isinstance(value, SCALARS)
    try:
        dtype = np.dtype(dtype)
    except TypeError:  # Another library's dtype (a tf.DType): its NumPy value's.
        dtype = np.asarray(value).dtype
    return dtype_kind(dtype) is not None


def _short_repr(v):
    dtype = getattr(v, "dtype", None)
    return f"an array of dtype {dtype}" if dtype is not None else f"of type {type(v).__name__}"
