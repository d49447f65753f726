"""In-step integer sums of int64 host numbers: where JAX's int32 could wrap and TF's int64 not.

Without x64 JAX holds int64 host numbers as int32 (each fits: `host_values.check_host_numbers`),
so a step computes with them exactly as TF does until a value leaves int32's range, which TF's
int64 never does for such inputs. Across replicas that happens in a SUM all-reduce: four
replicas' ``2**30`` give 0 in int32 and ``2**32`` in TF. The step's integer operations before it
can grow the numbers too (``jnp.sum(labels)``).

`sum_bounds` reads the traced step once (a dataflow analysis, `invariance.propagate`) and bounds
what every integer ``psum`` adds: a linear form in the int64 arguments' recorded magnitudes
(`values.int64_sum_magnitude`, the sum of the magnitudes of every replica's numbers), where
each argument's magnitude bounds the sum of the magnitudes of everything the step computes from
it. Indices carry no magnitude into a value (``gather``, ``scatter``, ``dynamic_slice``, the
predicate of ``select_n``), nor do bools and floats: an accuracy count, a confusion matrix made
with ``at[labels].add(1)`` or a float loss is not bounded by the labels and needs no check.
`check` evaluates the bounds on each call's arguments and raises `X64RequiredError` where one
reaches 2**31: there the int32 sum may differ from TF's. An in-step ``all_gather`` along a
negative axis is marked (`NEGATIVE_AXIS_SCOPE`) where TF would gather int64 numbers with its
collective ops, which raise on one; `check` raises where int64 arguments reach it.
"""

import contextlib
import math
import threading
from typing import Sequence

import jax
from jax.extend import core
import numpy as np

from jdist._src import errors
from jdist._src import invariance
from jdist._src.host_values import WRAPS_AT
from jdist._src.run_arguments import STATIC
from jdist._src.values import Mirrored
from jdist._src.values import PerReplica
from jdist._src.values import is_distributed
from jdist._src.values import holds_tf_int64
from jdist._src.values import int64_sum_magnitude

CONST = "const"  # A bound's part that constants contribute (its magnitude is 1).
NEGATIVE_AXIS = "negative axis"  # Marks an all_gather along a negative axis (not a sum).
# The name scope of an in-step all_gather along a negative axis where TF would gather int64
# numbers with its collective ops, which raise on one (`StrategyExtended.negative_axis_scope`).
NEGATIVE_AXIS_SCOPE = "jdist_negative_axis_gather"
OTHER = "other"  # A bound's part that nothing recorded bounds: infinite where it appears.
CLEAN = {}  # Not computed from an integer argument (or not an integer).

_SAME = frozenset({"reshape", "squeeze", "expand_dims", "transpose", "rev", "slice", "copy",
                   "copy_p", "neg", "abs", "reduce_sum", "reduce_max", "reduce_min",
                   "convert_element_type", "dynamic_slice", "ppermute", "all_to_all",
                   "optimization_barrier", "pvary", "reduce_precision"})
_ADDED = frozenset({"add", "add_any", "sub", "max", "min", "concatenate", "clamp", "sort",
                    "dynamic_update_slice", "scatter-add", "scatter_add", "scatter"})
_SUMS = frozenset({"psum", "psum_invariant", "psum_scatter", "reduce_scatter"})
_ACROSS = _SUMS | {"pmax", "pmin", "all_gather", "all_gather_invariant"}  # Every replica
# holds every replica's part (or its share of their sum).
GROUP = "jdist_collectives"  # An exact step's like collectives as one (`uneven_schedule`).
_INDICES = frozenset({"argmax", "argmin", "iota", "axis_index"})  # Bounded by a shape.
# The operands whose numbers reach the output (the others are indices); all by default.
_VALUE_OPERANDS = {"dynamic_slice": (0,), "gather": (0,), "dynamic_update_slice": (0, 1),
                   "scatter-add": (0, 2), "scatter_add": (0, 2), "scatter": (0, 2)}


def sum_bounds(jaxpr: core.Jaxpr, inputs: Sequence[dict], num_replicas: int) -> tuple:
    """The bound of every integer SUM across replicas in ``jaxpr`` that an integer input
    reaches, as ``{input key: coefficient}`` forms (see the module doc).

    Args:
      jaxpr: the step's body (one replica's program).
      inputs: per input, ``{key: 1}`` for an integer argument named ``key``, else `CLEAN`.
      num_replicas: how many replicas a collective spans.

    Returns:
      A tuple of bounds, one per such sum (empty where no integer sum depends on an input).
    """
    if not any(inputs) or not _has_integer_sum(jaxpr):
        return ()
    found = []
    invariance.propagate(jaxpr, list(inputs), _rule(found, num_replicas), CLEAN)
    return tuple(found)


