"""Bounds on the integers a traced step computes from its integer arguments (`int64_sums`).

A forward dataflow analysis (`invariance.propagate`) gives every integer value of the step a
`Bound`: two linear forms in the arguments' recorded magnitudes, one bounding each of its
numbers (``elem``) and one the sum of their magnitudes on any one replica (``replica``). An
argument ``k`` starts as ``(k's largest magnitude, k's largest sum on a replica)``
(`argument`). Operations combine forms: ``reshape``, slices and maxima keep them; ``add`` adds
them; a ``reduce_sum`` makes the replica's sum each number's bound, a SUM across replicas ``n``
times each number's; a product by constants scales them; other products and operations the
analysis does not know are unbounded. Indices carry no magnitude into a value (``gather``,
``scatter``, ``dynamic_slice``, ``select_n``'s predicate) and neither do bools and floats, so
an accuracy count, a confusion matrix or a float loss computed from int64 labels is not bounded
by them.

Where an operation can leave int32's range (``add``, ``mul``, sums, loops' carries...) the
analysis records a *check* ``(kind, form)``: `WRAP` (each number of its result), `ACROSS` (a
SUM across replicas) or `NEGATIVE_AXIS` (an all_gather TF would refuse). Loops are followed:
a ``scan`` or ``while`` carry is iterated up to `ITERATIONS` times, then what still grows is
unbounded; a ``cond`` takes the larger bound of its branches.
"""

import math
from typing import NamedTuple, Sequence

import jax
from jax.extend import core
import numpy as np

from jdist._src import invariance

MAX, SUM = "max", "sum"  # A leaf's key: (MAX, k) its largest number, (SUM, k) one replica's.
TOTAL = "total"  # (TOTAL, k): the sum of leaf k's magnitudes on every replica.
# `analyse`'s replica count for a program outside the replicas' (a `jdist.function`'s own):
# there a value's ``replica`` form bounds the sum over the whole value, and the replicas'
# programs it calls (`run`'s, `strategy.reduce`'s) are checked by their own analyses.
OUTSIDE = None
CONST = "const"  # A form's part that constants contribute (its magnitude is 1).
OTHER = "other"  # A form's part that nothing recorded bounds: infinite where it appears.
WRAP, ACROSS, NEGATIVE_AXIS = "wrap", "across", "negative axis"  # What a check guards.
# The name scope of an in-step all_gather along a negative axis where TF would gather int64
# numbers with its collective ops, which raise on one (`StrategyExtended.negative_axis_scope`).
NEGATIVE_AXIS_SCOPE = "jdist_negative_axis_gather"
GROUP = "jdist_collectives"  # An exact step's like collectives as one (`uneven_schedule`).
ITERATIONS = 16  # A loop's carry bounds are iterated this often before what grows is unbounded.


class Bound(NamedTuple):
    """An integer value's bounds: forms ``{key: coefficient}`` (see the module doc)."""
    elem: dict
    replica: dict


def argument(key: int) -> Bound:
    """The bound of the integer argument leaf ``key``: its own recorded magnitudes."""
    return Bound({(MAX, key): 1}, {(SUM, key): 1})


def whole(key: int) -> Bound:
    """The bound of integer argument leaf ``key`` of a program `OUTSIDE` the replicas': its
    largest magnitude, and the sum of all of them."""
    return Bound({(MAX, key): 1}, {(TOTAL, key): 1})


def constant(value) -> Bound:
    """The bound of an integer constant the step closes over: its own largest magnitude."""
    value = np.asarray(value)
    return _constants(np.max(np.abs(value), initial=0), value.size)


