"""Distributed values: one sharded `jax.Array` seen as one value per replica.

* `PerReplica` wraps one array of shape ``(num_replicas, *per_replica_shape)`` sharded over the
  replica axis, so replica ``i``'s value is the block device ``i`` already holds (no copy).
  Replicas of different shapes (a partial batch) are held one array per replica (*ragged*).
* `Mirrored` wraps one replicated array: every replica holds the same value.

Both are pytree nodes, so they pass through ``jax.jit``, ``jax.tree_util`` and ``lax.scan``.
"""

import functools
from typing import Any, NamedTuple, Optional, Sequence

import jax
import numpy as np

from jdist._src import errors
from jdist._src.host_values import (SCALARS, check_arrays, check_host_numbers,
                                    python_numbers_as_tf, dtype_kind)


ARRAYS = (jax.Array, np.ndarray, np.generic)  # What jdist takes as an array leaf.


class DistributedValues:
    """Base class of values with one component per replica (``tf.distribute.DistributedValues``).

    Not created directly: `Strategy.run`, `Strategy.experimental_distribute_values_from_function`
    and distributed datasets create them.
    """

    __slots__ = ()
    __array_ufunc__ = None  # NumPy hands binary operators back: `np_array + v` raises ours.

    @property
    def values(self) -> tuple:
        """The per-replica components, a tuple with one array per local replica, in order."""
        return self._local_results()

    def _local_results(self):
        raise errors.UnsupportedValueError(f"{type(self).__name__} has no per-replica components.")

    @property
    def num_replicas(self) -> int:
        """How many replicas this value has a component for."""
        return len(self._local_results())


