"""`ReduceOp`: how values from different replicas are combined."""

import enum

from jdist._src import errors


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
