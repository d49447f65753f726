"""The arithmetic of combining replicas: every reduce and gather rule, written once.

One rule set, three settings:

* **host programs** over a `PerReplica` whose array is sharded over the replica axis
  (``strategy.reduce`` / ``strategy.gather``): each device reduces its own block, then
  ``lax.psum`` / ``lax.all_gather`` combine the devices (`jdist._src.reduce.replica_mesh`);
* **inside a replica function** (``ReplicaContext.all_reduce`` / ``all_gather``): the same
  collectives on the traced per-replica value (`replica_all_reduce`, `replica_all_gather`);
* **inside a merge function**, where arguments are gathered views with the replica axis first,
  so reduction is a sum over that axis with no further communication (`stacked_reduce`).

The rules (TF's, ``docs/semantics.md``): sums keep the values' dtype, integers wrap as in TF
(`local_sum`); MEAN divides the sum as TF's ``truediv`` does, integers in float32 or float64
(`mean_dtype`, `finish`); it divides by the number of values combined (`mean_count`,
`finish`): with ``axis=None`` the number of replicas, with an axis the total number of elements
along it over all replicas, padding rows excluded, so replica batches ``[5., 6.]`` and ``[7.]``
average to 6.0; an element-wise combine of padded batches needs equal lengths and drops the
padding (`strip_padding`); zero-size values never reach a collective (`reduce_empty`,
`empty_gather`).
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
from jdist._src.base import Axis
from jdist._src.base import Lengths
from jdist._src.base import PyTree
from jdist._src.reduce_op import ReduceOp


def normalize_axis(axis: Axis, ndim: int) -> Optional[Tuple[int, ...]]:
    """Returns ``axis`` (int, tuple or None) as a sorted tuple of non-negative axes, or None.

    Args:
      axis: None, an int or a sequence of ints (negative ones count from the end).
      ndim: the rank of one replica's value.

    Returns:
      The sorted, deduplicated non-negative axes, or None for ``axis=None``.

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
    """The one axis a gather concatenates along, normalized: TF takes an int only.

    Example:
      >>> gather_axis(-1, 2)
      1
    """
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise errors.InvalidArgumentError(
            f"gather and all_gather concatenate along one axis (an int), got {axis!r}.")
    axes = normalize_axis(int(axis), ndim)
    assert axes is not None  # An int gives one axis.
    return axes[0]


# ------------------------------------------------------------------------------ the rules
def mean_dtype(dtype) -> np.dtype:
    """The dtype of a MEAN, TF's ``truediv``: floats keep theirs, 8- and 16-bit integers give
    float32, 32- and 64-bit integers float64 with ``jax_enable_x64``; without it JAX's default
    float, float32, as ``jnp.mean`` gives.

    Example:
      >>> str(mean_dtype("int8")), str(mean_dtype("float16")), str(mean_dtype("int32"))
      ('float32', 'float16', 'float32')
    """
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.inexact):
        return dtype
    if dtype.itemsize <= 2 or not jax.config.read("jax_enable_x64"):
        return jnp.dtype(jnp.float32)
    return jnp.dtype(jnp.float64)


