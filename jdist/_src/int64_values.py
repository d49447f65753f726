"""Where a value's int64 numbers came from: what TF holds as int64 and JAX without x64 as int32.

TF keeps int64 host numbers (tf.data's integers, NumPy's default) int64 in every value made from
them and every integer computed from them; JAX without x64 holds them as int32, which gives the
same numbers until a sum or product leaves int32's range. So jdist records, on each value it makes
from int64 host numbers, the magnitudes of those numbers (`record_int64_magnitude`): their sum
over every replica, the largest one, and the largest sum on one replica. `run` records its own
integer outputs' bounds the same way (`record_int64_bounds`, from `int64_sums`). Reductions and
steps read them (`int64_sum_magnitude`, `int64_max_magnitude`, `holds_tf_int64`) to give TF's
number or raise `X64RequiredError` where int32's could differ.

A `PerReplica` or `Mirrored` keeps them in its ``_int64_bounds`` slot (a `Mirrored`, whose
class sets ``_int64_per_copy``, one copy's); a plain ``jax.Array`` (what one replica gets, as in
TF) has no room of its own, so its bounds are kept beside it while it lives.

A value's arrays keep its bounds beside them too (`follow`), so that the value JAX rebuilds
from the same arrays (``jax.tree.map(jnp.asarray, batch)``, any pytree function that returns
its leaves as they are) has them again (`inherit`): without them its sums would pass unchecked.
"""

import weakref

import jax
import numpy as np

from jdist._src.host_values import held_as_int32
from jdist._src.host_values import int64_largest
from jdist._src.host_values import int64_magnitude

# id(first array): (weak references to the arrays, kind, bounds), kept while the arrays live.
# Kind: None for a plain array's own record (`record_int64_bounds`), else the
# ``_int64_per_copy`` of the value whose arrays they are (`follow`).
_KEPT = {}
_ARRAYS = (jax.Array, np.ndarray)


def record_int64_magnitude(value, components) -> None:
    """Records on ``value``, a `PerReplica` made from the host values ``components`` (one per
    replica, or stacked with the replica axis first), a `Mirrored` made from one copy, or one
    replica's plain array made from one, the magnitudes of their int64 numbers
    (`record_int64_parts`); nothing where none of them is int64.

    Example:
      >>> import jdist
      >>> v = jdist.PerReplica([np.array([3, -4]), np.array([5, 0])])
      >>> int64_sum_magnitude(v), int64_max_magnitude(v), int64_max_magnitude(v, True)
      (12, 5, 7)
    """
    record_int64_parts(value, int64_parts(components))


def int64_parts(components):
    """Per component (host values, one per replica, or stacked with the replica axis first),
    ``[sum, largest]`` of the magnitudes of its int64 numbers (JSON-able, for an exchange
    between workers); None where none of them is int64.

    Example:
      >>> int64_parts([np.array([3, -4]), np.array([5, 0])]), int64_parts([np.zeros(2)])
      ([[7, 4], [5, 5]], None)
    """
    if not any(map(held_as_int32, [components] if isinstance(components, np.ndarray)
                   else components)):
        return None
    return [[int64_magnitude([c]), int64_largest([c])] for c in components]


def record_int64_parts(value, parts) -> None:
    """Records on ``value`` the bounds of its replicas' int64 numbers from their `int64_parts`
    (every replica's, in replica order); nothing where ``parts`` is None."""
    if parts is not None:
        sums = [total for total, _ in parts]
        record_int64_bounds(value, sum(sums), max(largest for _, largest in parts), max(sums))


def record_int64_bounds(value, total: int, largest: int, replica: int = None) -> None:
    """Records that ``value`` (a `PerReplica`, one copy of a `Mirrored`, or one replica's
    plain ``jax.Array``) holds, as int32, TF's int64 numbers whose magnitudes add up to at most
    ``total`` (every replica's), each at most ``largest``, and at most ``replica`` on one
    replica (``total`` if not given)."""
    bounds = (int(total), int(largest), int(total if replica is None else replica))
    if not isinstance(value, jax.core.Tracer):
        _record(value, bounds)


def record_traced_bounds(value, bounds) -> None:
    """Records on ``value``, a traced `PerReplica`, `Mirrored` or plain array (inside a
    `jdist.function`), its bounds as forms in the function's arguments (`int64_sums`), read by
    `traced_bounds`."""
    _record(value, bounds)


def traced_bounds(value):
    """What `record_traced_bounds` recorded on ``value``, or None."""
    recorded = _stored(value)
    return None if recorded is None or type(recorded) is tuple else recorded


