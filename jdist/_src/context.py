"""Which strategy is current, and whether code runs in a replica or the cross-replica context.

The cross-replica context is a ``strategy.scope()`` or a ``merge_fn``; the replica context is
the function given to ``strategy.run`` (`ReplicaContext`); outside both, the default strategy's
one replica context. The state is a per-thread stack of frames, as in TF, over the process-wide
fallback `experimental_set_strategy` sets."""

import contextlib
import dataclasses
import threading
from typing import Any, Callable, Iterator, Optional, Sequence

import jax
import jax.numpy as jnp

from jdist._src import errors, host_values
from jdist._src.base import reduce_wing
from jdist._src.reduce_op import ReduceOp, check_reducible


@dataclasses.dataclass(frozen=True)
class _Frame:
    strategy: Any
    replica_context: Optional["ReplicaContext"]  # None: cross-replica frame.
    merge: bool = False  # The cross-replica frame of a merge_fn.


class _State(threading.local):
    def __init__(self):
        self.frames = []


_state = _State()
_global_strategy = None  # Set by experimental_set_strategy.
_default_strategy = None  # Made lazily by the factory `strategy` registers (an import cycle).
_default_strategy_factory = None
_default_replica_context = None  # The default strategy's one replica context (a singleton).


def register_default_strategy_factory(factory: Callable[[], Any]) -> None:
    """Sets what makes the default strategy (the `strategy` module, which imports this one)."""
    global _default_strategy_factory
    _default_strategy_factory = factory


def _top():
    if _state.frames:
        return _state.frames[-1]
    if _global_strategy is not None:
        return _Frame(_global_strategy, None)
    return None


def _default():
    global _default_strategy
    if _default_strategy is None:
        _default_strategy = _default_strategy_factory()
    return _default_strategy


def _default_context():
    """The default strategy's replica context: one object, as TF's, so it can be told apart."""
    global _default_replica_context
    if _default_replica_context is None:
        _default_replica_context = ReplicaContext(_default(), 0)
    return _default_replica_context


def get_strategy() -> Any:
    """Returns the strategy whose scope or ``run`` encloses this call (else the default one).

    >>> import jdist
    >>> jdist.get_strategy().num_replicas_in_sync, jdist.has_strategy()
    (1, False)
    """
    top = _top()
    return _default() if top is None else top.strategy


def has_strategy() -> bool:
    """Returns whether a non-default strategy is current."""
    top = _top()
    return top is not None and top.strategy is not _default()


def in_cross_replica_context() -> bool:
    """Returns whether code runs in a cross-replica context (a scope, or a ``merge_fn``)."""
    top = _top()
    return top is not None and top.replica_context is None


def get_replica_context() -> Optional["ReplicaContext"]:
    """Returns the current `ReplicaContext`, or None in a cross-replica context.

    Outside any strategy this is the default strategy's replica context (one replica, id 0).

    >>> import jdist
    >>> ctx = jdist.get_replica_context()
    >>> ctx.num_replicas_in_sync, ctx.replica_id_in_sync_group, jdist.in_cross_replica_context()
    (1, 0, False)
    """
    top = _top()
    return _default_context() if top is None else top.replica_context


def experimental_set_strategy(strategy: Any) -> None:
    """Makes ``strategy`` current for the whole process, as if inside ``strategy.scope()``.

    None goes back to the default strategy. Raises `WrongContextError` inside a scope or a
    replica function.

    >>> import jdist
    >>> jdist.experimental_set_strategy(jdist.OneDeviceStrategy("cpu:0"))
    >>> jdist.has_strategy(), jdist.experimental_set_strategy(None), jdist.has_strategy()
    (True, None, False)
    """
    global _global_strategy
    if any(frame.strategy is not _default() for frame in _state.frames):
        raise errors.WrongContextError(
            "experimental_set_strategy cannot be called inside a `strategy.scope()` or a replica "
            "function; leave the scope first.")
    _global_strategy = None if strategy is _default() else strategy


@contextlib.contextmanager
def cross_replica_scope(strategy: Any, *, in_merge: bool = False) -> Iterator[Any]:
    """Enters ``strategy``'s cross-replica context (``strategy.scope()``; ``in_merge``:
    ``merge_call``'s, from a replica function). The default strategy's keeps its replica context."""
    if strategy is _default() and not in_merge:
        if has_strategy():
            raise errors.MixedStrategyError(
                "Must not nest tf.distribute.Strategy scopes: the default strategy's scope was "
                f"entered inside the scope of {get_strategy()!r}. Leave that scope first.")
        frame = _Frame(strategy, get_replica_context())
    else:
        if not in_merge:
            require_not_mixed(strategy, "scope()")
            if in_replica_function():
                raise errors.WrongContextError(
                    "strategy.scope() cannot be entered inside a replica function; use "
                    "get_replica_context().merge_call to reach the cross-replica context.")
        frame = _Frame(strategy, None, merge=in_merge)
    _state.frames.append(frame)
    try:
        yield strategy
    finally:
        _state.frames.pop()