def program_bounds(arguments: Sequence, operands: Sequence, body: core.Jaxpr,
                   kinds: Sequence[str], num_replicas: int) -> tuple:
    """`sum_bounds` of an even step's ``body``, keyed by argument leaf: ``arguments`` are the
    variables of the leaves that are not static (``kinds``), in order, and ``operands`` the
    body's inputs among them."""
    inputs = argument_inputs(operands, dict(zip(arguments, dynamic_leaves(kinds))))
    return sum_bounds(body, inputs, num_replicas)


def dynamic_leaves(kinds: Sequence[str]) -> list:
    """The leaf index of each dynamic (not static) argument, in order: the bounds' keys."""
    return [i for i, kind in enumerate(kinds) if kind != STATIC]


def argument_inputs(operands: Sequence, keys: dict) -> list:
    """`sum_bounds`' inputs: per operand of the step's program, ``{key: 1}`` for an integer
    argument (``keys``: the arguments' variables to their keys), else `CLEAN`."""
    return [{keys[v]: 1} if isinstance(v, core.Var) and v in keys and _is_int(v.aval)
            else CLEAN for v in operands]


class _TracedArguments(threading.local):
    """While a `dispatch.function` traces its function on this thread: its argument leaves'
    arrays (by id, to their index) and where the bounds its ``run`` calls find go."""
    inputs = None
    found = None


_function_trace = _TracedArguments()


@contextlib.contextmanager
def function_trace(arguments, found: list):
    """While inside, a traced ``run`` whose arguments are ``arguments``' leaves (a
    `dispatch.function`'s, traced) adds its bounds, keyed by those leaves, to ``found`` as
    ``(tree, bound, num_replicas)``: `check_function` checks them on each call."""
    leaves, tree = jax.tree_util.tree_flatten(arguments, is_leaf=is_distributed)
    saved = _function_trace.inputs, _function_trace.found
    _function_trace.inputs = {id(_array(leaf)): i for i, leaf in enumerate(leaves)}
    _function_trace.found = (tree, found)
    try:
        yield
    finally:
        _function_trace.inputs, _function_trace.found = saved


def check_function(found: list, arguments) -> None:
    """`check` of a `dispatch.function` call's ``arguments`` against the bounds its traces
    found (`function_trace`)."""
    leaves, tree = jax.tree_util.tree_flatten(arguments, is_leaf=is_distributed)
    for traced_tree, bound, num_replicas in found:
        if traced_tree == tree:
            check((bound,), leaves, num_replicas, "a jdist.function's strategy.run")


def check(bounds: tuple, leaves: list, num_replicas: int, what: str = "strategy.run") -> None:
    """Raises `X64RequiredError` where one of ``bounds`` (keys: indices into ``leaves``, the
    call's arguments flattened with distributed values as leaves) reaches 2**31 on this call
    while an int64 host number contributes to it (a host array counts once per replica).
    Traced arguments have no numbers: inside a `function_trace`, the bounds go to it."""
    if _function_trace.inputs is not None and any(map(_traced, leaves)):
        _hand_over(bounds, leaves, num_replicas)
        return
    for bound in bounds:
        keys = [k for k in bound if isinstance(k, int) and holds_tf_int64(leaves[k])]
        if not keys:
            continue  # No int64 argument reaches it: TF's int32 sum, which JAX's is.
        if NEGATIVE_AXIS in bound:
            raise errors.InvalidArgumentError(
                f"{what}: the step all-gathers along a negative axis integers computed from "
                f"int64 host numbers (the arguments' leaves {keys}). TensorFlow holds them as "
                "int64 and gathers them with its collective ops (CollectiveAllReduce), which "
                "raise on a negative axis ('Requires start <= limit'). Count the axis from the "
                "front (axis=x.ndim - 1 for the last).")
        total = sum(_part(bound, key, leaves, num_replicas) for key in bound)
        if total >= WRAPS_AT:
            raise errors.X64RequiredError(
                f"{what}: the step all-reduces (SUM) integers computed from int64 host numbers "
                f"(the arguments' leaves {keys}, in jax.tree_util.tree_leaves order with "
                "distributed values as leaves) whose magnitudes may add up to 2**31 or more"
                f"{'' if math.isinf(total) else f' ({int(total)})'}: TF sums them in "
                "int64, while JAX without x64 holds int32, whose sum would wrap. Enable x64 "
                "(jax.config.update('jax_enable_x64', True)) before creating the arrays, or give "
                "the step int32 host numbers if an int32 sum is what you want.")


