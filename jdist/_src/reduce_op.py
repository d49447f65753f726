"""`ReduceOp`: how values from different replicas are combined."""

import enum

import jax
import numpy as np

from jdist._src import errors
from jdist._src import host_values


class ReduceOp(enum.Enum):
    """How values from different replicas are combined (``tf.distribute.ReduceOp``).

    ``SUM`` adds the replicas' values; ``MEAN`` adds them and divides by the number of values
    combined (the number of replicas, or with ``axis`` the total number of elements along it).

    Example:
        >>> import jdist
        >>> jdist.ReduceOp.from_any("mean")
        <ReduceOp.MEAN: 'MEAN'>
    """

    SUM = "SUM"
    MEAN = "MEAN"

    @staticmethod
    def from_any(op, *, allow_strings=True):
        """Returns the `ReduceOp` for ``op``: a `ReduceOp` or its name in any case.

        Args:
            op: a `ReduceOp`, or (when ``allow_strings``) a string such as ``"sum"`` or ``"Mean"``.
            allow_strings: whether names are accepted (CrossDeviceOps accept only the enum, like TF).

        Returns:
            The matching `ReduceOp`.

        Raises:
            InvalidArgumentError: ``op`` is not a valid ReduceOp.
        """
        if isinstance(op, ReduceOp):
            return op
        if allow_strings and isinstance(op, str) and op.upper() in ReduceOp.__members__:
            return ReduceOp[op.upper()]
        hint = "ReduceOp.SUM or ReduceOp.MEAN" + (' (or "sum"/"mean")' if allow_strings else "")
        raise errors.InvalidArgumentError(f"{op!r} is not a valid ReduceOp; use {hint}.")


def check_reducible(op, value, adds: bool = True, places: bool = True) -> None:
    """Raises `UnsupportedValueError` when ``value`` (a nest) holds bools, which TF cannot reduce,
    or values no device holds (strings, objects: `host_values.is_placeable`); host values
    pass `host_values.check_host_numbers` (JAX's dtypes).

    TF adds the replicas' values (``add_n``), which has no bool kernel, so both SUM and MEAN of
    bool values raise there; every other dtype is summed in its own dtype (a MEAN of integers
    then divides in a float dtype, `collectives.mean_dtype`). Where TF adds nothing (one
    replica's value handed back as it is), bools pass.

    Args:
        op: the `ReduceOp`, for the message.
        value: a nest of arrays, Python scalars or distributed values.
        adds: whether the reduction adds values (False: one replica, no axis).
        places: whether the call places ``value`` on devices (False: it hands a plain value
          back as it is, as TF's MEAN of one does).

    Example:
        >>> import numpy as np
        >>> check_reducible(ReduceOp.SUM, [np.int8(1), 2.0])
        >>> check_reducible(ReduceOp.SUM, np.array([True]))
        Traceback (most recent call last):
        ...
        jdist._src.errors.UnsupportedValueError: ReduceOp.SUM of bool values ...
    """
    for leaf in jax.tree_util.tree_leaves(value):  # One walk of the nest: reduce is per step.
        if isinstance(leaf, jax.Array):  # On a device: only its dtype can be refused.
            kind = host_values.dtype_kind(leaf.dtype)
        else:
            host_values.check_array(leaf, str(op))
            dtype = getattr(leaf, "dtype", None)
            kind = host_values.dtype_kind(np.asarray(leaf).dtype if dtype is None else dtype)
            if places:
                host_values.check_host_numbers(leaf)
        if kind == "bool" and adds:
            raise errors.UnsupportedValueError(
                f"{op} of bool values is not defined (TF raises too: it adds the values); cast "
                "them to an integer dtype first, e.g. x.astype(jnp.int32).")
        if kind == "PRNG key":
            raise errors.UnsupportedValueError(
                f"{op} of PRNG keys is not defined; reduce what the replicas drew with them.")
