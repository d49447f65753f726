"""The arithmetic of combining replicas: every reduce and gather rule (docs/semantics.md), once.

The same rules serve three settings: host programs over a sharded `PerReplica`
(`jdist._src.reduce.replica_mesh`), collectives inside a replica function (`replica_all_reduce`,
`replica_all_gather`) and a merge function's stacked views (`stacked_reduce`), so that every
path gives TF's dtypes, divisors and order of additions.
"""

import functools
import math
import operator
from typing import Callable, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jdist._src import errors
from jdist._src.base import Axis, Lengths, PyTree
from jdist._src.reduce_op import ReduceOp


def normalize_axis(axis: Axis, ndim: int) -> Optional[Tuple[int, ...]]:
    """``axis`` (None, an int or ints, negative from the end) as sorted non-negative axes.

    Example:
      >>> normalize_axis((-1, 0), 3)
      (0, 2)
    """
    if axis is None:
        return None
    axes = axis if isinstance(axis, (tuple, list)) else (axis,)
    out = []
    for a in axes:
        if isinstance(a, bool) or not isinstance(a, (int, np.integer)):
            raise errors.InvalidArgumentError(f"axis must be an int or a tuple of ints, got {a!r}.")
        if not -ndim <= a < ndim:
            raise errors.InvalidArgumentError(
                f"axis {a} is out of range for a per-replica value of rank {ndim}; use an axis in "
                f"[{-ndim}, {ndim}).")
        out.append(int(a) % ndim)
    return tuple(sorted(set(out)))


def gather_axis(axis, ndim: int) -> int:
    """The one axis a gather concatenates along, normalized: TF takes an int only."""
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise errors.InvalidArgumentError(
            f"gather and all_gather concatenate along one axis (an int), got {axis!r}.")
    axes = normalize_axis(int(axis), ndim)
    assert axes is not None  # An int gives one axis.
    return axes[0]


def mean_dtype(dtype) -> np.dtype:
    """The dtype of a MEAN, TF's ``truediv``: floats keep theirs, 8- and 16-bit integers give
    float32, wider ones float64 with ``jax_enable_x64`` (else float32, as ``jnp.mean``)."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.inexact):
        return dtype
    if dtype.itemsize <= 2 or not jax.config.read("jax_enable_x64"):
        return jnp.dtype(jnp.float32)
    return jnp.dtype(jnp.float64)


def finish(op: ReduceOp, total, count, divisors: Optional[dict] = None):
    """The sum itself, or for MEAN TF's ``truediv`` of it by ``count`` (cast to the sum's dtype,
    then both to `mean_dtype`). ``divisors`` lets one nest's leaves share a divisor per shape.

    Example:
      >>> import numpy as np
      >>> mean = finish(ReduceOp.MEAN, np.int8(9), 2)  # TF's int8 / int8.
      >>> float(mean), str(mean.dtype)
      (4.5, 'float32')
    """
    if op is ReduceOp.SUM:
        return total
    total = jnp.asarray(total)
    dtype = mean_dtype(total.dtype)
    reciprocal = _exact_reciprocal(count, total.dtype, dtype)
    if reciprocal is not None:  # Bit for bit the division, and XLA fuses it into its users.
        return total.astype(dtype) * reciprocal
    key = (total.shape, total.dtype)
    divisor = None if divisors is None else divisors.get(key)
    if divisor is None:
        count = jnp.asarray(count).astype(total.dtype).astype(dtype)
        # XLA turns a division by a broadcast scalar into a multiplication by its reciprocal,
        # an ulp off TF's division (146 / 9 in float32); a full-shape divisor behind a barrier
        # stays a division, fused into the same loop.
        divisor = lax.optimization_barrier(jnp.broadcast_to(count, total.shape))
        if divisors is not None:
            divisors[key] = divisor
    return total.astype(dtype) / divisor


def _exact_reciprocal(count, total_dtype, dtype):
    """``1 / divisor`` when ``count`` is a concrete int whose divisor is a power of two with a
    normal reciprocal (then the product is TF's quotient bit for bit, and XLA fuses it into
    its users where a division needs a loop of its own), else None."""
    if not isinstance(count, (int, np.integer)) or isinstance(count, bool):
        return None
    return _reciprocal_of(int(count), jnp.dtype(total_dtype), jnp.dtype(dtype))


@functools.lru_cache(maxsize=None)
def _reciprocal_of(count, total_dtype, dtype):
    """Cached: a model's gradients ask once per leaf while tracing."""
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return None  # A complex product by (1/n + 0j) turns an infinite part's partner NaN.
    divisor = float(np.asarray(count).astype(total_dtype).astype(dtype))
    if divisor < 2 or math.frexp(divisor)[0] != 0.5:  # XLA drops a product by 1 unflushed.
        return None
    if 1.0 / divisor < float(jnp.finfo(dtype).tiny):  # Exact in ``dtype`` once it is normal.
        return None
    reciprocal = np.asarray(1.0 / divisor, dtype)
    reciprocal.setflags(write=False)  # Shared by every caller.
    return reciprocal


