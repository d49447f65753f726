"""Gradients through the replica context's collectives are TF's, bit for bit.

TF gives ``ReplicaContext.all_reduce`` and ``all_gather`` custom gradients: the gradient of an
all-reduce is the all-reduce (same op) of the upstream gradients; the gradient of an all-gather is
the all-reduce SUM of the upstream gradients, of which each replica takes the rows it contributed.
Each seed draws a replica count, a dtype (float32 or bfloat16, whose sums round every partial
sum), a shape, sizes along the gathered axis (uneven ones included) and a loss, and compares ``jax.grad`` inside jdist's replica function with ``tf.GradientTape``
inside TF's (its all-reduce ``ReductionToOneDevice``, whose order of additions jdist follows,
docs/design.md, section 9). TF runs eagerly: in a ``tf.function`` Grappler's constant folding turns TF's division
by the replica count into a multiplication by its reciprocal, an ulp away (docs/design.md,
section 9). Through ``merge_call`` TF's tape records nothing (the merge function runs outside the
replica's tape); jdist raises `NoGradientError` when a gradient would come back through it, and
leaves the gradient as it is when the merge result is not differentiated (a logged loss).
"""

import functools
import os
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdist
from jdist import errors

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from _tf_skip import tf_or_skip  # noqa: E402

tf = tf_or_skip()

from _tf_reference import assert_matches  # noqa: E402
from _tf_reference import both_reducing_to_one_device  # noqa: E402
from _tf_reference import outcome  # noqa: E402
from _tf_reference import strategies  # noqa: E402

SEEDS = range(60)


# Losses of (library's replica context, reduce_sum, x, w): x is differentiated, w a weight.
LOSSES = {
    "all_reduce_sum": lambda c, total, x, w: total(c.all_reduce("sum", x) * w),
    "all_reduce_mean": lambda c, total, x, w: total(c.all_reduce("mean", x) * w),
    "nest": lambda c, total, x, w: total(
        c.all_reduce("sum", {"a": x, "b": x * x})["a"] * w) + total(
        c.all_reduce("mean", {"a": x, "b": x * w})["b"]),
    "mean_of_sum": lambda c, total, x, w: total(
        c.all_reduce("mean", c.all_reduce("sum", x) * w) * w),
    "all_gather": lambda c, total, x, w: total(c.all_gather(x, 0) * w[(0,) * len(w.shape)]),
}


def random_case(seed):
    """``(n, xs, ws, loss)`` drawn from ``seed``: gathers get uneven row counts."""
    rnd, rng = random.Random(seed), np.random.default_rng(seed)
    n, loss = rnd.choice([1, 2, 3, 4, 8]), rnd.choice(list(LOSSES))
    dtype = jnp.dtype(rnd.choice(["float32", "bfloat16"]))
    shape = tuple(rnd.randint(1, 3) for _ in range(rnd.randint(1, 2)))
    rows = [rnd.randint(0, 3) if loss == "all_gather" else shape[0] for _ in range(n)]
    draw = lambda r: rng.normal(size=(r,) + shape[1:]).astype(dtype)  # noqa: E731
    return n, [draw(r) for r in rows], [draw(shape[0]) for _ in range(n)], loss


def jdist_gradient(loss):
    def step(x, w):
        return jax.grad(lambda x: LOSSES[loss](jdist.get_replica_context(), jnp.sum, x, w))(x)
    return step


def tf_gradient(loss):
    def step(x, w):
        with tf.GradientTape() as tape:
            tape.watch(x)
            value = LOSSES[loss](tf.distribute.get_replica_context(), tf.reduce_sum, x, w)
        return tape.gradient(value, x)
    return step


def distribute(strategy, components, convert=np.asarray):
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: convert(components[ctx.replica_id_in_sync_group]))