class PerReplica(DistributedValues):
    """A value that may differ between replicas (``tf.distribute.PerReplica``).

    Values of one shape are held as one array ``stacked`` of shape
    ``(num_replicas, *per_replica_shape)``; values of different shapes (*ragged*) as one array
    per replica. Arithmetic on it in the cross-replica context is an error, as in TF. ``values``
    holds one array or number per replica, all of one dtype kind (else `InvalidArgumentError`):
    arrays already on distinct devices are assembled without copying, host arrays stacked.

    Example:
      >>> import numpy as np, jdist
      >>> v = jdist.PerReplica([np.float32(1.0), np.float32(2.0)])
      >>> [float(x) for x in v.values]
      [1.0, 2.0]
      >>> jdist.PerReplica([np.zeros(2, np.float32), np.zeros(3, np.float32)]).ragged
      True
      >>> jdist.PerReplica([np.float32(1.0), 2.0]).stacked.dtype  # float32 and float64: one kind
      dtype('float32')
    """

    __slots__ = ("_stacked", "_lengths", "_components")

    def __init__(self, values: Sequence[Any]) -> None:
        if isinstance(values, DistributedValues) or not isinstance(values, (tuple, list)):
            raise errors.UnsupportedValueError(
                "PerReplica(values) takes a tuple or list with one array per replica, got "
                f"{type(values).__name__}.")
        if not values:
            raise errors.InvalidArgumentError("PerReplica needs at least one replica value.")
        stacked, components = _stack_or_keep(values)
        self._init(stacked, components, None)

    def _init(self, stacked, components, lengths):
        self._stacked = stacked
        self._components = components
        self._lengths = None if lengths is None else tuple(int(n) for n in lengths)
        return self

    @classmethod
    def _from_stacked(cls, stacked, lengths=None):
        """Wraps ``stacked`` (replica axis first) without copying; ``lengths`` marks real rows."""
        return object.__new__(cls)._init(stacked, None, lengths)

    @classmethod
    def _from_components(cls, components):
        """One value per replica: stacked when their shapes agree, else kept ragged."""
        return object.__new__(cls)._init(*_stack_or_keep(list(components)), None)

    @classmethod
    def _from_ragged(cls, components):
        """A ragged value as given, unchecked (other workers' replicas: `jax.ShapeDtypeStruct`)."""
        return object.__new__(cls)._init(None, tuple(components), None)

    @property
    def ragged(self) -> bool:
        """True when the replicas hold values of different shapes (one array per replica)."""
        return self._components is not None

    @property
    def stacked(self) -> Any:
        """The array ``(num_replicas, *per_replica_shape)``; `ShapeMismatchError` if ragged."""
        if self._components is not None:
            raise errors.ShapeMismatchError(
                "this PerReplica value is ragged (its replicas hold shapes "
                f"{[tuple(c.shape) for c in self._components]}), so it has no single stacked "
                "array and cannot be combined element-wise; use strategy.gather(v, axis), "
                "strategy.reduce(op, v, axis=...) or strategy.experimental_local_results(v).")
        return self._stacked

    @property
    def num_replicas(self) -> int:
        if self._components is not None:
            return len(self._components)
        return self._stacked.shape[0]

    def _local_results(self):
        if self._components is not None:  # Multi-worker: other workers' replicas are specs.
            return tuple(c for c in self._components if not isinstance(c, jax.ShapeDtypeStruct))
        if _spans_processes(self._stacked):  # Multi-worker: this process's replicas.
            return tuple(_component(self._stacked, i, self._lengths) for i in
                         sorted(s.index[0].start for s in self._stacked.addressable_shards))
        return tuple(_component(self._stacked, i, self._lengths) for i in range(self.num_replicas))

    def __repr__(self):
        if self._components is not None:
            return (f"PerReplica(num_replicas={len(self._components)}, shapes="
                    f"{[tuple(c.shape) for c in self._components]}, "
                    f"dtype={self._components[0].dtype})")
        lengths = "" if self._lengths is None else f", lengths={self._lengths}"
        shape = np.shape(self._stacked)
        dtype = getattr(self._stacked, "dtype", type(self._stacked).__name__)
        return (f"PerReplica(num_replicas={shape[0] if shape else '?'}, shape={shape[1:]}, "
                f"dtype={dtype}{lengths})")

    def _raise_arithmetic(self, *_):
        raise errors.CrossReplicaArithmeticError(
            "Arithmetic on a PerReplica value is not allowed in the cross-replica context: each "
            "replica holds a different value. Combine them with strategy.reduce(...) or "
            "strategy.gather(...), or compute inside strategy.run(fn, args=(value,)).")

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _raise_arithmetic
    __truediv__ = __rtruediv__ = __floordiv__ = __rfloordiv__ = _raise_arithmetic
    __matmul__ = __rmatmul__ = __pow__ = __rpow__ = __mod__ = __rmod__ = _raise_arithmetic
    __neg__ = __abs__ = __lt__ = __le__ = __gt__ = __ge__ = _raise_arithmetic
    __array__ = __jax_array__ = __float__ = __int__ = __bool__ = _raise_arithmetic

    def __getitem__(self, index):
        raise errors.CrossReplicaArithmeticError(
            "A PerReplica value cannot be indexed in the cross-replica context: its first axis "
            "is the replicas. Index each replica's value inside strategy.run. " + STEPS_RECIPE)


_UNSET = object()  # "No value given" (a pytree node's value may be None).


