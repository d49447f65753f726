"""How TF's strategies reduce a value that is not distributed: a plain array, a Python number,
None (TF's ``reduce_non_distributed_value`` and its one-replica tensor).

A `MirroredStrategy` (and `MultiWorkerMirroredStrategy`) reduces such a value as TF's do; the
default strategy and `OneDeviceStrategy` hand it back as it is (`StrategyExtended`'s
``_plain_values_as_they_are``).
"""

import jax.numpy as jnp
import numpy as np

from jdist._src import errors
from jdist._src.host_values import python_numbers_as_tf
from jdist._src.reduce_op import ReduceOp
from jdist._src.values import DistributedValues
from jdist._src.values import Mirrored
from jdist._src.values import is_step_output

REDUCE = object()  # `unreduced`: the value is to be reduced.


def reduce_plain(op: ReduceOp, value, num_replicas: int):
    """``strategy.reduce(op, value, axis=None)`` of a plain ``value`` on a mirrored strategy of
    ``num_replicas``: TF's MEAN hands it back, its SUM makes a tensor of it on one replica and
    raises on several, NumPy zeros sum to zeros, and a Python zero raises (`check_not_zero`).

    Example:
      >>> float(reduce_plain(ReduceOp.SUM, 0.5, 1)), reduce_plain(ReduceOp.MEAN, 0.5, 3)
      (0.5, 0.5)
    """
    check_not_zero(op, value)
    if num_replicas == 1:
        return value if op is ReduceOp.MEAN else as_tensor(value)
    if op is ReduceOp.SUM and host_zeros(value):
        return np.zeros(value.shape, value.dtype)  # TF: the sum of zeros, whatever N.
    if op is ReduceOp.SUM:
        raise errors.InvalidArgumentError(
            f"A non-DistributedValues value {_short(value)} cannot be reduced with "
            "ReduceOp.SUM on a strategy with several replicas: it is not per-replica. "
            "Reduce the PerReplica value returned by strategy.run instead.")
    return value


def unreduced(op: ReduceOp, value):
    """What TF's ``reduce_to`` returns without reducing ``value`` (`REDUCE` where it reduces):
    a `Mirrored` value's MEAN is that value, a host array of zeros comes back as zeros, and
    another non-distributed value's MEAN is that value as it is (a Python number included),
    wherever the destinations are. A Python zero raises (`check_not_zero`)."""
    if isinstance(value, Mirrored) and not is_step_output(value):
        return value if op is ReduceOp.MEAN else REDUCE
    if isinstance(value, DistributedValues):
        return REDUCE
    check_not_zero(op, value)
    if host_zeros(value):
        return np.zeros(value.shape, value.dtype)
    return value if op is ReduceOp.MEAN else REDUCE


def check_not_zero(op: ReduceOp, value) -> None:
    """Raises where TF's mirrored strategies raise AttributeError reducing a plain value: a
    Python zero, which TF hands back as ``np.zeros(value.shape)`` (a number has no shape)."""
    if isinstance(value, (int, float, complex)) and value == 0:
        raise errors.InvalidArgumentError(
            f"{op} of the Python number {value!r} (not a per-replica value): TF's "
            "MirroredStrategy raises AttributeError there (it hands zeros back as "
            "np.zeros(value.shape), and a Python number has no shape). Pass a NumPy zero "
            "(np.float32(0)), which TF and jdist hand back as zeros, or a per-replica value.")


def host_zeros(value) -> bool:
    """Whether ``value`` is a host (NumPy) array of zeros, which TF reduces to zeros on any
    number of replicas (its SUM of another non-distributed value raises)."""
    return isinstance(value, (np.ndarray, np.generic)) and not np.any(value)


def as_tensor(value):
    """``value`` as TF's one-replica SUM returns a non-distributed one: arrays as they are, a
    Python number as the tensor TF makes of it (float32, int32; ``0.1`` is ``0.100000001``)."""
    if isinstance(value, bool):
        return jnp.asarray(value)
    if value is None:  # TF cannot make a tensor of it.
        raise errors.InvalidArgumentError(
            "None cannot be reduced with ReduceOp.SUM: it is not a tensor (TF raises too). "
            "Leave None out of the nest, or reduce it with MEAN, which hands it back.")
    if not isinstance(value, (int, float, complex)):
        return value
    return jnp.asarray(python_numbers_as_tf(value))  # An int64 or complex128 needs x64.


def _short(value):
    text = repr(value)
    return text if len(text) < 60 else text[:57] + "..."