def _hand_over(bounds, leaves, num_replicas):
    """``bounds`` on the traced function's own argument leaves; a leaf the function computed
    (not one of its arguments) counts as one that nothing bounds (`OTHER`)."""
    tree, found = _function_trace.found
    for bound in bounds:
        outer = {}
        for key, coefficient in bound.items():
            if isinstance(key, int):
                key = _function_trace.inputs.get(id(_array(leaves[key])), OTHER)
            outer[key] = math.inf if key == OTHER else outer.get(key, 0) + coefficient
        if (tree, outer, num_replicas) not in found:  # A retrace finds it again.
            found.append((tree, outer, num_replicas))


def _traced(leaf):
    return isinstance(_array(leaf), jax.core.Tracer)


def _array(leaf):
    if isinstance(leaf, PerReplica) and not leaf.ragged:
        return leaf.stacked
    return leaf.value if isinstance(leaf, Mirrored) else leaf


def _part(bound, key, leaves, num_replicas):
    coefficient = bound[key]
    if key == CONST:
        return coefficient
    if key == OTHER:
        return math.inf
    leaf = leaves[key]
    if not holds_tf_int64(leaf):
        return math.inf  # An int32 array from elsewhere: nothing bounds its numbers here.
    magnitude = int64_sum_magnitude(leaf, 1 if isinstance(leaf, PerReplica) else num_replicas)
    return 0 if magnitude == 0 else coefficient * magnitude


def _rule(found, n):
    def rule(eqn, ins):
        outs = eqn.outvars
        integers = any(_is_int(v.aval) for v in outs)
        if not any(ins):  # Constants: bounded by themselves (a mask's zeros, a bool as 0/1).
            return [_constant(eqn) if integers else CLEAN] * len(outs)
        if not (integers or _has_integer_sum_in(eqn)):  # A call may hold a sum, return floats.
            return [CLEAN] * len(outs)
        bounds = _bounds(eqn, ins, n, found)
        return [b if _is_int(v.aval) else CLEAN for b, v in zip(bounds, outs)]
    return rule


def _bounds(eqn, ins, n, found):
    name, outs = eqn.primitive.name, eqn.outvars
    if NEGATIVE_AXIS_SCOPE in str(eqn.source_info.name_stack):
        found.append({**_unbounded(ins, known=True), NEGATIVE_AXIS: 1})
    if name in _ACROSS or name == GROUP:
        return _collectives(eqn, ins, n, found)
    values = _values(eqn, ins)
    if name in _INDICES:
        return [CLEAN] * len(outs)
    if name in _SAME or name in _ADDED or name == "select_n":
        return [_sum(values)] * len(outs)
    if name == "broadcast_in_dim":
        return [_scale(values[0], _size(outs[0]) / max(1, _size(eqn.invars[0])))]
    if name in ("gather", "cumsum", "cummax", "cummin", "pad"):
        return [_scale(_sum(values), _size(outs[0]))]
    if name in ("div", "rem"):
        return [_sum([values[0], {CONST: _size(outs[0])}])]  # Division by 0 gives -1.
    if name == "mul":
        return [_product(eqn, values)]
    inner = invariance.call_body(eqn)
    if inner is not None:  # Literal operands become its inputs: bounded by themselves.
        ins = [_literal(v, _size(v)) if isinstance(v, core.Literal) and _is_int(v.aval) else b
               for v, b in zip(eqn.invars, ins)]
        return list(invariance.propagate(inner, ins, _rule(found, n), CLEAN))
    if _has_integer_sum_in(eqn):
        found.append(_unbounded(ins))
    return [_unbounded(ins)] * len(outs)