class Mirrored(DistributedValues):
    """A value that is the same on every replica (``tf.distribute.Mirrored``).

    Held as one replicated array; it can be used like that array in the cross-replica context.
    ``values``: one (equal) array per replica, or a single array.

    Example:
      >>> import numpy as np, jdist
      >>> m = jdist.Mirrored([np.float32(3.0), np.float32(3.0)])
      >>> float(m + 1)
      4.0
    """

    __slots__ = ("_value", "_copies")
    _copies: "Optional[_Copies]"  # None where JAX rebuilt it (`_Copies`).

    def __init__(self, values: Any = None, *, _value: Any = _UNSET) -> None:
        if _value is not _UNSET:  # JAX rebuilding the node (`_Copies` says why it keeps no count).
            self._value, self._copies = _value, None
            return
        if values is None:
            raise errors.InvalidArgumentError("Mirrored needs a value (or one per replica).")
        check_arrays(values, "Mirrored")  # One value, or one per replica.
        if isinstance(values, (tuple, list)):
            if not values:
                raise errors.InvalidArgumentError("Mirrored needs at least one replica value.")
            first = np.asarray(values[0])
            for v in values[1:]:
                if not np.array_equal(np.asarray(v), first, equal_nan=True):
                    raise errors.InvalidArgumentError(
                        "Mirrored values must be equal on every replica; use PerReplica for "
                        "values that differ.")
            self._copies = copies_of(len(values), False)
            values = values[0]
        else:
            self._copies = copies_of(1, False)
        check_host_numbers(values)
        self._value = jax.numpy.asarray(values)

    @classmethod
    def _from_value(cls, value, num_replicas, step_output=False):
        """A `Mirrored` of ``value``; ``num_replicas`` None: one JAX rebuilt (`_Copies`)."""
        self = object.__new__(cls)
        self._value = value
        self._copies = None if num_replicas is None else copies_of(num_replicas, step_output)
        return self

    def __reduce__(self):
        return Mirrored._from_value, (self._value, self._known_replicas(), is_step_output(self))

    @property
    def value(self) -> Any:
        """The common value, an array replicated on every replica's device."""
        return self._value

    @property
    def num_replicas(self) -> int:
        """How many replicas hold it (1 for a host value JAX rebuilt: `_Copies`)."""
        return self._known_replicas() or 1

    def _known_replicas(self) -> Optional[int]:
        copies = self._copies
        return copies.num_replicas if copies is not None else _replicas_held(self._value)

    def _local_results(self):
        value = self._value
        shards = None if isinstance(value, jax.core.Tracer) else getattr(
            value, "addressable_shards", None)
        if shards is not None and (len(shards) == self.num_replicas
                                   or _spans_processes(value)):  # Each device's copy.
            return tuple(shard.data for shard in shards)
        return (value,) * self.num_replicas

    def __repr__(self):
        return (f"Mirrored(num_replicas={self.num_replicas}, shape={np.shape(self._value)}, "
                f"dtype={getattr(self._value, 'dtype', type(self._value).__name__)})")

    def __jax_array__(self):
        return self._value

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self._value, dtype=dtype)

    @property
    def shape(self) -> tuple:
        """The common value's shape."""
        return self._value.shape

    @property
    def dtype(self) -> Any:
        """The common value's dtype."""
        return self._value.dtype


def _delegate(name):
    def method(self, *other):
        return getattr(self._value, name)(*(o._value if isinstance(o, Mirrored) else o
                                            for o in other))
    method.__name__ = name
    return method


# __iter__ and __len__ too: else Python iterates through __getitem__, which JAX never ends.
for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
              "__rtruediv__", "__floordiv__", "__rfloordiv__", "__pow__", "__rpow__", "__mod__",
              "__rmod__", "__matmul__", "__rmatmul__", "__lt__", "__le__", "__gt__", "__ge__",
              "__float__", "__int__", "__bool__", "__getitem__", "__neg__", "__abs__", "__iter__",
              "__len__"):
    setattr(Mirrored, _name, _delegate(_name))


def is_python_number(value: Any) -> bool:
    """Whether ``value`` is a Python number (a bool, int, float or complex; NumPy's are arrays)."""
    return type(value) in SCALARS


def _stack_or_keep(values):
    """``(stacked, None)`` for values of one shape; ``(None, components)`` for ragged ones."""
    arrays = _components(values)
    dtypes = {jax.dtypes.canonicalize_dtype(a.dtype, allow_extended_dtype=True) for a in arrays}
    if len(dtypes) > 1:
        raise errors.InvalidArgumentError(
            f"the replicas' values have dtypes {sorted(map(str, dtypes))}: one kind, but dtypes "
            "JAX keeps apart (float32 and float64 only with jax_enable_x64), and a jdist "
            "PerReplica holds one dtype for all replicas: cast them to one dtype.")
    if len({tuple(a.shape) for a in arrays}) == 1:
        return _stack(arrays), None
    return None, tuple(arrays)


def _kind(array, index):
    name = dtype_kind(array.dtype)
    if name is None:
        raise errors.UnsupportedValueError(
            f"PerReplica component {index} has dtype {array.dtype}, which cannot be placed on a "
            "device; each replica's value must be a numeric or bool array.")
    return name