def mean_count(shape: Sequence[int], axes: Optional[Tuple[int, ...]], num_replicas: int,
               total_rows=None):
    """How many values a MEAN divides by: ``num_replicas`` for ``axes=None``, else the elements
    along ``axes`` over all replicas (``total_rows``, the real rows, for axis 0 when padded)."""
    if axes is None:
        return num_replicas
    with_rows = total_rows is not None and 0 in axes
    per_row = math.prod(shape[a] for a in axes if not (a == 0 and with_rows))
    return per_row * (total_rows if with_rows else num_replicas)


def local_sum(x, axes: Optional[Tuple[int, ...]], valid_rows=None):
    """One replica's sum over ``axes`` of its ``valid_rows`` real rows, in the values' dtype
    (int8 wraps, as in TF); bfloat16 is summed in float32 and rounded once, as TF does."""
    if axes is None:
        return x
    if valid_rows is not None and 0 in axes:
        mask = (jnp.arange(x.shape[0]) < valid_rows).reshape((-1,) + (1,) * (x.ndim - 1))
        x = jnp.where(mask, x, jnp.zeros((), x.dtype))
    accumulated = jnp.float32 if x.dtype == jnp.bfloat16 else x.dtype
    return jnp.sum(x, axis=axes, dtype=accumulated).astype(x.dtype)


def strip_padding(stacked, lengths: Lengths, axes: Optional[Tuple[int, ...]], what: str,
                  slice_rows: Optional[Callable] = None):
    """``(stacked, lengths)`` ready for a combine: along axis 0 the combine masks the padding
    (unchanged); element-wise the row counts must agree and the padding rows are cut (by
    ``slice_rows(stacked, rows)`` when given, e.g. a compiled program on a mesh)."""
    if lengths is None or (axes is not None and 0 in axes):
        return stacked, lengths
    if len(set(lengths)) != 1:
        raise errors.ShapeMismatchError(
            f"{what}: the replicas' values have different sizes along axis 0 ({list(lengths)} "
            "rows), so they cannot be combined element-wise. Reduce or gather along axis 0 "
            "(axis=0) to combine batches of different sizes.")
    rows = lengths[0]
    if rows != stacked.shape[1]:
        stacked = stacked[:, :rows] if slice_rows is None else slice_rows(stacked, rows)
    return stacked, None


def reduce_empty(reduce_stacked: Callable, stacked_shape: Sequence[int], dtype):
    """``reduce_stacked`` of zero-size values, computed here: XLA rejects zero-size collectives."""
    return reduce_stacked(jnp.zeros(stacked_shape, dtype))


def empty_gather(shape: Sequence[int], dtype, axis: int, rows: int):
    """The gather of zero-size values: zeros with ``rows`` elements along ``axis``."""
    return jnp.zeros(tuple(shape[:axis]) + (rows,) + tuple(shape[axis + 1:]), dtype)