def _collectives(eqn, ins, n, found):
    """A collective's outputs (each replica holds every replica's part: ``n`` times its
    operand's bound), recording the bounds of the integers a SUM adds; an exact step's group
    (`GROUP`) member by member."""
    members = (eqn.params["members"] if eqn.primitive.name == GROUP
               else [(eqn.primitive, None, len(ins))])
    start = 0
    for primitive, _, count in members:
        if primitive.name in _SUMS:
            found.extend(b for b, v in zip(ins[start:start + count], eqn.invars[start:])
                         if b and _is_int(v.aval))
        start += count
    return [_scale(b, n) for b in ins]


def _values(eqn, ins):
    """The operands' bounds that reach the output's numbers (indices and predicates do not);
    an integer operand that no argument bounds, beside one that is, adds `OTHER`."""
    name = eqn.primitive.name
    keep = (range(1, len(ins)) if name == "select_n"
            else _VALUE_OPERANDS.get(name, range(len(ins))))
    out = []
    for i in keep:
        var, bound = eqn.invars[i], ins[i]
        if bound or not _is_int(var.aval):
            out.append(bound)
        elif isinstance(var, core.Literal):  # Broadcast over the output.
            out.append(_literal(var, _size(eqn.outvars[0])))
        else:
            out.append({OTHER: math.inf})
    return out


def _constant(eqn):
    """The bound of an integer computed from no argument: a literal broadcast, a bool made
    0 or 1 (`CONST`, the sum of their magnitudes); `CLEAN` (unknown) for others."""
    name, size = eqn.primitive.name, _size(eqn.outvars[0])
    operand = eqn.invars[0] if eqn.invars else None
    if name == "broadcast_in_dim" and isinstance(operand, core.Literal):
        return _literal(operand, size)
    if name == "convert_element_type" and operand is not None and operand.aval.dtype == bool:
        return {CONST: float(size)}
    return CLEAN


def _literal(var, count):
    """The bound of ``count`` numbers each at most a literal's largest magnitude."""
    return {CONST: float(np.max(np.abs(var.val))) * count}


def _product(eqn, values):
    """A product of one bounded value by constants (a literal scalar, a `CONST` bound, which
    bounds each of its numbers) scales its bound; any other product is unbounded."""
    literal = [isinstance(v, core.Literal) and np.ndim(v.val) == 0 for v in eqn.invars]
    factors = [abs(float(v.val)) if is_literal else b.get(CONST) if set(b) == {CONST} else None
               for v, b, is_literal in zip(eqn.invars, values, literal)]
    unknown = [b for b, factor in zip(values, factors) if factor is None]
    if len(unknown) == 1:
        return _scale(unknown[0], math.prod(f for f in factors if f is not None))
    return _unbounded(values, known=True)


def _sum(bounds):
    total = {}
    for bound in bounds:
        for key, coefficient in bound.items():
            total[key] = total.get(key, 0) + coefficient
    return total


def _scale(bound, factor):
    return {key: coefficient * factor for key, coefficient in bound.items()} if factor else {}


def _unbounded(bounds, known=False):
    """No bound on what ``bounds``' inputs give, but 0 from zeros where the operation is
    ``known`` to (a product); an unknown one may make numbers of its own (`OTHER`)."""
    keys = {key for bound in bounds for key in bound}
    if not keys:
        return CLEAN
    return {**{key: math.inf for key in keys}, **({} if known else {OTHER: math.inf})}


def _size(var):
    return math.prod(var.aval.shape)


def _is_int(aval):
    dtype = getattr(aval, "dtype", None)  # PRNG keys' dtypes are extended: not integers.
    return dtype is not None and jax.dtypes.issubdtype(dtype, np.integer)


def _has_integer_sum(jaxpr):
    return any(_is_integer_sum(eqn) or _has_integer_sum_in(eqn) for eqn in jaxpr.eqns)


def _is_integer_sum(eqn):
    """Whether ``eqn`` sums integers across replicas (or all-gathers them along a negative
    axis, `NEGATIVE_AXIS_SCOPE`): what `sum_bounds` looks for."""
    names = ({member[0].name for member in eqn.params["members"]}
             if eqn.primitive.name == GROUP else {eqn.primitive.name})
    marked = NEGATIVE_AXIS_SCOPE in str(eqn.source_info.name_stack)
    return (bool(names & _SUMS) or marked) and any(_is_int(v.aval) for v in eqn.invars)


def _has_integer_sum_in(eqn):
    return any(_has_integer_sum(invariance.open_jaxpr(sub))
               for sub in _sub_jaxprs(eqn.params))


def _sub_jaxprs(params):
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, (core.Jaxpr, core.ClosedJaxpr)):
                yield item