def _components(values):
    """The replicas' values as arrays, checked: arrays or numbers, all of one dtype kind."""
    arrays = []
    for i, v in enumerate(values):
        if isinstance(v, jax.Array):  # Tracers too (values built inside a traced merge_fn).
            arrays.append(v)
        elif isinstance(v, (np.ndarray, np.generic)):
            check_host_numbers(v)
            arrays.append(np.asarray(v))
        elif isinstance(v, SCALARS):
            arrays.append(python_numbers_as_tf(v))  # TF's types: a float is float32.
        else:
            raise errors.UnsupportedValueError(
                f"PerReplica component {i} is a {type(v).__name__}; each replica's value must "
                "be an array or a number (for a nest of values, build one PerReplica per leaf).")
    kinds = [_kind(a, i) for i, a in enumerate(arrays)]
    if len(set(kinds)) > 1:
        raise errors.InvalidArgumentError(
            "the replicas' values must share a dtype kind, got dtypes "
            f"{[str(a.dtype) for a in arrays]} ({', '.join(dict.fromkeys(kinds))}).")
    return arrays


def _stack(arrays):
    """Stacks per-replica arrays of one shape into one array with the replica axis first."""
    if any(isinstance(v, jax.core.Tracer) for v in arrays):
        return jax.numpy.stack(arrays)  # Built inside a traced function (e.g. a merge_fn).
    devices = [next(iter(a.devices())) if isinstance(a, jax.Array) and a.committed
               and len(a.devices()) == 1 else None for a in arrays]
    if None not in devices and len(set(devices)) == len(devices):
        mesh = jax.sharding.Mesh(np.array(devices), ("replica",))
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("replica"))
        return jax.make_array_from_single_device_arrays(
            (len(arrays), *arrays[0].shape), sharding, [a[None] for a in arrays])
    if jax.dtypes.issubdtype(arrays[0].dtype, jax.dtypes.extended):
        return jax.numpy.stack(arrays)  # Typed PRNG keys have no NumPy form.
    return np.stack([np.asarray(a) for a in arrays],
                    dtype=jax.dtypes.canonicalize_dtype(arrays[0].dtype))


def _spans_processes(array):
    """Whether ``array`` has shards in other processes (multi-worker)."""
    return (isinstance(array, jax.Array) and not isinstance(array, jax.core.Tracer)
            and not array.is_fully_addressable)


def _component(stacked, index, lengths):
    """Replica ``index``'s component of ``stacked``, read from its own device when sharded."""
    shards = None if isinstance(stacked, jax.core.Tracer) else getattr(
        stacked, "addressable_shards", None)
    if shards is not None and _spans_processes(stacked):
        block = next(s.data for s in shards if s.index[0].start == index)
    elif shards is not None and len(shards) == stacked.shape[0]:
        block = shards[index].data  # Already on the replica's device: no gather.
    else:
        block = stacked[index:index + 1]
    value = block[0]
    if lengths is not None:
        value = value[:lengths[index]]
    return value


def _flatten_per_replica(v):
    if v._components is not None:
        return v._components, ("ragged", len(v._components), None)
    return (v._stacked,), ("stacked", v._lengths, v._stacked.shape)


def _unflatten_per_replica(aux, children):
    kind, lengths, shape = aux
    if kind == "ragged":
        return PerReplica._from_ragged(children)
    _check_not_sliced(shape, children[0])
    return PerReplica._from_stacked(children[0], lengths)


jax.tree_util.register_pytree_node(PerReplica, _flatten_per_replica, _unflatten_per_replica)

STEPS_RECIPE = (
    "To run K steps in one program, give each replica its K batches stacked, (K, batch, ...) "
    "(`iterator.get_next_steps(K)`), and scan over them inside the replica function: "
    "strategy.run(lambda state, xs: lax.scan(step, state, xs), args=(state, xs)). "
    "Or call strategy.run once per step in a Python loop inside jdist.function.")


def _check_not_sliced(shape, stacked):
    """Raises where JAX rebuilds a `PerReplica` from an array of another shape: ``lax.scan`` or
    ``vmap`` sliced its stacked array, whose first axis is the replicas, not steps."""
    new_shape = getattr(stacked, "shape", None)  # JAX also unflattens with non-array leaves.
    if new_shape is not None and shape is not None and tuple(new_shape) != shape:
        raise errors.InvalidArgumentError(
            f"a PerReplica of stacked shape {shape} (replicas first) was rebuilt with shape "
            f"{tuple(new_shape)}: lax.scan, vmap, fori_loop or a tree_map sliced or reshaped "
            "it, which would cut across replicas, not steps. " + STEPS_RECIPE)


