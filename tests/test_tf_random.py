"""Random differential cases: jdist's reductions and gathers against TF's, bit for bit.

Each seed draws a replica count, a dtype, a shape (empty dimensions included), an op, an axis
and a way to combine the replicas, builds random per-replica values, and asserts that jdist's
result (or error) is TF's (`_tf_reference.assert_matches`). Both strategies use
``ReductionToOneDevice``, the all-reduce whose order of additions jdist follows (docs/design.md,
section 9), and which gathers along a negative axis. float16 values are integers, whose sums are exact in any order: the order of a
within-replica sum is Eigen's in TF and XLA's in jdist (section 9), and float16 rounds often
enough to show it. The seeds are fixed, so a failure reproduces with its seed.
"""

import os
import random

import jax.numpy as jnp
import numpy as np
import pytest

import jdist

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from _tf_skip import tf_or_skip  # noqa: E402

tf = tf_or_skip()

from _tf_reference import assert_matches  # noqa: E402
from _tf_reference import both_reducing_to_one_device  # noqa: E402
from _tf_reference import outcome  # noqa: E402
from _tf_reference import strategies  # noqa: E402

SEEDS = range(150)
DTYPES = ["float32", "bfloat16", "float16", "int32", "int16", "int8", "uint8"]


def _ctx(lib):
    return lib.get_replica_context()


# How the replicas' values are combined: f(library, strategy, value, op, axis), the library
# being ``jdist`` or ``tf.distribute``.
COMBINE = {
    "reduce": lambda lib, s, v, op, axis: s.reduce(op, v, axis=axis),
    "all_reduce": lambda lib, s, v, op, axis: s.run(
        lambda x: _ctx(lib).all_reduce(op, x), args=(v,)),
    "merge_call_reduce": lambda lib, s, v, op, axis: s.run(
        lambda x: _ctx(lib).merge_call(lambda st, y: st.reduce(op, y, axis=axis), args=(x,)),
        args=(v,)),
    "reduce_of_all_reduced": lambda lib, s, v, op, axis: s.reduce(op, s.run(
        lambda x: _ctx(lib).all_reduce("sum", x), args=(v,)), axis=axis),
    "reduction_to_one_device": lambda lib, s, v, op, axis: lib.ReductionToOneDevice().reduce(
        lib.ReduceOp(op), v, "CPU:0"),
    "gather": lambda lib, s, v, op, axis: s.gather(v, axis=0 if axis is None else axis),
    "all_gather": lambda lib, s, v, op, axis: s.run(
        lambda x: _ctx(lib).all_gather(x, axis=0 if axis is None else axis), args=(v,)),
}


def random_case(seed):
    """``(n, components, op, axis, combine)`` drawn from ``seed``."""
    rnd = random.Random(seed)
    rng = np.random.default_rng(seed)
    n, dtype = rnd.choice([1, 2, 3, 4, 8]), rnd.choice(DTYPES)
    shape = tuple(rnd.randint(0, 4) for _ in range(rnd.randint(0, 3)))
    axes = [None] + ([0, -1] if shape else []) + ([1, (0, 1)] if len(shape) >= 2 else [])
    if dtype in ("float32", "bfloat16"):
        draw = lambda: rng.normal(size=shape) * 10.0 ** rng.integers(-2, 3, size=shape)  # noqa: E731
    else:
        high = 100 if dtype != "float16" else 8
        draw = lambda: rng.integers(-high if dtype != "uint8" else 0, high, size=shape)  # noqa: E731
    components = [draw().astype(jnp.dtype(dtype)) for _ in range(n)]
    return n, components, rnd.choice(["SUM", "MEAN"]), rnd.choice(axes), rnd.choice(list(COMBINE))


@pytest.mark.parametrize("seed", SEEDS)
def test_random_combinations_are_tfs(seed):
    n, components, op, axis, combine = random_case(seed)
    strategy, tf_strategy = strategies(n)
    if tf_strategy is None:
        pytest.skip("TensorFlow was initialised before its logical CPU devices were configured.")
    if n > 1:  # Both with ReductionToOneDevice (TF's default takes no negative gather axis).
        strategy, tf_strategy = both_reducing_to_one_device(n)
    v = strategy.experimental_distribute_values_from_function(
        lambda ctx: components[ctx.replica_id_in_sync_group])
    tf_v = tf_strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(components[ctx.replica_id_in_sync_group]))
    assert_matches(
        outcome(strategy, lambda: COMBINE[combine](jdist, strategy, v, op, axis)),
        outcome(tf_strategy, lambda: COMBINE[combine](tf.distribute, tf_strategy, tf_v, op, axis)))
