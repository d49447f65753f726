"""The internal interface of jdist's reduce wing, written down: names, types and one protocol.

The type aliases say what the cross-replica code accepts (they are documentation for readers
and type checkers; nothing is checked at run time). `ReplicaCollectives` is what a
`ReplicaContext` needs from its strategy while a replica function runs: the collectives over
the replica axis. The strategy hands one to each replica context
(`StrategyExtended._replica_collectives`).
"""

from typing import Any, Callable, Optional, Protocol, Sequence, Tuple, Union

import jax

from jdist._src.reduce_op import ReduceOp
from jdist._src.values import DistributedValues

#: The name of the one mesh axis the replicas are laid along.
REPLICA_AXIS = "replica"

#: A nest (tuple, list, dict, registered pytree) of arrays or distributed values.
PyTree = Any
#: A `ReduceOp`, or its name in any case (``"sum"``, ``"MEAN"``).
ReduceOpLike = Union[ReduceOp, str]
#: Where a cross-device result goes: a `DistributedValues` (Mirrored on its devices), a device
#: (a ``jax.Device`` or a TF-style name such as ``"CPU:0"``), or a ``jax.Array`` (its devices).
Destinations = Union[DistributedValues, jax.Device, jax.Array, str]
#: The real rows of each replica's padded batch, or None when the batch is not padded.
Lengths = Optional[Tuple[int, ...]]
#: A per-replica axis: None (element-wise across replicas), an int, or a sequence of ints.
Axis = Union[None, int, Sequence[int]]


class ReplicaCollectives(Protocol):
    """The collectives a replica context calls, over the replica axis.

    Inside a traced replica function they lower to ``lax.psum`` / ``lax.all_gather`` and a
    traced merge function; outside one (the default strategy, a context entered by hand) they
    act on the one replica there is.
    """

    def all_reduce(self, op: ReduceOp, value: PyTree, options: Optional[Any] = None) -> PyTree:
        """Every leaf of ``value`` reduced with ``op`` over the replicas (``options``: a
        `CommunicationOptions` or None)."""

    def all_gather(self, value: PyTree, axis: int) -> PyTree:
        """Every leaf of ``value`` concatenated over the replicas along ``axis``."""

    def merge_call(self, merge_fn: Callable[..., PyTree], args: tuple, kwargs: dict) -> PyTree:
        """``merge_fn(strategy, *args, **kwargs)`` once in the cross-replica context; its result
        as this replica sees it."""