def analyse(jaxpr: core.Jaxpr, inputs: Sequence, num_replicas: int):
    """Bounds the integers ``jaxpr`` (one replica's program) computes from ``inputs``.

    Args:
      jaxpr: the step's body.
      inputs: per input, a `Bound` (`argument`) or None (not an integer argument).
      num_replicas: how many replicas a collective spans, or `OUTSIDE`.

    Returns:
      ``(checks, outputs)``: the distinct checks ``(kind, form)`` and, per output, its `Bound`
      or None.

    Example:
      >>> import jax.numpy as jnp
      >>> step = jax.make_jaxpr(lambda y: jnp.sum(y) * 2)(jnp.ones(3, jnp.int32)).jaxpr
      >>> checks, (out,) = analyse(step, [argument(0)], num_replicas=2)
      >>> out.elem  # Twice one replica's sum of the argument's magnitudes.
      {('sum', 0): 2.0}
      >>> [kind for kind, _ in checks]  # The sum and the product may leave int32's range.
      ['wrap', 'wrap']
    """
    if not any(inputs):
        return (), [None] * len(jaxpr.outvars)
    checks = []
    outputs = invariance.propagate(jaxpr, list(inputs), _rule(checks, num_replicas), None)
    return tuple(_distinct(checks)), outputs


def _distinct(checks):
    seen = {}
    for kind, form in checks:
        seen.setdefault((kind, tuple(sorted(form.items(), key=repr))), (kind, form))
    return seen.values()


def _rule(checks, n):
    def rule(eqn, ins):
        ints = [is_integer(v.aval) for v in eqn.outvars]
        if not any(ins):  # Constants: bounded by themselves (a mask's zeros, a bool as 0/1).
            return [_constant(eqn, n) if i else None for i in ints]
        if not any(ints) and not _sub_programs(eqn):
            return [None] * len(ints)
        if NEGATIVE_AXIS_SCOPE in str(eqn.source_info.name_stack):
            checks.append((NEGATIVE_AXIS, _unbounded(ins).elem))
        return [b if i else None for b, i in zip(_bounds(eqn, ins, n, checks), ints)]
    return rule


def _bounds(eqn, ins, n, checks):
    name, size = eqn.primitive.name, _size(eqn.outvars[0])
    if n is OUTSIDE and name in _REPLICA_PROGRAMS:  # Checked by its own analysis.
        return [Bound({OTHER: math.inf}, {OTHER: math.inf})] * len(eqn.outvars)
    if n is not OUTSIDE and (name in _ACROSS_REPLICAS or name == GROUP or _gathers(eqn)):
        return _collectives(eqn, ins, n, checks)
    if name == "jdist_merge":
        return _merge(eqn.params["merge_body"], ins, n, checks)
    if name in _INDICES and (n is not OUTSIDE or name != "axis_index"):
        return [_index(eqn, n)] * len(eqn.outvars)
    # A sub-program's literal operands become its inputs: bounded by themselves.
    ins = [_literal(v, _size(v)) if isinstance(v, core.Literal) and is_integer(v.aval) else b
           for v, b in zip(eqn.invars, ins)] if _sub_programs(eqn) else ins
    if name in _LOOPS:
        return _LOOPS[name](eqn, ins, n, checks)
    inner = invariance.call_body(eqn)
    if inner is not None:
        return list(invariance.propagate(inner, ins, _rule(checks, n), None))
    values = [b for b in _values(eqn, ins) if b is not None]
    if not values:  # Integers reach only its indices (a float scatter at labels).
        return [None] * len(eqn.outvars)
    rule = _RULES.get(name)
    out = _unbounded(values) if rule is None else rule(eqn, values, size)
    if rule is None or name in _GROWS:
        checks.append((WRAP, out.elem))
    if name == "top_k":
        return [out, _index(eqn, n)]
    return [out] * len(eqn.outvars)


def _gathers(eqn):
    """Whether ``eqn`` is an uneven step's all_gather (a merge of every replica's values of
    different shapes, `uneven_trace`), each output the gather of the operand at its place."""
    return (eqn.primitive.name == "jdist_merge" and eqn.params["gathers"]
            and len(eqn.invars) == len(eqn.outvars))