def finish(op: ReduceOp, total, count, divisors: Optional[dict] = None):
    """The result of a reduction: the sum itself, or for MEAN TF's ``truediv`` of the sum by
    ``count``: the count in the sum's dtype (TF casts it so), then both in `mean_dtype`.

    ``divisors``, a dict shared by the leaves of one nest, lets leaves of one shape and dtype
    share their divisor: fewer operations to trace for a model's gradients.

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
    """``1 / divisor`` in ``dtype`` when ``count`` is a concrete int whose divisor (TF's cast
    through ``total_dtype``) is a power of two with a normal reciprocal, else None.

    Dividing by such a divisor and multiplying by its reciprocal both give the correctly rounded
    value of the same real number, so the product is TF's quotient bit for bit. A division
    must stay a division (see `finish`), and XLA then computes it in a loop of its own where an
    optimiser's gradient uses it twice (one more pass over every gradient per step); a
    multiplication it fuses into each user, as a hand-written ``lax.pmean``'s.
    """
    if not isinstance(count, (int, np.integer)) or isinstance(count, bool):
        return None
    return _reciprocal_of(int(count), jnp.dtype(total_dtype), jnp.dtype(dtype))


@functools.lru_cache(maxsize=None)
def _reciprocal_of(count, total_dtype, dtype):
    """`_exact_reciprocal` of a concrete count, once per count and dtypes: a model's gradients
    ask for it once per leaf while the step is traced."""
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
    """How many values a MEAN over ``num_replicas`` replicas divides by (TF's rule).

    Args:
      shape: one replica's (padded) shape.
      axes: the normalized within-replica axes, or None for an element-wise combine.
      num_replicas: how many replicas are combined.
      total_rows: the real rows of all replicas together when the values are padded batches
        (an int or a traced int), else None.

    Returns:
      ``num_replicas`` for ``axes=None``; else the number of elements along ``axes`` over all
      replicas, with the real rows standing for axis 0 of a padded batch.

    Example:
      >>> mean_count((2, 3), (0,), 2), mean_count((2, 3), (0, 1), 2, total_rows=3)
      (4, 9)
    """
    if axes is None:
        return num_replicas
    with_rows = total_rows is not None and 0 in axes
    per_row = math.prod(shape[a] for a in axes if not (a == 0 and with_rows))
    return per_row * (total_rows if with_rows else num_replicas)


def local_sum(x, axes: Optional[Tuple[int, ...]], valid_rows=None):
    """One replica's share of a reduction: the sum over ``axes`` of its real rows.

    ``valid_rows`` (an int, a traced int or None) masks padding rows along axis 0. The sum keeps
    the dtype of the values, for SUM and MEAN alike (int8 stays int8 and wraps, as in TF); TF
    sums bfloat16 values in float32 and rounds once, and so does this (a bfloat16 ``jnp.sum``
    rounds as it goes: 50-80% of random sums of 50 rows came out otherwise).
    """
    if axes is None:
        return x
    if valid_rows is not None and 0 in axes:
        mask = (jnp.arange(x.shape[0]) < valid_rows).reshape((-1,) + (1,) * (x.ndim - 1))
        x = jnp.where(mask, x, jnp.zeros((), x.dtype))
    accumulated = jnp.float32 if x.dtype == jnp.bfloat16 else x.dtype
    return jnp.sum(x, axis=axes, dtype=accumulated).astype(x.dtype)


def equal_lengths_or_raise(lengths: Tuple[int, ...], padded: int, what: str) -> Optional[int]:
    """Returns the common row count when ``lengths`` are all equal (None when it is ``padded``,
    so nothing needs cutting); raises `ShapeMismatchError` otherwise."""
    if len(set(lengths)) != 1:
        raise errors.ShapeMismatchError(
            f"{what}: the replicas' values have different sizes along axis 0 ({list(lengths)} "
            "rows), so they cannot be combined element-wise. Reduce or gather along axis 0 "
            "(axis=0) to combine batches of different sizes.")
    return lengths[0] if lengths[0] != padded else None


def strip_padding(stacked, lengths: Lengths, axes: Optional[Tuple[int, ...]], what: str,
                  slice_rows: Optional[Callable] = None):
    """Prepares a padded batch for a combine that does not run along axis 0.

    Element-wise (``axes`` None or without 0) the replicas' row counts must agree; their padding
    rows are cut. Along axis 0 the padding is masked by the combine itself, so nothing changes.

    Args:
      stacked: the ``(replicas, rows, ...)`` array.
      lengths: the real rows of each replica, or None (not padded).
      axes: the normalized axes the combine runs along (None: element-wise).
      what: the operation, for the error message.
      slice_rows: ``(stacked, rows) -> stacked[:, :rows]`` as the caller computes it (a compiled
        program on a mesh); by default plain indexing.

    Returns:
      ``(stacked, lengths)``: ``lengths`` stays only when the combine masks the padding.
    """
    if lengths is None or (axes is not None and 0 in axes):
        return stacked, lengths
    common = equal_lengths_or_raise(lengths, stacked.shape[1], what)
    if common is not None:
        stacked = stacked[:, :common] if slice_rows is None else slice_rows(stacked, common)
    return stacked, None


def reduce_empty(reduce_stacked: Callable, stacked_shape: Sequence[int], dtype):
    """The reduction of zero-size values, computed here: XLA rejects zero-size collectives.

    Args:
      reduce_stacked: the reduction of a ``stacked_shape`` array of replica values.
      stacked_shape: the replicas' values stacked, replica axis first (of size zero).
      dtype: their dtype.
    """
    return reduce_stacked(jnp.zeros(stacked_shape, dtype))


def empty_gather(shape: Sequence[int], dtype, axis: int, rows: int):
    """The gather of zero-size values: zeros with ``rows`` elements along ``axis``."""
    shape = list(shape)
    shape[axis] = rows
    return jnp.zeros(shape, dtype)


# ------------------------------------------------------------------- where they are applied
# XLA computes bfloat16 arithmetic in float32 and may keep a chain of adds there, rounding once
# at the end (its ``xla_allow_excess_precision``); TF's ``add_n`` rounds every partial sum to
# bfloat16. An explicit ``reduce_precision`` is a rounding XLA keeps: (exponent, mantissa) bits.
# (float16 is TF's already, and ``reduce_precision`` would flush its subnormals to zero.)
_ROUNDED_EVERY_ADD = {jnp.dtype(jnp.bfloat16): (8, 7)}


def add_in_order(values: Sequence):
    """The values added one at a time, in replica order, as TF's ``add_n`` adds them.

    XLA keeps float adds in the order written, but may fuse a reduction over a stacked axis (or a
    sum of sums) into an order of its own, so every cross-replica sum goes through here. Each
    bfloat16 partial sum is rounded to bfloat16, as in TF.

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
    """The sum of ``x`` over the replicas of ``axis_name``, inside a replica program.

    ``lax.psum``, which adds in replica order on CPUs (in NCCL's ring order on GPUs: docs/
    design.md, section 9). A bfloat16 ``psum`` on CPUs keeps its partial sums in float32, so
    there the replicas' values are gathered and added as `add_in_order` adds them.
    """
    if not _sums_in_order(x.dtype):
        return lax.psum(x, axis_name)
    return add_in_order(list(lax.all_gather(x, axis_name)))


def _sums_in_order(dtype) -> bool:
    """Whether `replica_sum` adds ``dtype`` values itself, in order (bfloat16 on CPUs)."""
    return jnp.dtype(dtype) in _ROUNDED_EVERY_ADD and not _off_cpu()


def _off_cpu():
    """Whether the program being traced runs on another platform than CPUs (False where the
    trace does not say: a ``vmap`` over the replicas)."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    return device is not None and device.platform != "cpu"


def stacked_reduce(op: ReduceOp, stacked, axes: Optional[Tuple[int, ...]], valid_rows=None):
    """Reduces a value whose leading axis holds the replicas (no communication needed).

    Args:
      op: the `ReduceOp`.
      stacked: the ``(replicas, ...)`` array (concrete, or a traced merge_call view).
      axes: the normalized within-replica axes, or None (element-wise).
      valid_rows: each replica's real rows (an int array) when the values are padded batches.

    Returns:
      The reduced array.
    """
    total = add_in_order([  # Each replica's own sum first, as TF's replicas compute them.
        local_sum(stacked[i], axes, None if valid_rows is None else valid_rows[i])
        for i in range(stacked.shape[0])])
    rows = None if valid_rows is None else jnp.sum(valid_rows)
    return finish(op, total, mean_count(stacked.shape[1:], axes, stacked.shape[0], rows))


def replicated_reduce(op: ReduceOp, value, axes: Optional[Tuple[int, ...]],
                      num_replicas: int = 1, mean_is_value: bool = True):
    """Reduces a value that every one of ``num_replicas`` replicas holds identically.

    The copies are combined as TF combines them: the within-replica sums (in the values' dtype)
    added one copy at a time, in replica order as ``add_n`` adds (``7x + x`` is not ``8x`` in
    floats), MEAN divided by the count over every copy. With ``mean_is_value`` (TF's
    ``Mirrored``; not a step's output, `values.is_step_output`) an element-wise MEAN is the
    value itself, dtype included, as TF returns a mirrored value.
    """
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

    def reduce_leaf(x):
        x = jnp.asarray(x)
        # Never a zero-size collective: the reduction of nothing is empty too.
        return finish(op, x if x.size == 0 else replica_sum(x, axis_name), n, divisors)
    return jax.tree_util.tree_map(reduce_leaf, value)


def all_reduce_with_tfs_gradient(reduce: Callable, op: ReduceOp, num_replicas: int,
                                 value: PyTree, sums_by_psum: bool = True) -> PyTree:
    """``reduce(op, leaves)`` over ``value``'s leaves, whose gradient is TF's: the all-reduce,
    with the same op, of the upstream gradients (TF's ``all_reduce`` custom gradient).

    XLA's own transposes differ from it twice. A MEAN's (a sum, then a division) divides each
    replica's gradient before summing, which rounds differently unless the replica count is a
    power of two: its tangent here divides, then sums, so its transpose sums, then divides. A
    bfloat16 sum on CPUs (`replica_sum` gathers and adds in order) transposes to a float32
    reduce-scatter: those leaves get a custom VJP, the same all-reduce, so forward derivatives
    of them raise JAX's error (docs/design.md, section 2). So do all leaves of an all-reduce
    that is not a ``psum`` (a custom ``accumulation_fn``).

    Args:
      reduce: ``(op, list of arrays) -> list of arrays``, the all-reduce.
      op: the `ReduceOp`.
      num_replicas: the replica count.
      value: a nest of traced arrays.
      sums_by_psum: whether ``reduce`` sums with ``psum`` (`replica_sum`).

    Returns:
      The nest of all-reduced arrays.

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
    for rule, combine in ((_BY_VJP, _reduce_by_vjp), (_BY_JVP, _mean_by_jvp),
                          (None, lambda reduce, op, n, xs: reduce(op, xs))):
        chosen = [i for i, r in enumerate(rules) if r == rule]
        if chosen:
            reduced = combine(reduce, op, num_replicas, [leaves[i] for i in chosen])
            for i, x in zip(chosen, reduced):
                results[i] = x
    return jax.tree_util.tree_unflatten(tree, results)


_BY_VJP, _BY_JVP = "vjp", "jvp"


def _gradient_rule(x, op, sums_by_psum):
    dtype = jnp.result_type(x)
    if not jnp.issubdtype(dtype, jnp.inexact):
        return None
    if _sums_in_order(dtype) or not sums_by_psum:
        return _BY_VJP
    return _BY_JVP if op is ReduceOp.MEAN else None  # XLA transposes a psum to a psum.


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
    """``lax.all_gather(x, axis_name, axis=axis, tiled=True)`` whose gradient is TF's: the
    all-reduce SUM (`replica_sum`) of the upstream gradients, of which each replica takes its
    own rows. XLA's transpose, a reduce-scatter, adds in another order. The tangent is the
    replica's rows in zeros, summed over the replicas, whose transpose is the sum, then the
    slice; bfloat16 on CPUs, whose sum is gathered, gets a custom VJP (as in
    `all_reduce_with_tfs_gradient`).
    """
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


def _gather_forward(x, axis_name, axis):
    return _gather_by_vjp(x, axis_name, axis), None


def _gather_backward(axis_name, axis, _, cotangent):
    rows = cotangent.shape[axis] // lax.axis_size(axis_name)
    summed = replica_sum(cotangent, axis_name)
    return (lax.dynamic_slice_in_dim(summed, lax.axis_index(axis_name) * rows, rows, axis),)


_gather_by_vjp.defvjp(_gather_forward, _gather_backward)


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


# ------------------------------------------------------------------ ragged values (TF's rules)
def ragged_partials(components: Sequence, axis: Axis):
    """Each replica's share of reducing a ragged value along ``axis`` (TF's rule).

    Element-wise (``axis=None``) needs one shape, so it raises; with an axis each replica sums
    its own value along it (on its own device), and MEAN will divide the combined sum by the
    element count over all replicas (an empty replica adds nothing). Works on concrete arrays
    and on traced ones (inside a merge function).

    Returns:
      ``(partials, count)``: one partial sum per replica (all of one shape), and the count.

    Raises:
      ShapeMismatchError: ``axis`` is None, or the replicas' values differ in rank.
    """
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
    """Concatenates one value per replica along ``axis``, sizes along it may differ (TF's rule).

    Raises:
      InvalidArgumentError: the values are scalars.
      ShapeMismatchError: they differ in rank or in a dimension other than ``axis``.
    """
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
