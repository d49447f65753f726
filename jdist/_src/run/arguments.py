"""``strategy.run``'s argument leaves as its programs see them: kind, key entry, abstract value.

Kinds: a `PerReplica` (stacked), a `Mirrored`, a plain array or number (every replica gets the
value, as a `Mirrored`'s), a static Python object (compiled in).
"""

from typing import Any

import jax
import jax.numpy as jnp

from jdist._src import errors
from jdist._src.base import ARRAY, MIRRORED, PER_REPLICA, STATIC
from jdist._src.host_values import check_host_numbers
from jdist._src.host_values import is_placeable
from jdist._src.host_values import python_numbers_as_tf
from jdist._src.values import ARRAYS
from jdist._src.values import SCALARS
from jdist._src.values import Mirrored
from jdist._src.values import PerReplica
from jdist._src.values import check_replica_count
from jdist._src.values import is_step_output
from jdist._src.values import ragged_components


def classify_leaf(leaf, place) -> tuple:
    """``(kind, value, signature entry, traced)`` of one argument leaf; ``value`` is what the
    program takes (placed on ``place``'s mesh when concrete), None for a static leaf."""
    if isinstance(leaf, PerReplica) and leaf.ragged:
        components = ragged_components(leaf)  # Other workers' replicas: shapes only.
        return (PER_REPLICA, leaf, ("ragged", tuple(tuple(c.shape) for c in components),
                                    components[0].dtype),
                any(isinstance(c, jax.core.Tracer) for c in components))
    if isinstance(leaf, (PerReplica, Mirrored)):
        check_replica_count(leaf, place.num_replicas, "strategy.run")
        per_replica = isinstance(leaf, PerReplica)
        value = leaf.stacked if isinstance(leaf, PerReplica) else leaf.value  # (mypy narrows this.)
        traced = isinstance(value, jax.core.Tracer)
        if not traced:
            value = (place.place_per_replica if per_replica else place.place_replicated)(value)
        entry = (value.shape, value.dtype)
        return (PER_REPLICA if per_replica else MIRRORED), value, entry, traced
    if isinstance(leaf, ARRAYS):
        if not is_placeable(leaf):
            raise errors.UnsupportedValueError(
                f"strategy.run got an array of dtype {leaf.dtype} as an argument; JAX arrays "
                "hold numbers and bools only. Pass text as a Python str (compiled into the "
                "step as a constant), or encode it as numbers in the input pipeline.")
        check_host_numbers(leaf)  # The compiled call would take it in 32 bits (no x64).
        traced = isinstance(leaf, jax.core.Tracer)
        if not traced and isinstance(leaf, jax.Array) and leaf.committed and (
                leaf.sharding != place.replicated_sharding):
            leaf = place.place_replicated(leaf)
        return ARRAY, leaf, (leaf.shape, leaf.dtype, getattr(leaf, "weak_type", False)), traced
    if type(leaf) is bool:  # A flag (``training=True``): TF's replica function branches on
        return STATIC, None, ("static", bool, leaf), False  # it in Python, so it is compiled in.
    if isinstance(leaf, SCALARS):
        if type(leaf) is int and not -2**31 <= leaf < 2**31:  # TF's int64 (JAX's, with x64).
            python_numbers_as_tf(leaf)  # Raises without x64, as TF's int64 would be wrapped.
        return ARRAY, leaf, (type(leaf),), False
    try:
        hash(leaf)
    except TypeError:
        raise errors.UnsupportedValueError(
            f"strategy.run got an argument of type {type(leaf).__name__} that is neither an "
            "array nor hashable; pass arrays, DistributedValues or hashable Python objects "
            "(those are compiled in as constants).") from None
    return STATIC, None, ("static", type(leaf), leaf), False


def fast_leaf(leaf, num_replicas: int) -> bool:
    """Whether the fast path takes ``leaf``: an array or an even distributed value."""
    if isinstance(leaf, PerReplica):
        return not leaf.ragged and leaf.num_replicas == num_replicas
    return isinstance(leaf, (Mirrored,) + ARRAYS)


def placed(leaf, place):
    """A distributed argument whose array is on ``place``'s mesh (``leaf`` itself if it is)."""
    if isinstance(leaf, PerReplica):
        stacked = place.place_per_replica(leaf.stacked)
        return leaf if stacked is leaf.stacked else PerReplica._from_stacked(stacked)
    check_replica_count(leaf, place.num_replicas, "strategy.run")
    value = place.place_replicated(leaf.value)
    return leaf if value is leaf.value else Mirrored._from_value(
        value, place.num_replicas, is_step_output(leaf))


def trace_statics(leaves: list, kinds: tuple) -> list:
    """Per argument leaf: itself if static, else None (the trace takes its abstract value)."""
    return [leaf if kind == STATIC else None for leaf, kind in zip(leaves, kinds)]


def program_key(in_tree, kinds, signature):
    """What selects a function's program: its arguments, and 64-bit mode (as ``jax.jit``'s)."""
    return in_tree, kinds, signature, jax.config.jax_enable_x64


def abstract(leaf: Any, kind: str, replica: Any = None) -> jax.ShapeDtypeStruct:
    """The abstract argument a trace takes for ``leaf``; a per-replica one is stacked, with
    ``replica``'s shape for every replica when it is ragged."""
    if kind == PER_REPLICA and leaf.ragged:
        component = ragged_components(leaf)[replica]
        return jax.ShapeDtypeStruct((leaf.num_replicas,) + component.shape, component.dtype)
    if kind == PER_REPLICA:
        return jax.ShapeDtypeStruct(leaf.stacked.shape, leaf.stacked.dtype)
    if kind == MIRRORED:
        return jax.ShapeDtypeStruct(leaf.value.shape, leaf.value.dtype)
    if isinstance(leaf, SCALARS):
        return jax.ShapeDtypeStruct((), jnp.asarray(leaf).dtype, weak_type=True)
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                weak_type=getattr(leaf, "weak_type", False))
