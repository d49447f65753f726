"""The seams of jdist: the domain's names and types, and what the core calls of its wings.

The core (`values`, `context`, `strategy`, `strategy_extended`, `mirrored`) imports no wing; what
it needs of one is a `Protocol` here: `RunWing` (compiling ``run``), `ReduceWing` (reduce and
gather rules, cross-device ops, destinations), `InputWing` (distributed datasets). Each wing
package registers itself on import (`register_wing`), and ``jdist/_src/__init__.py`` imports
every wing, so the core finds them whichever module a program imports first. The type aliases
document what the cross-replica code accepts (nothing is checked at run time)."""

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple, Union

import jax

from jdist._src.reduce_op import ReduceOp
from jdist._src.values import DistributedValues

#: The name of the one mesh axis the replicas are laid along.
REPLICA_AXIS = "replica"
#: How ``run`` passes an argument leaf to its program (`jdist._src.run.arguments`): stacked
#: per replica, replicated, a plain array or number (replicated too), or compiled in.
PER_REPLICA, MIRRORED, ARRAY, STATIC = "per_replica", "mirrored", "array", "static"

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


@dataclasses.dataclass(frozen=True)
class Target:
    """Resolved destinations: where a result goes (``devices``, in replica order) and in which
    form (a `Mirrored` of ``num_replicas``, or one array). ``mesh``: the `ReplicaMesh` over
    ``devices``; None for one device that is not a mirrored destination.

    Example:
      >>> import jax
      >>> t = reduce_wing().resolve_destinations("cpu:1")
      >>> t.mirrored, t.devices == (jax.devices()[1],)
      (False, True)
    """
    num_replicas: int  # 1 for an array result.
    mirrored: bool
    devices: Tuple[jax.Device, ...]
    mesh: Optional[Any]


class ReplicaCollectives(Protocol):
    """The collectives a replica context calls, over the replica axis: ``lax.psum`` /
    ``lax.all_gather`` and a traced merge function inside a traced replica function; outside one
    (the default strategy, a context entered by hand) they act on the one replica there is."""

    def all_reduce(self, op: ReduceOp, value: PyTree, options: Optional[Any] = None) -> PyTree:
        """Every leaf of ``value`` reduced with ``op`` over the replicas."""

    def all_gather(self, value: PyTree, axis: int) -> PyTree:
        """Every leaf of ``value`` concatenated over the replicas along ``axis``."""

    def merge_call(self, merge_fn: Callable[..., PyTree], args: tuple, kwargs: dict) -> PyTree:
        """``merge_fn(strategy, *args, **kwargs)`` once in the cross-replica context; its result
        as this replica sees it."""


class Runner(Protocol):
    """A strategy's compiled ``run`` (`jdist._src.run.spmd.ReplicatedRunner`)."""

    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """``fn`` run on every replica; its outputs as `Mirrored` or `PerReplica` values."""


class RunWing(Protocol):
    """What the core calls of `jdist._src.run`."""

    #: ``ReplicatedRunner(strategy, replica_mesh)``: the strategy's `Runner`.
    ReplicatedRunner: Callable[[Any, Any], Any]

    def replica_axis_collectives(self, binding: Any, ops: Any, runner: Any, num_replicas: int,
                                 gradients_through_merge: bool,
                                 options: Optional[Any]) -> ReplicaCollectives:
        """The collectives of a traced replica function, over the replica axis."""


class ReduceWing(Protocol):
    """What the core calls of `jdist._src.reduce` (rules, cross-device ops, destinations)."""

    #: ``ReplicaMesh(mesh, axis_name, guard)``: a mesh's shardings and host-side programs.
    ReplicaMesh: Callable[..., Any]

    def normalize_axis(self, axis: Axis, ndim: int) -> Optional[Tuple[int, ...]]: ...
    def gather_axis(self, axis: Any, ndim: int) -> int: ...
    def finish(self, op: ReduceOp, total: Any, count: Any,
               divisors: Optional[dict] = None) -> Any: ...
    def strip_padding(self, stacked: Any, lengths: Lengths, axes: Optional[Tuple[int, ...]],
                      what: str, slice_rows: Optional[Callable] = None) -> Any: ...
    def stacked_reduce(self, op: ReduceOp, stacked: Any, axes: Optional[Tuple[int, ...]],
                       valid_rows: Any = None) -> Any: ...
    def replicated_reduce(self, op: ReduceOp, value: Any, axes: Optional[Tuple[int, ...]],
                          num_replicas: int = 1, mean_is_value: bool = True) -> Any: ...
    def stacked_gather(self, stacked: Any, axis: int) -> Any: ...
    def ragged_partials(self, components: Sequence, axis: Axis) -> Any: ...
    def ragged_gather(self, components: Sequence, axis: int) -> Any: ...
    def check_pairs(self, value_destination_pairs: Sequence[tuple]) -> List[tuple]: ...
    def resolve_ops(self, cross_device_ops: Any, devices: Sequence[jax.Device]) -> Any: ...
    def resolve_destinations(self, destinations: Destinations) -> Any: ...
    def mirrored_on(self, devices: Sequence[jax.Device]) -> Any: ...
    def place(self, tensor: Any, target: Any) -> Any: ...
    def register_mesh(self, replica_mesh: Any) -> None: ...
    def as_options(self, options: Any) -> Any: ...


class InputWing(Protocol):
    """What the core calls of `jdist._src.input`: the strategy's distributed datasets."""

    def distribute_dataset(self, strategy: Any, dataset: Any, options: Any = None) -> Any: ...
    def distribute_datasets_from_function(self, strategy: Any, dataset_fn: Callable[..., Any],
                                          options: Any = None) -> Any: ...
    def make_numpy_dataset(self, numpy_input: Any) -> Any: ...


_WINGS: Dict[str, Any] = {}


def register_wing(name: str, implementation: Any) -> None:
    """Records a wing's implementation (its package) under ``name``: "run", "reduce", "input"."""
    _WINGS[name] = implementation


def run_wing() -> RunWing:
    return _WINGS["run"]


def reduce_wing() -> ReduceWing:
    return _WINGS["reduce"]


def input_wing() -> InputWing:
    return _WINGS["input"]