@pytest.mark.parametrize("seed", SEEDS)
def test_gradients_through_collectives_are_tfs(seed):
    n, xs, ws, loss = random_case(seed)
    strategy, tf_strategy = strategies(n)
    if tf_strategy is None:
        pytest.skip("TensorFlow was initialised before its logical CPU devices were configured.")
    if n > 1:  # Both with ReductionToOneDevice (TF's default gathers no bfloat16).
        strategy, tf_strategy = both_reducing_to_one_device(n)
    got = outcome(strategy, lambda: strategy.run(
        jdist_gradient(loss), args=(distribute(strategy, xs), distribute(strategy, ws))))
    want = outcome(tf_strategy, lambda: tf_strategy.run(
        tf_gradient(loss), args=(distribute(tf_strategy, xs, tf.constant),
                                 distribute(tf_strategy, ws, tf.constant))))
    assert_matches(got, want)


@pytest.mark.parametrize("n", [1, 3])
def test_no_gradient_flows_through_merge_call(n):
    strategy, tf_strategy = strategies(n)
    if tf_strategy is None:
        pytest.skip("TensorFlow was initialised before its logical CPU devices were configured.")
    merged = lambda c, x: c.merge_call(lambda s, v: s.reduce("sum", v, axis=None), args=(x,))

    def tf_step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            value = tf.reduce_sum(merged(tf.distribute.get_replica_context(), x * x))
        return tape.gradient(value, x)
    def tf_logging_step(x):  # The merge result is logged, not differentiated.
        with tf.GradientTape() as tape:
            tape.watch(x)
            value = tf.reduce_sum(x * x)
            merged(tf.distribute.get_replica_context(), value)
        return tape.gradient(value, x)

    def logging_step(x):
        def loss(x):
            value = jnp.sum(x * x)
            return value, merged(jdist.get_replica_context(), value)
        return jax.grad(loss, has_aux=True)(x)[0]
    x = np.array([1.0, 2.0], np.float32)
    assert all(g is None for g in tf_strategy.experimental_local_results(
        tf_strategy.run(tf_step, args=(tf.constant(x),))))
    with pytest.raises(errors.NoGradientError, match="stop_gradient"):
        strategy.run(lambda x: jax.grad(
            lambda x: jnp.sum(merged(jdist.get_replica_context(), x * x)))(x), args=(x,))
    assert_matches(outcome(strategy, lambda: strategy.run(logging_step, args=(x,))),
                   outcome(tf_strategy, lambda: tf_strategy.run(tf_logging_step,
                                                                args=(tf.constant(x),))))


@pytest.mark.parametrize("n", [2, 3])
def test_gradient_through_a_custom_accumulation_fn_is_tfs(n):
    # TF differentiates all_reduce by its rule, the same all-reduce of the upstream gradients
    # (here their elementwise max), not through the accumulation function.
    strategy, tf_strategy = strategies(n)
    if tf_strategy is None:
        pytest.skip("TensorFlow was initialised before its logical CPU devices were configured.")
    tf.distribute.MirroredStrategy._collective_key_base += 100000
    tf_strategy = tf.distribute.MirroredStrategy(
        [f"/device:CPU:{i}" for i in range(n)], cross_device_ops=tf.distribute.ReductionToOneDevice(
            accumulation_fn=lambda xs: functools.reduce(tf.maximum, xs)))
    strategy = jdist.MirroredStrategy(
        strategy.extended.worker_devices, cross_device_ops=jdist.ReductionToOneDevice(
            accumulation_fn=lambda xs: functools.reduce(jnp.maximum, xs)))
    rng = np.random.default_rng(n)
    xs, ws = ([rng.normal(size=(3,)).astype(np.float32) for _ in range(n)] for _ in range(2))
    got = outcome(strategy, lambda: strategy.run(jdist_gradient("all_reduce_sum"), args=(
        distribute(strategy, xs), distribute(strategy, ws))))
    want = outcome(tf_strategy, lambda: tf_strategy.run(tf_gradient("all_reduce_sum"), args=(
        distribute(tf_strategy, xs, tf.constant), distribute(tf_strategy, ws, tf.constant))))
    assert_matches(got, want)