def _collectives(eqn, ins, n, checks):
    """A collective's outputs (each replica holds every replica's part, or their sum: ``n``
    times a replica's share), with the checks of the integers a SUM adds; an exact step's
    group (`GROUP`) member by member."""
    members = (eqn.params["members"] if eqn.primitive.name == GROUP
               else [(eqn.primitive, None, len(ins))])
    outs, start = [], 0
    for primitive, _, count in members:
        for b, v in zip(ins[start:start + count], eqn.invars[start:start + count]):
            if b is None or not is_integer(v.aval):
                outs.append(None)
            elif primitive.name in _SUMS:
                checks.append((ACROSS, scale(b.elem, n)))
                outs.append(Bound(scale(b.elem, n), scale(b.replica, n)))
            else:
                outs.append(Bound(b.elem, scale(b.replica, n)))
        start += count
    return outs


def _merge(body, ins, n, checks):
    """An uneven step's merge_call (`uneven_merge.MergeBody`): its merge_fn's program over
    every replica's operands, each bounded as this replica's are (a bound of an argument's
    numbers holds on every replica); each output bounded by its bounds over the replicas."""
    inner = invariance.open_jaxpr(body.jaxpr)
    copies = len(inner.invars) // max(1, body.count)
    outs = invariance.propagate(inner, list(ins) * copies, _rule(checks, n), None)
    return [join([outs[positions[j]] for positions in body.outputs])
            for j in range(len(body.outputs[0]))]


# ------------------------------------------------------------------ element-wise rules
def _same(eqn, values, size):
    return Bound(_add(v.elem for v in values), _add(v.replica for v in values))


def _broadcast(eqn, values, size):
    (v,) = values
    return Bound(v.elem, scale(v.replica, size / max(1, _size(eqn.invars[0]))))


def _spread(eqn, values, size):  # Each number is one of the operands' (or a padding value).
    elem = _add(v.elem for v in values)
    return Bound(elem, scale(elem, size))


def _summed(eqn, values, size):  # Each number adds some of the replica's numbers.
    share = _add(v.replica for v in values)
    return Bound(share, share if eqn.primitive.name == "reduce_sum" else scale(share, size))


def _scatter_add(eqn, values, size):
    operand, *updates = values
    return Bound(_add([operand.elem] + [u.replica for u in updates]),
                 _add([operand.replica] + [u.replica for u in updates]))


def _quotient(eqn, values, size):
    dividend = values[0]  # Division by 0 gives -1; a remainder is at most the dividend.
    divisor = values[1].elem if len(values) == 2 else {}
    if eqn.primitive.name == "rem" and set(divisor) == {CONST} and divisor[CONST] > 0:
        return _constants(values[1].elem[CONST], size)  # Under the divisor's magnitude.
    return Bound(_add([dividend.elem, {CONST: 1}]), _add([dividend.replica, {CONST: size}]))


def _product(eqn, values, size):
    """A product of one bounded value by constants (a `CONST` bound bounds each of them)
    scales its bounds; any other product is unbounded, though zeros still give 0."""
    factors = [v.elem[CONST] if set(v.elem) == {CONST} else None for v in values]
    unknown = [v for v, f in zip(values, factors) if f is None]
    if len(unknown) == 1 and len(values) == 2:
        factor = math.prod(f for f in factors if f is not None)
        return Bound(scale(unknown[0].elem, factor), scale(unknown[0].replica, factor))
    if not unknown:
        return _constants(math.prod(factors), size)
    return _unbounded(values, known=True)


def _in_int32(eqn, values, size):  # Bitwise: TF's int64 result of int32-sized numbers.
    return _constants(2**31 - 1, size)


def _converted(eqn, values, size):
    dtype = np.dtype(eqn.params["new_dtype"])
    if dtype.kind == "u":  # Negative numbers become large ones, as in TF's cast.
        return _constants(np.iinfo(dtype).max, size)
    return _same(eqn, values, size)