# XLA computes bfloat16 arithmetic in float32 and may keep a chain of adds there, rounding once
# at the end (its ``xla_allow_excess_precision``); TF's ``add_n`` rounds every partial sum to
# bfloat16. An explicit ``reduce_precision`` is a rounding XLA keeps: (exponent, mantissa) bits.
# (float16 is TF's already, and ``reduce_precision`` would flush its subnormals to zero.)
_ROUNDED_EVERY_ADD = {jnp.dtype(jnp.bfloat16): (8, 7)}


def add_in_order(values: Sequence):
    """The values added one at a time, in replica order, as TF's ``add_n`` (bfloat16 partial
    sums rounded): XLA may reorder a reduction over a stacked axis, not written adds.

    Example:
      >>> import jax.numpy as jnp
      >>> x = jnp.array([256.0, 1.0, 1.0], jnp.bfloat16)  # 257 is not a bfloat16.
      >>> float(add_in_order(list(x))), float(jnp.sum(x.astype(jnp.float32)))
      (256.0, 258.0)
    """
    bits = _ROUNDED_EVERY_ADD.get(jnp.result_type(values[0]))
    if bits is None:
        return functools.reduce(operator.add, values)

    def rounded(x):
        return lax.reduce_precision(x, *bits)
    return functools.reduce(lambda total, x: rounded(total + x), map(rounded, values))


def replica_sum(x, axis_name: str):
    """``lax.psum`` over ``axis_name``; bfloat16 on CPUs (whose psum keeps float32 partial sums)
    is gathered and added by `add_in_order`."""
    if not _sums_in_order(x.dtype):
        return lax.psum(x, axis_name)
    return add_in_order(list(lax.all_gather(x, axis_name)))


def _sums_in_order(dtype) -> bool:
    """Whether `replica_sum` adds ``dtype`` values itself, in order (bfloat16 on CPUs)."""
    return jnp.dtype(dtype) in _ROUNDED_EVERY_ADD and not _off_cpu()


