"""TensorFlow's own MirroredStrategy over eight logical CPU devices, for tests that compare with it.

Import it after ``pytest.importorskip("tensorflow")``. The logical devices can only be configured
before TF initialises its runtime, so this module configures them when it is imported: pytest
imports every test module (and so this one) before any test runs TF, in every xdist worker, so the
order of the tests does not matter. If TF was initialised earlier anyway, `tf_devices` is None.
"""

import functools
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import pytest  # noqa: E402

tf = pytest.importorskip("tensorflow")

from jdist.testing import mirrored  # noqa: E402

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


tf_devices()