_RULES = {
    **dict.fromkeys(["reshape", "squeeze", "expand_dims", "transpose", "rev", "slice", "copy",
                     "copy_p", "neg", "abs", "reduce_max", "reduce_min", "dynamic_slice",
                     "ppermute", "optimization_barrier", "pvary",
                     "reduce_precision", "add", "add_any", "sub", "max", "min", "clamp",
                     "concatenate", "stack", "select_n", "sort", "dynamic_update_slice",
                     "scatter",
                     "shift_right_arithmetic", "split", "pbroadcast", "device_put",
                     "sharding_constraint", "mesh_cast", "reshard"], _same),
    "convert_element_type": _converted,
    "broadcast_in_dim": _broadcast,
    **dict.fromkeys(["gather", "pad", "cummax", "cummin"], _spread),
    **dict.fromkeys(["reduce_sum", "cumsum"], _summed),
    **dict.fromkeys(["scatter-add", "scatter_add"], _scatter_add),
    **dict.fromkeys(["div", "rem"], _quotient),
    "mul": _product,
    **dict.fromkeys(["and", "or", "xor", "not", "population_count", "clz"], _in_int32),
    "sign": lambda eqn, values, size: _constants(1, size),
    "top_k": _same,
}
# Where a number may leave int32's range: each result's numbers are checked (`WRAP`).
_GROWS = frozenset({"add", "add_any", "sub", "neg", "abs", "mul", "reduce_sum", "cumsum",
                    "scatter-add", "scatter_add", "div"})
_SUMS = frozenset({"psum", "psum_invariant", "psum_scatter", "reduce_scatter"})
_ACROSS_REPLICAS = _SUMS | {"pmax", "pmin", "all_gather", "all_gather_invariant", "all_to_all"}
_INDICES = frozenset({"argmax", "argmin", "iota", "axis_index"})  # Bounded by a shape.
_REPLICA_PROGRAMS = frozenset({"shard_map"})  # `OUTSIDE`: what `run` and `reduce` call.
# The operands whose numbers reach the output (the others are indices); all by default.
_VALUE_OPERANDS = {"dynamic_slice": (0,), "gather": (0,), "dynamic_update_slice": (0, 1),
                   "scatter-add": (0, 2), "scatter_add": (0, 2), "scatter": (0, 2),
                   "pad": (0, 1)}


def _values(eqn, ins):
    """The operands' bounds that reach the output's numbers (indices and predicates do not):
    a literal bounds itself; an integer that nothing bounds beside one that is adds `OTHER`."""
    name = eqn.primitive.name
    keep = (range(1, len(ins)) if name == "select_n"
            else _VALUE_OPERANDS.get(name, range(len(ins))))
    out = []
    for i in keep:
        var, bound = eqn.invars[i], ins[i]
        if bound is not None or not is_integer(var.aval):
            out.append(bound)
        elif isinstance(var, core.Literal):
            out.append(_literal(var, _size(eqn.outvars[0])))
        else:
            out.append(Bound({OTHER: math.inf}, {OTHER: math.inf}))
    return out


# ------------------------------------------------------------------ loops and branches
def _scan(eqn, ins, n, checks):
    p, (nc, nk) = eqn.params, invariance.scan_counts(eqn.params)
    body, consts, carry = invariance.open_jaxpr(p["jaxpr"]), ins[:nc], list(ins[nc:nc + nk])
    xs = ins[nc + nk:]  # One slice per iteration: within the whole.

    def step(state, record):
        return invariance.propagate(body, consts + state + xs, _rule(record, n), None)
    carry, ys = _iterate(step, carry, p["length"], checks)
    return carry + [None if y is None else Bound(y.elem, scale(y.replica, p["length"]))
                    for y in ys]


def _while(eqn, ins, n, checks):
    p = eqn.params
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    body, cond = invariance.open_jaxpr(p["body_jaxpr"]), invariance.open_jaxpr(p["cond_jaxpr"])

    def step(state, record):
        invariance.propagate(cond, ins[:nc] + state, _rule(record, n), None)
        return invariance.propagate(body, ins[nc:nc + nb] + state, _rule(record, n), None)
    carry, _ = _iterate(step, list(ins[nc + nb:]), math.inf, checks)
    return carry


def _cond(eqn, ins, n, checks):
    branches = [invariance.propagate(invariance.open_jaxpr(b), ins[1:], _rule(checks, n), None)
                for b in eqn.params["branches"]]
    return [join(outs) for outs in zip(*branches)]


_LOOPS = {"scan": _scan, "while": _while, "cond": _cond}