class _Copies(NamedTuple):
    """How many replicas hold a `Mirrored` and whether ``run`` returned it; one object per pair
    (`copies_of`).

    Not pytree metadata: any metadata field costs every `Mirrored` that ``jax.jit`` dispatches
    0.04 us (a tuple per node, compared per call), which ``run`` pays per parameter per step.
    A `Mirrored` JAX rebuilds (``jax.jit``'s outputs, ``tree_map``, ``lax.scan``) has none: it
    reduces as ``run``'s outputs do, on as many replicas as devices hold it (a host value: the
    count of the strategy that uses it).
    """
    num_replicas: int
    step_output: bool


copies_of = functools.lru_cache(maxsize=None)(_Copies)
jax.tree_util.register_dataclass(Mirrored, data_fields=["_value"], meta_fields=[])


def _replicas_held(value):
    """How many devices hold ``value``, the count of a `Mirrored` JAX rebuilt; None where no
    device was chosen for it (a host value, an uncommitted array, a tracer outside a mesh):
    such a value is replicated on whichever strategy's devices use it."""
    if isinstance(value, jax.core.Tracer):
        return jax.typeof(value).sharding.mesh.size or None  # 0 outside a mesh.
    if isinstance(value, jax.Array) and value.committed:
        return len(value.sharding.device_set)
    return None


def is_step_output(value: Any) -> bool:
    """Whether ``value`` is a `Mirrored` that ``run`` returned or JAX rebuilt (TF's `PerReplica` of
    equal values, whose MEAN sums then divides); any other `Mirrored` is TF's (MEAN: itself)."""
    return isinstance(value, Mirrored) and (value._copies is None or value._copies.step_output)


def wrap_at(leaves: list, mirrored_at: Sequence[int], num_replicas: int,
            per_replica_at: Sequence[int] = ()) -> None:
    """Wraps ``leaves`` in place: step-output `Mirrored` at ``mirrored_at``, `PerReplica` at
    ``per_replica_at`` (`run`'s outputs, on every step: one Python frame for all of them)."""
    new, copies = object.__new__, copies_of(num_replicas, True)
    for i in mirrored_at:
        m = new(Mirrored)
        m._value, m._copies = leaves[i], copies
        leaves[i] = m
    for i in per_replica_at:
        leaves[i] = PerReplica._from_stacked(leaves[i])


def check_replica_count(value: DistributedValues, num_replicas: int, what: str) -> None:
    """Raises where a value made by a strategy of another replica count reaches ``what`` (a
    host value JAX rebuilt as a `Mirrored` takes any count: `_Copies`)."""
    count = value._known_replicas() if isinstance(value, Mirrored) else value.num_replicas
    if count is not None and count != num_replicas:
        kind = type(value).__name__ if isinstance(value, PerReplica) else "Mirrored"
        raise errors.InvalidArgumentError(
            f"{what} got a {kind} value of {count} replicas on a strategy of "
            f"{num_replicas}: it was made by another strategy. Make it with this one (pass it "
            "through this strategy's run, or jdist.mirror(value.value, strategy) for state).")


def is_distributed(x: Any) -> bool:
    """Whether ``x`` is a `DistributedValues` (used as ``is_leaf`` when flattening nests)."""
    return isinstance(x, DistributedValues)


def ragged_components(value: PerReplica) -> tuple:
    """Every replica's entry of a ragged `PerReplica`, in replica order (another worker's
    replica is a ``jax.ShapeDtypeStruct``)."""
    return value._components


def spans_workers(value: PerReplica) -> bool:
    """Whether a ragged `PerReplica` has replicas held by other processes."""
    return any(isinstance(c, jax.ShapeDtypeStruct) for c in value._components)


def local_results(value: Any) -> tuple:
    """The components of ``value`` per local replica, a tuple (a plain value: a 1-tuple)."""
    if isinstance(value, DistributedValues):
        return value._local_results()
    return (value,)
