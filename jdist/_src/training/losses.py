"""TF's distribution-aware loss scaling: ``tf.nn.compute_average_loss`` and
``tf.nn.scale_regularization_loss``, number for number (``docs/semantics.md``, "Loss scaling").

Each replica scales its own loss so that the all-reduce SUM of the gradients is the gradient of
the global average. The sum and division are `collectives.local_sum` and `collectives.finish`,
the rules of every other reduction.
"""

from typing import Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jdist._src.reduce import collectives
from jdist._src import context
from jdist._src import errors
from jdist._src import host_values
from jdist._src.reduce_op import ReduceOp
from jdist._src.values import DistributedValues


def compute_average_loss(per_example_loss: ArrayLike, sample_weight: Optional[ArrayLike] = None,
                         global_batch_size: Optional[Union[int, ArrayLike]] = None) -> jax.Array:
    """Scales per-example losses by ``sample_weight`` and averages them over the global batch
    (``tf.nn.compute_average_loss``); all-reduce the gradients with SUM.

    Args:
      per_example_loss: this replica's losses, rank 1 or more (the batch along axis 0).
      sample_weight: optional weights broadcastable to the losses after TF's adjustment (ranks
        one apart: a last axis of size 1 dropped or added), multiplied in float32.
      global_batch_size: a non-negative integer scalar; None (TF's default): this replica's
        batch size times ``num_replicas_in_sync`` (needs a replica context).

    Returns:
      A scalar in TF's division dtype: the weighted sum over ``global_batch_size``, 0 if that is 0.

    Raises:
      InvalidArgumentError: ``per_example_loss`` is a scalar, or ``global_batch_size`` is not a
        non-negative integer scalar (a traced negative one gives NaN).
      ShapeMismatchError: ``sample_weight`` does not broadcast to the losses.
      WrongContextError: ``global_batch_size`` is None in a cross-replica context.

    Example:
      >>> import jax.numpy as jnp, jdist
      >>> s = jdist.MirroredStrategy(["cpu:0", "cpu:1"])
      >>> loss = s.run(lambda x: jdist.nn.compute_average_loss(x ** 2),
      ...              args=(s.experimental_distribute_values_from_function(
      ...                  lambda ctx: jnp.arange(3.0) + ctx.replica_id_in_sync_group),))
      >>> [round(float(v), 4) for v in s.experimental_local_results(loss)]  # 5 / 6, 14 / 6.
      [0.8333, 2.3333]
    """
    loss = _tensor(per_example_loss)
    if loss.ndim == 0:
        raise errors.InvalidArgumentError(
            "compute_average_loss: per_example_loss must have rank 1 or more (one loss per "
            f"example along axis 0); got a scalar {loss!r}. Pass the unreduced losses.")
    if sample_weight is not None:
        loss = _weighted(loss, _tensor(sample_weight))
    if global_batch_size is None:
        _require_replica_context("compute_average_loss")
        global_batch_size = loss.shape[0] * context.get_strategy().num_replicas_in_sync
    divisor = _batch_size(global_batch_size)
    total = collectives.local_sum(loss, tuple(range(loss.ndim)))
    zero = jnp.asarray(divisor).astype(total.dtype) == 0  # TF compares the cast divisor.
    # Divided by 1 where the divisor is 0, so the gradient there is 0, as TF's div_no_nan's.
    average = collectives.finish(ReduceOp.MEAN, total, jnp.where(zero, 1, divisor))
    if isinstance(divisor, jax.core.Tracer):
        average = jnp.where(divisor < 0, jnp.nan, average)  # TF raises; here only NaN can say so.
    return jnp.where(zero, jnp.zeros((), average.dtype), average)


def scale_regularization_loss(regularization_loss: ArrayLike) -> jax.Array:
    """The sum of ``regularization_loss`` over the number of replicas
    (``tf.nn.scale_regularization_loss``): the SUM of the gradients counts it once.

    Args:
      regularization_loss: a scalar, an array (summed), or a list as TF packs it (``model.losses``).

    Returns:
      A scalar: the sum over ``num_replicas_in_sync``, in TF's division dtype.

    Raises:
      WrongContextError: called in a cross-replica context.

    Example:
      >>> import jax.numpy as jnp, jdist
      >>> s = jdist.MirroredStrategy(["cpu:0", "cpu:1"])
      >>> out = s.run(lambda: jdist.nn.scale_regularization_loss(jnp.float32(3.0)))
      >>> float(s.reduce("sum", out, axis=None))
      3.0
    """
    _require_replica_context("scale_regularization_loss")
    loss = _tensor(regularization_loss)
    total = collectives.local_sum(loss, tuple(range(loss.ndim)))
    return collectives.finish(ReduceOp.MEAN, total, context.get_strategy().num_replicas_in_sync)


