"""Which outputs of a replica function are rows of its padded input batch.

A partial batch reaches the step padded, with its true per-replica lengths (``docs/design.md``,
section 10). An output that is row-for-row aligned with the batch (per-example losses,
predictions) must carry those lengths back, so that ``reduce(..., axis=0)`` and ``gather`` skip
the padding; an output that merely has the same leading size (the gradient of a weight whose
input size equals the per-replica batch size) must not, or real rows would be dropped.

This module follows the batch's row axis through the traced body: the state of a value is the
index of its axis that runs over the batch rows (`int`), `NOT_ROWS` when it provably has none
(replicated inputs, constants, a contraction or reduction over the rows), `MOVED` when its rows
are the batch's in another order or shifted (reversed, sorted, indexed, sliced or padded along
the rows: the padding may then sit among the real rows, so no row count tells them apart), or
`UNKNOWN` for anything the analysis does not model (other gathers, a scan over the rows
themselves, unknown primitives). Control flow is followed into its sub-programs: ``cond``
branches are merged, loop carries iterated to a fixpoint, a ``scan``'s slices and stacked
outputs shifted by its scanned axis. `MOVED` is final: what is computed from such a value is
`MOVED` too. An output inherits the lengths at a row axis, and for `UNKNOWN` the caller falls
back to the leading-size rule.
"""

import math

from jdist._src import invariance

NOT_ROWS = -1
MOVED = -2
UNKNOWN = None

_ELEMENTWISE = frozenset({
    "abs", "acos", "acosh", "add", "and", "asin", "asinh", "atan", "atan2", "atanh", "cbrt",
    "ceil", "clamp", "convert_element_type", "copy", "copy_p", "cos", "cosh", "div", "eq", "erf",
    "erf_inv", "erfc", "exp", "exp2", "expm1", "floor", "ge", "gt", "imag", "integer_pow",
    "is_finite", "le", "lgamma", "digamma", "log", "log1p", "logistic", "lt", "max", "min", "mul",
    "ne", "neg", "nextafter", "not", "or", "pow", "real", "reduce_precision", "rem", "round",
    "rsqrt", "select_n", "shift_left", "shift_right_arithmetic", "shift_right_logical", "sign",
    "sin", "sinh", "sqrt", "square", "stop_gradient", "sub", "tan", "tanh", "xor", "psum",
    "psum_invariant", "pmax", "pmin", "pvary", "pcast",
})
_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
                         "reduce_or", "reduce_xor", "argmax", "argmin"})
_CUMULATIVE = frozenset({"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"})
_NOT_ROWS = frozenset({"iota", "axis_index", "all_gather", "rng_bit_generator", "random_bits"})
_STRUCTURAL = frozenset({"broadcast_in_dim", "reshape", "squeeze", "transpose", "slice", "pad",
                         "concatenate", "sort", "rev"})
# Pooling (max, sum: a mean pool divides the sum) and the gradients of max pooling.
_WINDOWED = frozenset({"reduce_window_sum", "reduce_window_max", "reduce_window_min",
                       "reduce_window", "select_and_scatter_add", "select_and_gather_add"})
# Ops that pick entries by index (x[order], x.at[i].set(v)): the rows move when they index
# along the row axis.
_SCATTERS = frozenset({"scatter", "scatter-add", "scatter-mul", "scatter-min", "scatter-max"})


def row_axes(jaxpr, input_states):
    """Returns, per output of ``jaxpr``, the axis that runs over the batch rows.

    Args:
      jaxpr: a ``jax.extend.core.Jaxpr``.
      input_states: per input, its row axis, `NOT_ROWS` or `UNKNOWN`.

    Returns:
      A list with one state per output.
    """
    return invariance.propagate(jaxpr, input_states, _eqn_rows, NOT_ROWS)


def _join(states):
    """Several operands combined element by element: their common row axis, if they agree."""
    axes = {s for s in states if s is not UNKNOWN and s != NOT_ROWS}
    if UNKNOWN in states or len(axes) > 1:
        return UNKNOWN
    return axes.pop() if axes else NOT_ROWS


def _merge(states):
    """One state for values that may be any of ``states`` (a loop carry before and after an
    iteration, the outputs of ``cond``'s branches). States only rise under it, from `NOT_ROWS`
    to an axis, `UNKNOWN` and `MOVED`, so a loop's carries settle in a few rounds."""
    return MOVED if MOVED in states else _join(states)


