"""`ReduceOp`: how values from different replicas are combined."""

import enum
from typing import Any

import jax
import numpy as np

from jdist._src import errors, host_values


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
    def from_any(op: Any, *, allow_strings: bool = True) -> "ReduceOp":
        """Returns the `ReduceOp` for ``op``: a `ReduceOp` or its name in any case.

        Args:
            op: a `ReduceOp`, or (when ``allow_strings``) its name, such as ``"sum"``.
            allow_strings: whether names are accepted (CrossDeviceOps take only the enum, as TF).

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


def check_reducible(op: ReduceOp, value: Any, adds: bool = True, places: bool = True) -> None:
    """Raises `UnsupportedValueError` when the nest ``value`` holds values TF cannot reduce:
    bools where it adds them (``add_n`` has no bool kernel), PRNG keys, or values no device
    holds; host values placed (``places``) pass `host_values.check_host_numbers`.

    Example:
        >>> import numpy as np
        >>> check_reducible(ReduceOp.SUM, [np.int8(1), 2.0])
        >>> check_reducible(ReduceOp.SUM, np.array([True]))
        Traceback (most recent call last):
        ...
        jdist._src.errors.UnsupportedValueError: ReduceOp.SUM of bool values ...
    """
    for leaf in jax.tree_util.tree_leaves(value):
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