def _record(value, bounds):
    per_copy = getattr(type(value), "_int64_per_copy", None)
    if per_copy is not None:  # A `PerReplica` or a `Mirrored`.
        value._int64_bounds = bounds
        if per_copy:  # A `Mirrored`'s array is flattened by JAX's C++ code: kept now.
            _keep((value.value,), True, bounds)
    elif isinstance(value, jax.Array):  # A plain array, or a traced one: kept while it lives.
        _keep((value,), None, bounds)


def _keep(arrays, kind, bounds):
    key, refs = id(arrays[0]), []
    for array in arrays:  # Another worker's replica is a shape (`jax.ShapeDtypeStruct`): kept.
        refs.append(weakref.ref(array, lambda _: _KEPT.pop(key, None))
                    if isinstance(array, _ARRAYS) else (lambda shape=array: shape))
    _KEPT[key] = (tuple(refs), kind, bounds)


def _entry(arrays):
    entry = _KEPT.get(id(arrays[0])) if arrays else None
    if entry is None or len(entry[0]) != len(arrays):
        return None
    return entry if all(r() is a for r, a in zip(entry[0], arrays)) else None


def follow(value, arrays) -> None:
    """Keeps ``value``'s bounds, if recorded, beside ``arrays``, its pytree children (called
    as a `PerReplica` is flattened), for a value `inherit` makes from them."""
    bounds = value._int64_bounds
    if bounds is not None and any(isinstance(a, _ARRAYS) for a in arrays):
        entry = _entry(arrays)
        if entry is None or entry[2] is not bounds:
            _keep(arrays, type(value)._int64_per_copy, bounds)


def inherit(value, arrays) -> None:
    """Records on ``value``, a `PerReplica` or `Mirrored` just made from ``arrays`` (its
    pytree children, as JAX unflattens it), the bounds of the value of its kind they came
    from (`follow`), if any.

    Example:
      >>> import jax, jdist
      >>> v = jdist.PerReplica([np.array([3, -4]), np.array([5, 0])])
      >>> int64_sum_magnitude(jax.tree.map(lambda a: a, v))
      12
    """
    entry = _entry(arrays) if _KEPT else None
    if entry is not None and entry[1] is type(value)._int64_per_copy:
        value._int64_bounds = entry[2]


def _stored(value):
    if hasattr(type(value), "_int64_per_copy"):
        return getattr(value, "_int64_bounds", None)
    entry = _entry((value,))
    if entry is None or entry[1] is not False:
        return None if entry is None else entry[2]
    # A `PerReplica`'s one array, held whole (replicated) as a plain value: its numbers are
    # every replica's.
    bounds = entry[2]
    return (bounds[0], bounds[1], bounds[0]) if type(bounds) is tuple else None


def _recorded(value):
    """``(total, largest, replica)`` recorded for ``value``, or None."""
    recorded = _stored(value)
    return recorded if type(recorded) is tuple else None


def int64_sum_magnitude(value, copies: int = 1) -> int:
    """The magnitude of the int64 numbers a SUM of ``value`` adds: a `PerReplica`'s recorded
    total, a `Mirrored`'s, a plain array's or a host array's ``copies`` times (one per replica
    holding it), else 0."""
    recorded = _recorded(value)
    if recorded is None:
        return 0 if hasattr(type(value), "_int64_per_copy") else int64_magnitude([value]) * copies
    return recorded[0] * (copies if getattr(type(value), "_int64_per_copy", True) else 1)


def int64_max_magnitude(value, per_replica: bool = False) -> int:
    """The largest magnitude of the int64 numbers in ``value``, or with ``per_replica`` the
    largest sum of them on one replica (a `Mirrored`'s, a plain or host array's: one copy's);
    0 where it holds none."""
    recorded = _recorded(value)
    if recorded is not None:
        return recorded[2 if per_replica else 1]
    return int64_magnitude([value]) if per_replica else int64_largest([value])


def holds_tf_int64(value) -> bool:
    """Whether TF holds ``value`` as int64 where JAX without x64 holds int32: a value made from
    int64 host numbers (all zeros too) or computed from them by ``run``, or such a host array.

    Example:
      >>> holds_tf_int64(np.zeros(2, np.int64)), holds_tf_int64(np.zeros(2, np.int32))
      (True, False)
    """
    return _recorded(value) is not None or held_as_int32(value)


def adds_no_int64(value) -> bool:
    """Whether a SUM of ``value`` adds no int64 host numbers, known without reading them: a
    `PerReplica` or `Mirrored` with no record (nor traced bounds).

    Example:
      >>> import jdist
      >>> adds_no_int64(jdist.PerReplica([np.ones(2, np.int32)])), adds_no_int64(np.ones(2))
      (True, False)
    """
    return hasattr(type(value), "_int64_per_copy") and _stored(value) is None
