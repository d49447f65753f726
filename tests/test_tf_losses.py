"""``jdist.nn`` against TF's ``tf.nn.compute_average_loss`` / ``scale_regularization_loss``.

Random cases draw a replica count, a dtype, per-replica row counts (uneven ones included, a
replica with none too), extra loss axes, a kind of ``sample_weight`` and of
``global_batch_size`` (none, a number, zero, the all-reduced row count), and compare each
replica's loss and the all-reduced gradient with TF's under its MirroredStrategy. Losses are
multiples of 1/8, so the sums are exact in any order and the losses must match bit for bit.
"""

import os
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdist

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from _tf_skip import tf_or_skip  # noqa: E402

tf = tf_or_skip()

from _tf_reference import assert_matches  # noqa: E402
from _tf_reference import local_results  # noqa: E402
from _tf_reference import strategies  # noqa: E402

SEEDS = range(60)
DTYPES = ["float32", "float32", "bfloat16", "float16", "int32", "int8"]
WEIGHTS = {
    "scalar": lambda rows, extra: np.float32(0.5),
    "per example": lambda rows, extra: (np.arange(rows) % 3 / 2).astype(np.float32),
    "axis of 1": lambda rows, extra: (np.arange(rows) % 3 / 2).astype(np.float32)[:, None],
    "full": lambda rows, extra: (np.arange(rows * int(np.prod(extra))) % 4 / 4).astype(
        np.float32).reshape((rows,) + extra),
    "int": lambda rows, extra: (np.arange(rows) % 3).astype(np.int32),
}


def random_case(seed):
    """``(n, losses, weights, global_batch_size)``; weights None or one per replica."""
    rnd, rng = random.Random(seed), np.random.default_rng(seed)
    n, dtype = rnd.choice([1, 2, 3, 4, 8]), rnd.choice(DTYPES)
    extra = tuple(rnd.randint(1, 3) for _ in range(rnd.randint(0, 2)))
    rows = ([rnd.randint(0, 4) for _ in range(n)] if rnd.random() < 0.5
            else [rnd.randint(1, 4)] * n)
    if "int" in dtype:
        losses = [rng.integers(-5, 5, size=(r,) + extra).astype(dtype) for r in rows]
    else:
        losses = [(rng.integers(-16, 16, size=(r,) + extra) / 8).astype(dtype) for r in rows]
    weight = rnd.choice([None, *WEIGHTS])
    weights = None if weight is None else [WEIGHTS[weight](r, extra) for r in rows]
    return n, losses, weights, rnd.choice([None, None, rnd.randint(1, 20), 0, "row count"])


def replica_step(lib, losses, weights, global_batch_size):
    """The replica function of either library: the loss, and its gradient with respect to a
    scale of the losses (all-reduced, float losses only)."""
    def loss_fn(x, w, scale):
        kwargs = {} if weights is None else {"sample_weight": w}
        if global_batch_size == "row count":
            ctx = (jdist.get_replica_context() if lib is jdist
                   else tf.distribute.get_replica_context())
            kwargs["global_batch_size"] = ctx.all_reduce(
                "sum", x.shape[0] if lib is jdist else tf.shape(x)[0])
        elif global_batch_size is not None:
            kwargs["global_batch_size"] = global_batch_size
        if scale is not None:
            x = x * (scale.astype(x.dtype) if lib is jdist else tf.cast(scale, x.dtype))
        return lib.nn.compute_average_loss(x, **kwargs)

    def step(x, w):
        if "int" in str(x.dtype):
            return loss_fn(x, w, None)
        if lib is jdist:
            loss, grad = jax.value_and_grad(lambda s: loss_fn(x, w, s))(jnp.float32(1))
        else:
            scale = tf.constant(1.0)
            with tf.GradientTape() as tape:
                tape.watch(scale)
                loss = loss_fn(x, w, scale)
            grad = tape.gradient(loss, scale)
        ctx = jdist.get_replica_context() if lib is jdist else tf.distribute.get_replica_context()
        return loss, ctx.all_reduce("sum", grad)
    return step


def outcomes(strategy, step, values):
    """The local results of the step's loss and gradient (None: not computed), or its error
    twice."""
    try:
        out = strategy.run(lambda pair: step(*pair), args=(values,))
    except Exception as error:  # noqa: BLE001 - compared with the other library's outcome.
        return error, error
    out = out if isinstance(out, tuple) else (out, None)
    return tuple(None if o is None else local_results(strategy, o) for o in out)


def grad_tolerance(dtype):
    """How far the all-reduced gradient may be from TF's, relatively. A low-precision loss's
    backward pass rounds in its dtype, and TF's rounding there depends on the processor: on a
    Xeon with AVX512-FP16 TF's float16 gradients were 0.3-0.5 float16 epsilons from jdist's,
    on an AMD EPYC they were equal bit for bit (the losses are equal on both)."""
    if not jnp.issubdtype(dtype, jnp.floating) or np.dtype(dtype) == np.float32:
        return 1e-6  # Integer losses have no gradient here; an error is compared as one.
    return float(jnp.finfo(dtype).eps)


@pytest.mark.parametrize("seed", SEEDS)
def test_random_losses_are_tfs(seed):
    n, losses, weights, global_batch_size = random_case(seed)
    results = []
    for lib, strategy in zip((jdist, tf), strategies(n)):
        values = strategy.experimental_distribute_values_from_function(
            lambda ctx: (losses[ctx.replica_id_in_sync_group],
                         np.float32(1) if weights is None
                         else weights[ctx.replica_id_in_sync_group]))
        results.append(outcomes(strategy, replica_step(lib, losses, weights, global_batch_size),
                                values))
    (loss, grad), (tf_loss, tf_grad) = results
    assert_matches(loss, tf_loss)
    if tf_grad is not None:  # Terms loss / divisor, summed in any order.
        assert_matches(grad, tf_grad, rtol=grad_tolerance(losses[0].dtype))