def _scan_rows(eqn, ins):
    params = eqn.params
    n_consts, n_carry = invariance.scan_counts(params)
    consts, carry, xs = ins[:n_consts], ins[n_consts:n_consts + n_carry], ins[n_consts + n_carry:]
    # Each iteration sees one slice along axis 0: a row axis further in moves one place in; a
    # scan along the rows themselves hands the body single rows (not modelled).
    sliced = [UNKNOWN if s == 0 else s - 1 if _is_axis(s) else s for s in xs]
    carry, outs = invariance.loop_fixpoint(row_axes, _merge, invariance.open_jaxpr(params["jaxpr"]),
                                           consts, carry, sliced)
    stacked = [s + 1 if _is_axis(s) else s for s in outs[n_carry:]]  # Stacked along axis 0.
    return carry + stacked


def _while_rows(eqn, ins):
    params = eqn.params
    body_consts = ins[params["cond_nconsts"]:params["cond_nconsts"] + params["body_nconsts"]]
    carry = ins[params["cond_nconsts"] + params["body_nconsts"]:]
    return invariance.loop_fixpoint(row_axes, _merge, invariance.open_jaxpr(params["body_jaxpr"]),
                                    body_consts, carry, [])[0]


def _cond_rows(eqn, ins):
    operands = ins[1:]  # After the branch index.
    outs = [row_axes(invariance.open_jaxpr(b), operands) for b in eqn.params["branches"]]
    return [_merge(list(states)) for states in zip(*outs)]


_CONTROL_FLOW = {"scan": _scan_rows, "while": _while_rows, "cond": _cond_rows}


def _is_axis(state):
    return state is not UNKNOWN and state >= 0


def _shape(var):
    return tuple(var.aval.shape)


def _eqn_rows(eqn, ins):
    name, params, n_out = eqn.primitive.name, eqn.params, len(eqn.outvars)
    if MOVED in ins:
        return [MOVED] * n_out
    if name in _ELEMENTWISE:
        return [_join(ins)] * n_out
    if name in _NOT_ROWS:
        return [NOT_ROWS] * n_out
    if all(s == NOT_ROWS for s in ins):
        return [NOT_ROWS] * n_out  # Nothing of the batch flows in (a weight's own ops).
    # Before `call_body`: these take sub-programs that are not called on their operands.
    if name in _CONTROL_FLOW:
        return _CONTROL_FLOW[name](eqn, ins)
    if name in _WINDOWED:
        return [_windowed(eqn, _join(ins))] * n_out
    if name == "reduce":  # `lax.reduce` with a computation of its own.
        k = _join(ins)
        return [_reduced(k, params["dimensions"]) if _is_axis(k) else k] * n_out
    inner = invariance.call_body(eqn)
    if inner is not None:
        return row_axes(inner, ins)
    k = ins[0] if ins else NOT_ROWS
    if name == "dot_general":
        return [_dot_general(eqn, ins)]
    if name == "conv_general_dilated":
        return [_conv(eqn, ins)]
    if name == "concatenate" and k != _join(ins):
        return [UNKNOWN]  # Operands whose rows disagree.
    if not _is_axis(k):
        # Reshaping a value without rows gives a value without rows; other ops are not modelled.
        modelled = name in _STRUCTURAL or name in _REDUCTIONS or name in _CUMULATIVE
        return [k if modelled else UNKNOWN] * n_out
    if name in _REDUCTIONS:
        return [_reduced(k, params["axes"])] * n_out
    reordered = _reordered_rows(eqn, k, ins)
    return [_row_axis_after(eqn, k) if reordered is None else reordered] * n_out


def _reduced(k, axes):
    """The row axis ``k`` once ``axes`` are reduced away."""
    return NOT_ROWS if k in axes else k - sum(a < k for a in axes)


def _reordered_rows(eqn, k, ins):
    """The state after an op that may reorder or shift the rows (along axis ``k``): `MOVED`
    when it does, ``k`` when it keeps them in place, None for the other ops."""
    name, params = eqn.primitive.name, eqn.params
    if name in _CUMULATIVE:  # A forward scan's first rows see the real rows only.
        return (MOVED if params.get("reverse") else k) if params["axis"] == k else k
    if name == "gather" or name in _SCATTERS:
        numbers = params["dimension_numbers"]
        indexed = (numbers.start_index_map if name == "gather"
                   else numbers.scatter_dims_to_operand_dims)
        return MOVED if k in indexed else UNKNOWN
    if name == "rev":
        return MOVED if k in params["dimensions"] else k
    if name in ("dynamic_slice", "dynamic_update_slice"):  # Whole along the rows: in place.
        part = params["slice_sizes"] if name == "dynamic_slice" else _shape(eqn.invars[1])
        whole = part[k] == _shape(eqn.invars[0])[k]
        return (k if name == "dynamic_slice" else _join(ins[:2])) if whole else MOVED
    if name == "slice":
        start, limit = params["start_indices"][k], params["limit_indices"][k]
        strides = params.get("strides")
        whole = start == 0 and limit == _shape(eqn.invars[0])[k] and (
            not strides or strides[k] == 1)
        return k if whole else MOVED
    if name == "pad":
        return k if tuple(params["padding_config"][k]) == (0, 0, 0) else MOVED
    if name in ("concatenate", "sort"):
        return MOVED if params["dimension"] == k else k
    return None