def replica_scope(replica_context: "ReplicaContext") -> "ReplicaContext":
    """Enters a replica context (what ``strategy.run`` does around the replica function)."""
    return replica_context  # A context manager of itself.


def in_replica_function() -> bool:
    """Whether code runs inside a replica function of a non-default strategy (``run``)."""
    top = _top()
    return top is not None and top.replica_context is not None and (
        top.strategy is not _default_strategy)


def in_merge() -> bool:
    """Whether code runs in a ``merge_fn`` (the cross-replica context ``merge_call`` enters)."""
    return bool(_state.frames) and _state.frames[-1].merge


def in_replica_trace() -> bool:
    """Whether a replica function jdist compiles (or a ``merge_fn`` it calls) is being traced."""
    return any(frame.replica_context is not None and frame.replica_context._binding is not None
               for frame in _state.frames)


def require_not_mixed(strategy: Any, what: str) -> None:
    """Raises `MixedStrategyError` when another (non-default) strategy is current (TF's rule)."""
    top = _top()
    if top is not None and top.strategy is not strategy and top.strategy is not _default():
        raise errors.MixedStrategyError(
            f"Mixing different tf.distribute.Strategy objects: `{what}` of {strategy!r} was "
            f"called inside the scope of {top.strategy!r}. Call it outside that scope, or use "
            "the current strategy (jdist.get_strategy()).")


def require_run_allowed(strategy: Any) -> None:
    """Raises unless ``strategy.run`` may be called here (not nested, not mixed)."""
    if not _state.frames and _global_strategy is None:
        return  # Outside every scope, where a training loop usually calls run.
    require_not_mixed(strategy, "run")
    if in_replica_function():
        raise errors.WrongContextError(
            "strategy.run was called inside a replica function; nested run is not allowed. "
            "Call the inner function directly, or use get_replica_context().merge_call.")


def require_cross_replica(strategy: Any, what: str) -> None:
    """Raises unless ``what`` of ``strategy`` may run here (not mixed, not in a replica fn)."""
    require_not_mixed(strategy, what)
    if in_replica_function():
        alternative = "get_replica_context().all_gather" if "gather" in what else (
            "get_replica_context().all_reduce or merge_call")
        raise errors.WrongContextError(
            f"`{what}` was called inside a replica function (strategy.run); it may only be called "
            f"in the cross-replica context. Inside the replica function use {alternative}.")


@dataclasses.dataclass
class _Binding:
    """What a replica context knows while its replica function is being traced."""
    axis_name: str
    replica_id: Any  # A traced int32.
    active: bool = True
    exact: Any = None  # While one replica of an uneven step is traced (`uneven.plan`).