def _tensor(value):
    """``value`` as TF converts it: arrays keep their dtype (host ones checked for numbers JAX
    would change); Python floats become float32 and ints int32, whatever JAX's mode."""
    if isinstance(value, DistributedValues):
        raise errors.UnsupportedValueError(
            f"got a {type(value).__name__}; call the loss functions inside the replica "
            "function, on that replica's losses.")
    if isinstance(value, jax.Array):
        return value
    if isinstance(value, (np.ndarray, np.generic)):
        host_values.check_host_numbers(value)
        return jnp.asarray(value)
    if isinstance(value, (list, tuple)) and any(
            not isinstance(v, host_values.SCALARS) for v in value):
        return _packed(value)  # TF's `model.losses`: a list of scalar tensors.
    return jnp.asarray(host_values.python_numbers_as_tf(value))


def _packed(values):
    """A list holding tensors as TF auto-packs it: stacked, Python numbers in their dtype."""
    parts = [v if isinstance(v, host_values.SCALARS) else _tensor(v) for v in values]
    dtypes = {p.dtype for p in parts if not isinstance(p, host_values.SCALARS)}
    if len(dtypes) > 1:
        raise errors.InvalidArgumentError(
            f"a list of losses mixes dtypes {sorted(map(str, dtypes))}; TF packs a list into one "
            "tensor of one dtype: cast them alike.")
    dtype = dtypes.pop()
    parts = [jnp.asarray(p, dtype) if isinstance(p, host_values.SCALARS) else p for p in parts]
    if len({p.shape for p in parts}) > 1:
        raise errors.ShapeMismatchError(
            f"a list of losses of shapes {[p.shape for p in parts]}; TF packs a list into one "
            "tensor, so its elements need one shape (sum each first for model.losses).")
    return jnp.stack(parts)


def _weighted(loss, weight):
    """TF's ``scale_losses_by_sample_weight``: multiplied in float32, cast back."""
    if weight.ndim == loss.ndim + 1:
        if weight.shape[-1] != 1:
            raise errors.ShapeMismatchError(
                f"compute_average_loss: sample_weight of shape {weight.shape} has one axis more "
                f"than the losses {loss.shape}, so its last axis must have size 1 (TF squeezes it).")
        weight = weight[..., 0]
    elif weight.ndim and weight.ndim == loss.ndim - 1:
        weight = weight[..., None]
    try:
        np.broadcast_shapes(loss.shape, weight.shape)
    except ValueError:
        raise errors.ShapeMismatchError(
            f"compute_average_loss: sample_weight of shape {weight.shape} does not broadcast "
            f"to the losses' shape {loss.shape}.") from None
    product = loss.astype(jnp.float32) * weight.astype(jnp.float32)
    return product.astype(loss.dtype)


def _batch_size(value):
    """``global_batch_size`` checked as TF checks it: an integer scalar, not negative."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer, jax.Array, np.ndarray)):
        raise errors.InvalidArgumentError(
            f"compute_average_loss: global_batch_size must be an integer, got {value!r}.")
    shape, dtype = np.shape(value), getattr(value, "dtype", np.dtype(int))
    if shape != () or not jnp.issubdtype(dtype, jnp.integer):
        raise errors.InvalidArgumentError(
            "compute_average_loss: global_batch_size must be an integer scalar, got "
            f"{'shape ' + str(shape) if shape else 'dtype ' + str(dtype)}.")
    if not isinstance(value, jax.core.Tracer) and int(value) < 0:
        raise errors.InvalidArgumentError(
            f"compute_average_loss: global_batch_size must be non-negative, got {int(value)}.")
    return value


def _require_replica_context(name):
    if context.has_strategy() and context.in_cross_replica_context():
        raise errors.WrongContextError(
            f"{name} was called in a cross-replica context; call it inside the replica "
            "function (strategy.run), where each replica scales its own loss.")
