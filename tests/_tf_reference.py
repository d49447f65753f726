"""TensorFlow's own MirroredStrategy over eight logical CPU devices, for tests that compare with it,
and the comparison itself (`outcome`, `assert_matches`).

Import it after ``_tf_skip.tf_or_skip()``. The logical devices can only be configured
before TF initialises its runtime, so this module configures them when it is imported: pytest
imports every test module (and so this one) before any test runs TF, in every xdist worker, so the
order of the tests does not matter. If TF was initialised earlier anyway, `tf_devices` is None.
"""

import functools
import os

import jax
import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


from _tf_skip import tf_or_skip  # noqa: E402

tf = tf_or_skip()

from jdist.testing import mirrored  # noqa: E402
from jdist.testing import mirrored_reducing_to_one_device  # noqa: E402

NUM_DEVICES = 8


@functools.lru_cache(maxsize=None)
def tf_devices():
    """Eight logical CPU devices for TF's own MirroredStrategy (None if TF started already).

    TF's inter-op thread pool has one thread per core by default; on a 2-core machine the work
    of 8 logical devices then waits for threads (12 short training runs of TF's MirroredStrategy
    over 8 devices: 85 s of wall time for 32 s of CPU), so the pool gets two threads per device.
    """
    cpus = tf.config.list_physical_devices("CPU")
    try:
        tf.config.threading.set_inter_op_parallelism_threads(2 * NUM_DEVICES)
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration()] * NUM_DEVICES)
    except RuntimeError:
        pass
    names = [d.name for d in tf.config.list_logical_devices("CPU")]
    return names if len(names) >= NUM_DEVICES else None


@functools.lru_cache(maxsize=None)
def strategies(n):
    """jdist's and TF's MirroredStrategy over ``n`` devices (TF's is None without its devices).

    Each TF strategy gets its own collective keys: TF numbers collective groups per strategy from
    the same start, so two strategies over different device counts in one process would use the
    same group key with different group sizes, and TF's runtime aborts the second one's collectives
    ("joining a group with size 3, but that group has size 2"). TF's own tests do the same
    (``tensorflow/python/distribute/strategy_combinations.py``).
    """
    names = tf_devices()
    tf_strategy = None
    if names is not None:
        tf.distribute.MirroredStrategy._collective_key_base += 100000
        tf_strategy = tf.distribute.MirroredStrategy(names[:n])
    return mirrored(n), tf_strategy


def local_results(strategy, value):
    """Each local replica's value as a NumPy array (either library's strategy; a TF bfloat16
    scalar converts through ``numpy()`` only)."""
    return [np.asarray(v.numpy() if hasattr(v, "numpy") else v)
            for v in strategy.experimental_local_results(value)]


def outcome(strategy, compute):
    """``compute()``'s local results, or the exception it raised."""
    try:
        return local_results(strategy, compute())
    except Exception as error:  # noqa: BLE001 - compared with TF's outcome below.
        return error


def held_as_jax(want: np.ndarray) -> np.ndarray:
    """TF's result ``want`` in the dtype JAX holds it in: as it is with ``jax_enable_x64``;
    without it TF's 64-bit numbers in 32 bits (float64 as float32, int64 as int32), the numbers
    jdist must give (docs/migration.md, "Dtypes are JAX's"). TF's integers must fit: where they
    leave int32's range the case is one for x64 only, not a conformance case without it."""
    held = jax.dtypes.canonicalize_dtype(want.dtype)
    if held == want.dtype:
        return want
    if np.issubdtype(held, np.integer) and want.size:
        limits = np.iinfo(held)
        assert limits.min <= want.min() and want.max() <= limits.max, (
            f"TF's {want.dtype} numbers {want} leave {held}'s range: compare under x64 only")
    return want.astype(held)


def assert_matches(got, want, unchecked=(), rtol=0):
    """jdist's local results (or exception) ``got`` equal TF's ``want`` held as JAX holds them
    (`held_as_jax`: TF's own numbers with x64, cast to 32 bits without it), dtypes too, except
    where TF's dtype is one of ``unchecked`` (TF's float64 of Python-number arithmetic)."""
    if isinstance(want, Exception):
        assert isinstance(got, Exception), f"TF raised {want!r}, jdist returned {got}"
        return
    if isinstance(got, Exception):
        raise AssertionError(f"jdist raised, TF returned {want}") from got
    if len(want) == 1 and len(got) > 1 and all(np.array_equal(g, got[0]) for g in got):
        got = got[:1]  # TF's one object, jdist's Mirrored copies (docs/design.md, deviations).
    assert len(got) == len(want), f"{len(got)} local results, TF's {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, f"replica {i}: shape {g.shape}, TF's {w.shape}"
        if w.dtype not in unchecked:
            w = held_as_jax(w)
            assert g.dtype == w.dtype, f"replica {i}: dtype {g.dtype}, TF's held {w.dtype}"
        if np.issubdtype(w.dtype, np.integer):
            np.testing.assert_array_equal(g, w, err_msg=f"replica {i}")
        else:
            np.testing.assert_allclose(g, w, rtol=rtol, err_msg=f"replica {i}")


def reduction_to_one_device(n):
    """TF's MirroredStrategy over ``n`` devices with ``ReductionToOneDevice`` (add_n)."""
    tf.distribute.MirroredStrategy._collective_key_base += 100000
    return tf.distribute.MirroredStrategy(
        [f"/device:CPU:{i}" for i in range(n)],
        cross_device_ops=tf.distribute.ReductionToOneDevice())


def both_reducing_to_one_device(n):
    """jdist's and TF's MirroredStrategy over ``n`` devices, both with ``ReductionToOneDevice``
    (which reduces and gathers every dtype, along a negative axis too)."""
    return mirrored_reducing_to_one_device(n), reduction_to_one_device(n)


tf_devices()
