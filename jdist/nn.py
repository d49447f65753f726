"""``jdist.nn``: the names TF keeps under ``tf.nn`` for distributed training loops.

Example:
  >>> import jax.numpy as jnp, jdist
  >>> float(jdist.nn.compute_average_loss(jnp.array([1.0, 2.0, 3.0]), global_batch_size=6))
  1.0
"""

from jdist._src.training.losses import compute_average_loss
from jdist._src.training.losses import scale_regularization_loss

__all__ = ("compute_average_loss", "scale_regularization_loss")