def _iterate(step, carry, count, checks):
    """A loop's carry bounds after up to ``count`` iterations of ``step(carry, checks)`` (which
    returns the carry, then other outputs), and its other outputs' bounds: the carry is joined
    with each iteration's until it no longer changes; after `ITERATIONS`, what still changes is
    unbounded. The checks of the final bounds are recorded."""
    done = 0
    while done < count:
        new = [join([c, o]) for c, o in zip(carry, step(carry, [])[:len(carry)])]
        if new == carry:
            break
        done += 1
        growing = ITERATIONS <= done < count  # More iterations than followed: unbounded.
        carry = [_widen(c, o) for c, o in zip(carry, new)] if growing else new
    return carry, step(carry, checks)[len(carry):]


# ------------------------------------------------------------------ forms
def _add(forms):
    total = {}
    for form in forms:
        for key, coefficient in form.items():
            total[key] = total.get(key, 0) + coefficient
    return total


def scale(form: dict, factor) -> dict:
    """``form`` times ``factor``."""
    return {key: coefficient * factor for key, coefficient in form.items()} if factor else {}


def join(bounds: Sequence) -> Bound:
    """The least bound above every one of ``bounds`` (None where all are)."""
    bounds = [b for b in bounds if b is not None]
    if not bounds:
        return None
    return Bound(*({key: max(form.get(key, 0) for form in forms)
                    for key in set().union(*forms)}
                   for forms in zip(*bounds)))


def _widen(old, new):
    if old is None or new is None or old == new:
        return new
    return Bound(*({key: math.inf if form.get(key) != before.get(key) else value
                    for key, value in form.items()} for before, form in zip(old, new)))


def _constants(magnitude, size):
    return Bound({CONST: float(magnitude)}, {CONST: float(magnitude) * size})


def _literal(var, count):
    """The bound of ``count`` numbers each at most a literal's largest magnitude."""
    return _constants(np.max(np.abs(var.val)), count)


def _constant(eqn, n):
    """The bound of an integer computed from no argument: a literal broadcast, a bool made
    0 or 1, an index (`_index`); None (unknown) for others."""
    name, size = eqn.primitive.name, _size(eqn.outvars[0])
    operand = eqn.invars[0] if eqn.invars else None
    if name == "broadcast_in_dim" and isinstance(operand, core.Literal):
        return _literal(operand, size)
    if name == "convert_element_type" and operand is not None and operand.aval.dtype == bool:
        return _constants(1, size)
    if name in _INDICES and (n is not OUTSIDE or name != "axis_index"):
        return _index(eqn, n)
    return None


def _index(eqn, n):
    """An index's bound: under the size of what it indexes (an operand's, or its own; a
    replica id's: the replica count)."""
    sizes = [_size(v) for v in eqn.invars] + [_size(eqn.outvars[0])] + ([n] if n else [])
    return _constants(max(sizes), _size(eqn.outvars[0]))


def _unbounded(bounds, known=False):
    """No bound on what ``bounds``' inputs give, but 0 from zeros where the operation is
    ``known`` to (a product); an unknown one may make numbers of its own (`OTHER`)."""
    keys = {key for b in bounds if b is not None for form in b for key in form}
    form = {**{key: math.inf for key in keys}, **({} if known else {OTHER: math.inf})}
    return Bound(form, form)


def _sub_programs(eqn):
    """Whether ``eqn`` runs sub-programs (a call, a loop; not a scatter's combiner)."""
    return any(isinstance(item, (core.Jaxpr, core.ClosedJaxpr))
               for key, value in eqn.params.items() if key != "update_jaxpr"
               for item in (value if isinstance(value, (tuple, list)) else (value,)))


def _size(var):
    return math.prod(var.aval.shape)


def is_integer(aval) -> bool:
    """Whether ``aval`` (a traced value's abstract value) holds integers."""
    dtype = getattr(aval, "dtype", None)  # PRNG keys' dtypes are extended: not integers.
    return dtype is not None and jax.dtypes.issubdtype(dtype, np.integer)