def _row_axis_after(eqn, k):
    """Where a shape op (broadcast, squeeze, transpose, reshape) puts the row axis ``k``;
    `UNKNOWN` for ops not modelled."""
    name, params = eqn.primitive.name, eqn.params
    if name == "broadcast_in_dim":
        out_axis = params["broadcast_dimensions"][k]
        same_size = _shape(eqn.invars[0])[k] == params["shape"][out_axis]
        return out_axis if same_size else UNKNOWN
    if name == "squeeze":
        dims = params["dimensions"]
        return UNKNOWN if k in dims else k - sum(d < k for d in dims)
    if name == "transpose":
        return tuple(params["permutation"]).index(k)
    if name == "reshape":
        return _reshaped_axis(_shape(eqn.invars[0]), tuple(params["new_sizes"]), k)
    return UNKNOWN


def _reshaped_axis(old, new, k):
    """Where axis ``k`` of shape ``old`` lands in ``new``, if it survives the reshape intact."""
    before = math.prod(old[:k])
    running = 1
    for j, size in enumerate(new):
        if running == before and size == old[k]:
            return j
        running *= size
        if running > before:
            break
    return UNKNOWN


def _windowed(eqn, k):
    """Pooling and its gradients over operands whose rows run along ``k``: in place when the
    window neither spans, strides, pads nor dilates along the rows, else each row mixes with
    its neighbours, padding included (`MOVED`)."""
    if not _is_axis(k):
        return k
    params = eqn.params
    in_place = (params["window_dimensions"][k] == 1 and params["window_strides"][k] == 1
                and tuple(params["padding"][k]) == (0, 0)
                and all(params[d][k] == 1 for d in ("base_dilation", "window_dilation")
                        if d in params))
    return k if in_place else MOVED


def _conv(eqn, ins):
    """Rows on the input's batch axis run along the output's batch axis; rows on an axis the
    convolution sums over (the input's or the kernel's input features: how a kernel's gradient
    is computed) are summed away; rows on a kernel's output features run along the output's
    features; rows on a window axis are not modelled."""
    numbers, params = eqn.params["dimension_numbers"], eqn.params
    grouped = params["feature_group_count"] > 1 or params["batch_group_count"] > 1

    def lhs_axis(k):
        if not _is_axis(k):
            return k
        if k == numbers.lhs_spec[1]:  # Input features: summed over.
            return NOT_ROWS
        if k == numbers.lhs_spec[0]:  # With batch groups, the batch is summed too.
            return NOT_ROWS if params["batch_group_count"] > 1 else numbers.out_spec[0]
        return UNKNOWN

    def rhs_axis(k):
        if not _is_axis(k):
            return k
        if k == numbers.rhs_spec[1]:  # Kernel input features: summed over.
            return NOT_ROWS
        return numbers.out_spec[1] if k == numbers.rhs_spec[0] and not grouped else UNKNOWN
    return _join([lhs_axis(ins[0]), rhs_axis(ins[1])])


def _dot_general(eqn, ins):
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs_rank, rhs_rank = len(_shape(eqn.invars[0])), len(_shape(eqn.invars[1]))
    lhs_free = [d for d in range(lhs_rank) if d not in lc and d not in lb]
    rhs_free = [d for d in range(rhs_rank) if d not in rc and d not in rb]

    def out_axis(k, contracting, batch, free, offset):
        if not _is_axis(k):
            return k
        if k in contracting:
            return NOT_ROWS  # Summed over the rows: e.g. the gradient of a weight.
        if k in batch:
            return list(batch).index(k)
        return offset + free.index(k)
    return _join([out_axis(ins[0], lc, lb, lhs_free, len(lb)),
                  out_axis(ins[1], rc, rb, rhs_free, len(lb) + len(lhs_free))])