def _off_cpu():
    """Whether the traced program runs off CPUs (False where the trace does not say: a vmap)."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    return device is not None and device.platform != "cpu"


def stacked_reduce(op: ReduceOp, stacked, axes: Optional[Tuple[int, ...]], valid_rows=None):
    """Reduces a ``(replicas, ...)`` array (no communication); ``valid_rows``: real rows."""
    total = add_in_order([  # Each replica's own sum first, as TF's replicas compute them.
        local_sum(stacked[i], axes, None if valid_rows is None else valid_rows[i])
        for i in range(stacked.shape[0])])
    rows = None if valid_rows is None else jnp.sum(valid_rows)
    return finish(op, total, mean_count(stacked.shape[1:], axes, stacked.shape[0], rows))


def replicated_reduce(op: ReduceOp, value, axes: Optional[Tuple[int, ...]],
                      num_replicas: int = 1, mean_is_value: bool = True):
    """Reduces a value every one of ``num_replicas`` replicas holds, as TF adds the copies (one
    at a time: ``7x + x`` is not ``8x``); with ``mean_is_value`` (TF's ``Mirrored``) an
    element-wise MEAN is the value itself."""
    value = jnp.asarray(value)
    if op is ReduceOp.MEAN and axes is None and mean_is_value:
        return value
    partial = local_sum(value, axes)
    total = add_in_order([partial] * num_replicas)
    return finish(op, total, mean_count(value.shape, axes, num_replicas))


def stacked_gather(stacked, axis: int):
    """Concatenates the replicas of a stacked value along per-replica ``axis``."""
    return jnp.concatenate([stacked[i] for i in range(stacked.shape[0])], axis=axis)


def replica_all_reduce(axis_name: str, op: ReduceOp, value: PyTree) -> PyTree:
    """All-reduces every leaf of ``value`` over ``axis_name`` inside a replica function."""
    n = lax.axis_size(axis_name)
    divisors: dict = {}

    def reduce_leaf(x):  # Never a zero-size collective: the reduction of nothing is empty.
        x = jnp.asarray(x)
        return finish(op, x if x.size == 0 else replica_sum(x, axis_name), n, divisors)
    return jax.tree_util.tree_map(reduce_leaf, value)


def all_reduce_with_tfs_gradient(reduce: Callable, op: ReduceOp, num_replicas: int,
                                 value: PyTree, sums_by_psum: bool = True) -> PyTree:
    """``reduce(op, leaves)`` over ``value``'s leaves, whose gradient is TF's: the same
    all-reduce of the upstream gradients.

    XLA's transposes differ twice: a MEAN's divides before summing (its tangent here divides,
    then sums, so the transpose sums, then divides), and a gathered bfloat16 sum or a
    non-``psum`` all-reduce (``sums_by_psum`` False) transposes otherwise: those leaves get a
    custom VJP (docs/design.md, section 2).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> def reduce(op, leaves):  # Three replicas holding the same values.
      ...   return [x * 3 if op is ReduceOp.SUM else x for x in leaves]
      >>> mean = lambda v: all_reduce_with_tfs_gradient(reduce, ReduceOp.MEAN, 3, v)
      >>> float(jax.grad(mean)(jnp.float32(2.0)))  # (1 * 3) / 3: the sum, then the division.
      1.0
    """
    leaves, tree = jax.tree_util.tree_flatten(value)
    rules = [_gradient_rule(x, op, sums_by_psum) for x in leaves]
    results = [None] * len(leaves)
    for combine in (_reduce_by_vjp, _mean_by_jvp, _reduce_as_is):
        chosen = [i for i, r in enumerate(rules) if r is combine]
        if chosen:
            reduced = combine(reduce, op, num_replicas, [leaves[i] for i in chosen])
            for i, x in zip(chosen, reduced):
                results[i] = x
    return jax.tree_util.tree_unflatten(tree, results)


def _gradient_rule(x, op, sums_by_psum):
    """Which of the caller's three combiners reduces leaf ``x``."""
    dtype = jnp.result_type(x)
    if not jnp.issubdtype(dtype, jnp.inexact):
        return _reduce_as_is
    if _sums_in_order(dtype) or not sums_by_psum:
        return _reduce_by_vjp
    # XLA transposes a psum to a psum.
    return _mean_by_jvp if op is ReduceOp.MEAN else _reduce_as_is


def _reduce_as_is(reduce, op, num_replicas, xs):
    return reduce(op, xs)


def _reduce_by_vjp(reduce, op, num_replicas, xs):
    @jax.custom_vjp
    def combine(*xs):
        return tuple(reduce(op, list(xs)))
    combine.defvjp(lambda *xs: (combine(*xs), None),
                   lambda _, cotangents: tuple(reduce(op, list(cotangents))))
    return combine(*xs)


def _mean_by_jvp(reduce, op, num_replicas, xs):
    @jax.custom_jvp
    def mean(*xs):
        return tuple(reduce(op, list(xs)))

    @mean.defjvp
    def tangent(primals, tangents):
        divided = [finish(ReduceOp.MEAN, t, num_replicas) for t in tangents]
        return mean(*primals), tuple(reduce(ReduceOp.SUM, divided))
    return mean(*xs)


def all_gather_with_tfs_gradient(x, axis_name: str, axis: int):
    """A tiled ``lax.all_gather`` whose gradient is TF's: each replica's rows of the
    `replica_sum` of the upstream gradients (XLA's reduce-scatter adds in another order)."""
    gather = _gather_by_vjp if _sums_in_order(x.dtype) else _gather_by_jvp
    return gather(x, axis_name, axis)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _gather_by_jvp(x, axis_name, axis):
    return lax.all_gather(x, axis_name, axis=axis, tiled=True)


@_gather_by_jvp.defjvp
def _gather_tangent(axis_name, axis, primals, tangents):
    (x,), (t,) = primals, tangents
    rows = t.shape[axis]
    zeros = jnp.zeros(t.shape[:axis] + (rows * lax.axis_size(axis_name),) + t.shape[axis + 1:],
                      t.dtype)
    own = lax.dynamic_update_slice_in_dim(zeros, t, lax.axis_index(axis_name) * rows, axis)
    return _gather_by_jvp(x, axis_name, axis), lax.psum(own, axis_name)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather_by_vjp(x, axis_name, axis):
    return lax.all_gather(x, axis_name, axis=axis, tiled=True)


def _gather_backward(axis_name, axis, _, cotangent):
    rows = cotangent.shape[axis] // lax.axis_size(axis_name)
    summed = replica_sum(cotangent, axis_name)
    return (lax.dynamic_slice_in_dim(summed, lax.axis_index(axis_name) * rows, rows, axis),)


_gather_by_vjp.defvjp(lambda x, name, axis: (_gather_by_vjp(x, name, axis), None),
                      _gather_backward)


def replica_all_gather(axis_name: str, value: PyTree, axis: int) -> PyTree:
    """Concatenates every leaf of ``value`` over the replicas, inside a replica function."""
    def gather_leaf(x):
        x = jnp.asarray(x)
        if x.ndim == 0 and lax.axis_size(axis_name) == 1:
            return x  # TF's one replica hands the value back as it is, a scalar too.
        if x.ndim == 0:
            raise errors.InvalidArgumentError(
                "all_gather needs values of rank >= 1; wrap scalars with x[None] first.")
        a = gather_axis(axis, x.ndim)
        if x.size == 0:
            return empty_gather(x.shape, x.dtype, a, x.shape[a] * lax.axis_size(axis_name))
        return (all_gather_with_tfs_gradient(x, axis_name, a)
                if jnp.issubdtype(x.dtype, jnp.inexact)
                else lax.all_gather(x, axis_name, axis=a, tiled=True))
    return jax.tree_util.tree_map(gather_leaf, value)


def ragged_partials(components: Sequence, axis: Axis):
    """``(partials, count)`` for a ragged value along ``axis``: each replica's sum, and the
    element count MEAN divides by (`ShapeMismatchError` for ``axis=None`` or mixed ranks)."""
    ndim = _common_rank(components, "reduce")
    if axis is None:
        raise errors.ShapeMismatchError(
            "strategy.reduce(axis=None) combines the replicas element-wise, but their values have "
            f"different shapes ({_shapes(components)}); reduce along the batch axis "
            "(axis=0) to combine batches of different sizes.")
    axes = normalize_axis(axis, ndim)
    partials = [local_sum(jnp.asarray(c), axes) for c in components]
    return partials, sum(mean_count(s, axes, 1) for s in _shapes(components))


def ragged_gather(components: Sequence, axis: int):
    """Concatenates one value per replica along ``axis``, whose sizes may differ (only)."""
    ndim = _common_rank(components, "gather")
    if ndim == 0:
        raise errors.InvalidArgumentError(
            "gather needs per-replica values of rank >= 1 (got scalars); give each replica's "
            "value a leading axis first, e.g. x[None] in the replica function.")
    a = gather_axis(axis, ndim)
    if len({s[:a] + s[a + 1:] for s in _shapes(components)}) > 1:
        raise errors.ShapeMismatchError(
            f"gather along axis {a} needs the replicas' values to agree in every other dimension, "
            f"got shapes {_shapes(components)}.")
    return jnp.concatenate(on_one_device(components), axis=a)


def on_one_device(arrays: Sequence) -> list:
    """``arrays`` moved to the device of the first (traced values are returned as they are)."""
    if any(isinstance(x, jax.core.Tracer) for x in arrays):
        return list(arrays)
    first = arrays[0]
    device = next(iter(first.devices())) if isinstance(first, jax.Array) else jax.devices()[0]
    return jax.device_put(list(arrays), device)


def _shapes(components):
    return [tuple(np.shape(c)) for c in components]


def _common_rank(components, what):
    ranks = {len(s) for s in _shapes(components)}
    if len(ranks) > 1:
        raise errors.ShapeMismatchError(
            f"{what} needs the replicas' values to have one rank, got shapes "
            f"{_shapes(components)}.")
    return ranks.pop()