class ReplicaContext:
    """The strategy API inside a replica function (``tf.distribute.ReplicaContext``).

    Obtain it with `get_replica_context` inside the function given to ``strategy.run``, which is
    traced once as an SPMD program: ``replica_id_in_sync_group`` is a traced int32 scalar.

    Example:
      >>> import jax.numpy as jnp, jdist
      >>> s = jdist.MirroredStrategy(["cpu:0"])
      >>> def step():
      ...   ctx = jdist.get_replica_context()
      ...   return ctx.all_reduce("sum", jnp.float32(ctx.replica_id_in_sync_group + 1))
      >>> float(s.run(step))
      1.0
    """

    def __init__(self, strategy: Any, replica_id_in_sync_group: Any, *,
                 _binding: Optional[_Binding] = None) -> None:
        self._strategy = strategy
        self._replica_id = replica_id_in_sync_group
        self._binding = _binding
        self._collectives = strategy.extended._replica_collectives(_binding)

    @property
    def strategy(self) -> Any:
        """The `Strategy` this replica belongs to."""
        return self._strategy

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of replicas over which values are aggregated (a Python int)."""
        return self._strategy.num_replicas_in_sync

    @property
    def replica_id_in_sync_group(self) -> Any:
        """This replica's index in ``[0, num_replicas_in_sync)``; traced inside ``strategy.run``."""
        self._check_active("replica_id_in_sync_group")
        return self._replica_id

    @property
    def devices(self) -> tuple:
        """This replica's devices as TF-style names (all of them when the replica id is traced)."""
        names = self._strategy.extended.device_names
        return (names[self._replica_id],) if isinstance(self._replica_id, int) else tuple(names)

    def _check_active(self, what):
        if self._binding is not None and not self._binding.active:
            raise errors.WrongContextError(
                f"ReplicaContext.{what} was called after its strategy.run returned; a replica "
                "context may only be used inside the replica function that obtained it.")

    def _require_current(self, what):
        """Raises unless this is the current replica context (TF's ``require_replica_context``)."""
        self._check_active(what)
        current = get_replica_context()
        if current is self:
            return
        if current is None:
            raise errors.WrongContextError(
                f"ReplicaContext.{what} was called in the cross-replica context of "
                f"{get_strategy()!r}; call it from a replica function (strategy.run), with the "
                "context get_replica_context() returns there.")
        if current.strategy is self._strategy:
            raise errors.WrongContextError(
                f"Mismatching ReplicaContext: {what} was called on a replica context that is not "
                "the current one; use get_replica_context() where the call is made.")
        raise errors.MixedStrategyError(
            f"Mixing different tf.distribute.Strategy objects: ReplicaContext.{what} of "
            f"{self._strategy!r} was called where {current.strategy!r} is current; use "
            "get_replica_context() where the call is made.")

    def all_reduce(self, reduce_op: "ReduceOp | str", value: Any,
                   options: Optional[Any] = None) -> Any:
        """All-reduces a nest of arrays (same shapes on every replica); every replica gets it.

        ``options``: a `CommunicationOptions` or None (``bytes_per_pack`` packs the leaves). On
        one replica the nest comes back itself, dtypes included, as in TF.
        """
        self._require_current("all_reduce")
        op = ReduceOp.from_any(reduce_op)
        reduce_wing().as_options(options)  # Checked on one replica too, which reduces nothing.
        self._strategy.extended._check_batch_reduce(value, "all_reduce")  # A nest is one batch.
        check_reducible(op, value, adds=self.num_replicas_in_sync > 1)
        self._strategy.extended._check_collective_dtypes(value, "all_reduce")
        if self.num_replicas_in_sync == 1:  # TF: one replica's value reduces to itself, dtype
            return jax.tree_util.tree_map(jnp.asarray, value)  # too (an int MEAN stays int).
        return self._collectives.all_reduce(op, value, options)

    def all_gather(self, value: Any, axis: int, options: Optional[Any] = None) -> Any:
        """Concatenates each replica's ``value`` (a nest) along ``axis``; every replica gets it."""
        self._require_current("all_gather")
        reduce_wing().as_options(options)
        host_values.check_arrays(value, "all_gather")
        self._strategy.extended._check_gather(value, axis, "all_gather")
        return self._collectives.all_gather(value, axis)

    def merge_call(self, merge_fn: Callable[..., Any], args: Sequence[Any] = (),
                   kwargs: Optional[dict] = None) -> Any:
        """Runs ``merge_fn(strategy, *args, **kwargs)`` once in the cross-replica context.

        Per-replica arguments reach ``merge_fn`` as `PerReplica` values; `PerReplica` results are
        unpacked so each replica gets its own component. In a traced replica function
        ``merge_fn`` is traced once and computed by every device on the gathered arguments.
        """
        self._require_current("merge_call")
        if not callable(merge_fn):
            raise errors.UnsupportedValueError(
                f"merge_call expects a function as merge_fn, got {type(merge_fn).__name__}.")
        if not isinstance(args, (tuple, list)):
            raise errors.InvalidArgumentError(
                f"merge_call args must be a tuple or list, got {type(args).__name__}.")
        return self._collectives.merge_call(merge_fn, args, {} if kwargs is None else kwargs)

    def __enter__(self) -> "ReplicaContext":
        _state.frames.append(_Frame(self._strategy, self))
        return self

    def __exit__(self, *exc: Any) -> None:
        _state.frames.pop()

    def __repr__(self):
        return (f"ReplicaContext(strategy={self._strategy!r}, "
                f"replica_id_in_sync_group={self._replica_id!r})")


@dataclasses.dataclass(frozen=True)
class ValueContext:
    """What `Strategy.experimental_distribute_values_from_function` tells ``value_fn``."""
    replica_id_in_sync_group: int = 0
    num_replicas_in_sync: int = 1
