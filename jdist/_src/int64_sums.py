"""In-step integer arithmetic on int64 host numbers: where JAX's int32 could wrap and TF's not.

Without x64 JAX holds int64 host numbers as int32 (each fits: `host_values.check_host_numbers`),
so a step computes with them exactly as TF does until a value leaves int32's range, which TF's
int64 never does for such inputs: four replicas' ``2**30`` all-reduced give 0 in int32 and
``2**32`` in TF, and so does one replica's ``jnp.sum`` or ``y * 4`` of them.

`program_checks` reads the traced step once (`int64_bounds.analyse`: every integer value's
bound as linear forms in the int64 arguments' recorded magnitudes) and keeps what each call must
check: every operation whose numbers could leave int32's range (a SUM across replicas, an
``add``, a ``reduce_sum``, a product...), and the bounds of the step's integer outputs. `check`
evaluates them on each call's arguments: it raises `X64RequiredError` where a bound reaches
2**31 (there the int32 number may differ from TF's), and records the outputs' bounds on the
values returned (`int64_values.record_int64_bounds`), so that a later
``strategy.reduce`` of them, or a later step, is checked in turn. Counts, indices and floats
computed from int64 numbers are not bounded by them and need no check. An in-step
``all_gather`` along a negative axis is marked (`NEGATIVE_AXIS_SCOPE`) where TF would gather
int64 numbers with its collective ops, which raise on one; `check` raises where int64
arguments reach it.
"""

import contextlib
import dataclasses
import math
import threading
from typing import Sequence

import jax
from jax.extend import core
import numpy as np

from jdist._src import argument_paths
from jdist._src import errors
from jdist._src import int64_bounds
from jdist._src.host_values import WRAPS_AT
from jdist._src.int64_bounds import ACROSS
from jdist._src.int64_bounds import CONST
from jdist._src.int64_bounds import MAX
from jdist._src.int64_bounds import NEGATIVE_AXIS
from jdist._src.int64_bounds import OTHER
from jdist._src.int64_bounds import SUM
from jdist._src.int64_bounds import TOTAL
from jdist._src.run_arguments import STATIC
from jdist._src.values import Mirrored
from jdist._src.values import PerReplica
from jdist._src.values import is_distributed
from jdist._src.int64_values import adds_no_int64
from jdist._src.int64_values import holds_tf_int64
from jdist._src.int64_values import int64_max_magnitude
from jdist._src.int64_values import int64_sum_magnitude
from jdist._src.int64_values import record_int64_bounds
from jdist._src.int64_values import record_traced_bounds
from jdist._src.int64_values import traced_bounds

_RECORDED_AT_MOST = 2**62  # An output's unbounded magnitude, recorded: any sum of it raises.
REDUCE = "reduce"  # A check a `jdist.function` gets from a `strategy.reduce` inside it.


@dataclasses.dataclass(frozen=True)
class Checks:
    """What each call of one program checks (`program_checks`).

    Attributes:
      checks: ``(kind, form)`` per operation whose numbers may leave int32's range.
      outputs: ``(index, bound)`` per integer output computed from integer arguments.
      keys: the argument leaves those read.
    """
    checks: tuple = ()
    outputs: tuple = ()
    keys: tuple = ()
    lookup: dict = dataclasses.field(default_factory=dict, compare=False)  # Keys' paths.

    def __bool__(self):
        return bool(self.checks or self.outputs)


NONE = Checks()


def program_checks(traced: core.ClosedJaxpr, operands: Sequence, body: core.Jaxpr,
                   kinds: Sequence[str], num_replicas: int) -> Checks:
    """The `Checks` of an even step's ``body``, keyed by argument leaf: ``traced``'s inputs are
    the leaves that are not static (``kinds``), in order, its constants what the step closes
    over, and ``operands`` the body's inputs among them."""
    keys = dict(zip(traced.jaxpr.invars, dynamic_leaves(kinds)))
    inputs = argument_inputs(operands, keys, dict(zip(traced.jaxpr.constvars, traced.consts)))
    checks, outputs = int64_bounds.analyse(body, inputs, num_replicas)
    return _checks(checks, [(i, b) for i, b in enumerate(outputs) if b is not None])


def step_checks(jaxpr: core.Jaxpr, inputs: Sequence, num_replicas: int,
                out_leaves: Sequence[int]) -> Checks:
    """The `Checks` of one replica's trace of an exact step, its outputs keyed by their leaves
    in the step's output nest (``out_leaves``: the leaf of each of ``jaxpr``'s outputs)."""
    checks, outputs = int64_bounds.analyse(jaxpr, inputs, num_replicas)
    return _checks(checks, [(i, b) for i, b in zip(out_leaves, outputs) if b is not None])


def merged(all_checks: Sequence[Checks]) -> Checks:
    """One `Checks` holding every one of ``all_checks``' checks, each output bounded by the
    largest of its bounds (replicas' traces of one step)."""
    outputs = {}
    for checks in all_checks:
        for index, bound in checks.outputs:
            outputs.setdefault(index, []).append(bound)
    return _checks(tuple(c for checks in all_checks for c in checks.checks),
                   [(i, int64_bounds.join(b)) for i, b in sorted(outputs.items())])


def _checks(checks, outputs):
    """A `Checks`, or `NONE` where no argument leaf takes part: no call's numbers change it."""
    forms = [form for _, form in checks] + [form for _, b in outputs for form in b]
    keys = sorted({key[1] for form in forms for key in form if isinstance(key, tuple)})
    return Checks(tuple(checks), tuple(outputs), tuple(keys)) if keys else NONE


def _keyed(form):
    return any(isinstance(key, tuple) for key in form)


def dynamic_leaves(kinds: Sequence[str]) -> list:
    """The leaf index of each dynamic (not static) argument, in order: the checks' keys."""
    return [i for i, kind in enumerate(kinds) if kind != STATIC]


def argument_inputs(operands: Sequence, keys: dict, constants: dict = None) -> list:
    """`int64_bounds.analyse`'s inputs: per operand of the step's program, the bound of an
    integer argument (``keys``: the arguments' variables to their leaf indices) or of an
    integer constant (``constants``: variables to values), else None."""
    def bound(v):
        if not (isinstance(v, core.Var) and int64_bounds.is_integer(v.aval)):
            return None
        if v in keys:
            return int64_bounds.argument(keys[v])
        return int64_bounds.constant(constants[v]) if v in (constants or {}) else None
    return [bound(v) for v in operands]


@dataclasses.dataclass
class FunctionChecks:
    """What a `dispatch.function`'s traces found (`function_trace`), keyed by the function's
    own argument leaves: per argument tree, the checks its ``run`` and ``strategy.reduce`` calls
    need (``(tree, (kind, form))``), and its integer outputs' bounds (``(tree, leaf, bound)``)."""
    checks: list = dataclasses.field(default_factory=list)
    outputs: list = dataclasses.field(default_factory=list)
    _of: dict = dataclasses.field(default_factory=dict)  # Per tree, its `Checks` (`of`).

    def __bool__(self):
        return bool(self.checks or self.outputs)

    def add_check(self, tree, kind_and_form) -> None:
        """Keeps a check of calls with argument tree ``tree`` (once: a retrace finds it again)."""
        self._add(self.checks, (tree, kind_and_form))

    def add_output(self, tree, index: int, bound) -> None:
        """Keeps the bound of output leaf ``index`` of calls with argument tree ``tree``."""
        self._add(self.outputs, (tree, index, bound))

    def _add(self, entries, entry):
        if entry not in entries:
            entries.append(entry)
            self._of.clear()

    def of(self, tree) -> "Checks":
        """One `Checks` of every check and output bound kept for ``tree`` (made once)."""
        checks = self._of.get(tree)
        if checks is None:
            checks = self._of[tree] = _checks(
                tuple(c for t, c in self.checks if t == tree),
                tuple((i, b) for t, i, b in self.outputs if t == tree))
        return checks


class _TracedArguments(threading.local):
    """While a `dispatch.function` traces its function on this thread: its argument leaves'
    arrays (by id, to their index), their tree and what its traces find (`FunctionChecks`)."""
    inputs = None
    tree = None
    found = None


_function_trace = _TracedArguments()


@contextlib.contextmanager
def function_trace(arguments, found: FunctionChecks):
    """While inside, a traced ``run`` whose arguments are ``arguments``' leaves (a
    `dispatch.function`'s, traced), or values it computed, adds its checks, keyed by those
    leaves, to ``found``, and records its outputs' bounds on them as forms in those leaves
    (`int64_values.record_traced_bounds`), which a ``strategy.reduce``, a later ``run`` and
    `traced_outputs` read: `check_function` checks and records them on each call."""
    leaves, tree = jax.tree_util.tree_flatten(arguments, is_leaf=is_distributed)
    trace = _function_trace
    saved = trace.inputs, trace.tree, trace.found
    trace.inputs = {id(_array(leaf)): i for i, leaf in enumerate(leaves)}
    trace.tree, trace.found = tree, found
    try:
        yield
    finally:
        trace.inputs, trace.tree, trace.found = saved


def traced_outputs(outputs) -> None:
    """Inside `function_trace`: keeps the bounds recorded on the function's ``outputs``, so
    each call records them on what it returns (`check_function`)."""
    tree, found = _function_trace.tree, _function_trace.found
    for i, leaf in enumerate(jax.tree_util.tree_leaves(outputs, is_leaf=is_distributed)):
        bound = traced_bounds(leaf)
        if bound is not None:
            found.add_output(tree, i, bound)


def hand_over_sum(value, copies: int) -> bool:
    """Inside `function_trace`, for a SUM of ``value`` (``strategy.reduce``): hands the
    function the check of what it adds, where ``value`` carries traced bounds; returns whether
    it did (else the caller checks ``value``'s recorded numbers)."""
    bound = traced_bounds(value)
    if _function_trace.found is None or bound is None:
        return False
    total = int64_bounds.scale(bound.replica, value.num_replicas
                               if isinstance(value, PerReplica) else copies)
    _function_trace.found.add_check(_function_trace.tree, (REDUCE, total))
    return True


def check_reduce(op, value, copies: int) -> None:
    """Raises `X64RequiredError` where ``value`` (or one of a list of values) holds int64 host
    numbers (`int64_values`) whose SUM (``op``: a reduce's), TF's int64, may wrap in the int32
    JAX holds them in (a plain value is added ``copies`` times); inside a `jdist.function`,
    hands the check over instead (`hand_over_sum`)."""
    for v in value if isinstance(value, (list, tuple)) else (value,):
        if adds_no_int64(v):
            continue
        if hand_over_sum(v, copies):
            continue
        magnitude = int64_sum_magnitude(v, copies)
        if magnitude >= WRAPS_AT:
            raise errors.X64RequiredError(
                f"{op} of int64 host values whose magnitudes add up to "
                f"{magnitude}: TF sums them in int64, JAX without 64-bit mode in int32, where "
                "the sum may wrap to another number. Enable 64-bit mode before creating arrays "
                "(jax.config.update('jax_enable_x64', True)), or sum values that int32 holds.")


def function_checks(found: FunctionChecks, traced: core.ClosedJaxpr, arguments, outputs,
                    static=lambda path: False) -> None:
    """Adds to ``found`` the checks of what a `dispatch.function` computes itself, outside the
    replicas' programs (``traced``: its program, traced for ``arguments``, which returned
    ``outputs``; ``static``: whether the leaf at a path of ``arguments`` is a static argument,
    not among the program's inputs), keyed by its argument leaves, and the bounds of its
    integer outputs that its ``run`` calls did not bound (`traced_outputs`)."""
    paths, tree = jax.tree_util.tree_flatten_with_path(arguments, is_leaf=is_distributed)
    # A leaf's first array holds its numbers; a dataset element's block comes with its
    # position in the block, an index (`batch_blocks`).
    keys = [None if i else k for k, (path, leaf) in enumerate(paths) if not static(path)
            for i, _ in enumerate(jax.tree_util.tree_leaves(leaf))]
    jaxpr = traced.jaxpr
    if len(keys) != len(jaxpr.invars):  # Not expected: then no argument is known.
        keys = [None] * len(jaxpr.invars)
    inputs = [int64_bounds.constant(c) if int64_bounds.is_integer(v.aval) else None
              for v, c in zip(jaxpr.constvars, traced.consts)]
    inputs += [int64_bounds.whole(k) if k is not None and int64_bounds.is_integer(v.aval)
               else None for v, k in zip(jaxpr.invars, keys)]
    opened = jaxpr.replace(constvars=[], invars=[*jaxpr.constvars, *jaxpr.invars])
    checks, bounds = int64_bounds.analyse(opened, inputs, int64_bounds.OUTSIDE)
    for kind, form in checks:
        if _keyed(form):  # An argument takes part: a call's numbers may make it wrap.
            found.add_check(tree, (kind, form))
    returned = jax.tree_util.tree_leaves(outputs, is_leaf=is_distributed)
    at = [j for j, leaf in enumerate(returned) for _ in jax.tree_util.tree_leaves(leaf)]
    bounded = {index for t, index, _ in found.outputs if t == tree}
    for j, bound in zip(at, bounds):
        if j not in bounded and bound is not None and any(map(_keyed, bound)):
            found.add_output(tree, j, bound)


def check_function(found: FunctionChecks, arguments, outputs) -> None:
    """`check` of a `dispatch.function` call's ``arguments`` against the checks its traces
    found (`function_trace`), then the bounds of its integer ``outputs`` recorded on them."""
    leaves, tree = jax.tree_util.tree_flatten(arguments, is_leaf=is_distributed)
    checks = found.of(tree)
    if checks:
        check(checks, leaves, outputs, what="a jdist.function")


def check(checks: Checks, leaves, outputs=None, what: str = "strategy.run") -> None:
    """Raises where one of ``checks`` may wrap on this call, else records the bounds of the
    call's integer ``outputs`` (the program's flat outputs, wrapped) on them.

    Args:
      checks: the program's `Checks`.
      leaves: the call's arguments flattened with distributed values as leaves, or the call
        ``(args, kwargs)`` itself (the leaves the checks read are then looked up by path).
      outputs: the program's outputs as ``run`` returns them, flat or as the step's nest, or
        None.
      what: the call, as the error names it.

    Raises:
      X64RequiredError: a bound that an int64 host number contributes to reaches 2**31.
      InvalidArgumentError: such numbers reach an all_gather along a negative axis.
    """
    keyed = _keyed_leaves(checks, leaves)
    if _function_trace.inputs is not None and any(map(_traced, keyed.values())):
        _hand_over(checks, keyed, outputs)
        return
    int64 = {k for k, leaf in keyed.items() if holds_tf_int64(leaf)}
    if not int64:
        return  # No int64 argument: TF's int32 arithmetic, which JAX's is.
    magnitude = _magnitudes(keyed)
    for kind, form in checks.checks:
        keys = sorted({key[1] for key in form if isinstance(key, tuple)} & int64)
        if keys:
            _raise_where_it_may_wrap(kind, _evaluate(form, magnitude), keys, what)
    if checks.outputs and outputs is not None:  # Flat (`run`'s programs), or a nest.
        outputs = jax.tree_util.tree_leaves(outputs, is_leaf=is_distributed)
    for index, bound in checks.outputs if outputs is not None else ():
        if any(isinstance(key, tuple) and key[1] in int64 for form in bound for key in form):
            largest, replica = (min(_evaluate(form, magnitude), _RECORDED_AT_MOST)
                                for form in bound)
            value = outputs[index]  # A `PerReplica`'s total is n times a replica's sum.
            copies = value.num_replicas if isinstance(value, PerReplica) else 1
            record_int64_bounds(value, min(replica * copies, _RECORDED_AT_MOST),
                                largest, replica)


def _raise_where_it_may_wrap(kind, bound, keys, what):
    if kind == NEGATIVE_AXIS:
        raise errors.InvalidArgumentError(
            f"{what}: a step all-gathers along a negative axis integers computed from "
            f"int64 host numbers (the arguments' leaves {keys}). TensorFlow holds them as "
            "int64 and gathers them with its collective ops (CollectiveAllReduce), which "
            "raise on a negative axis ('Requires start <= limit'). Count the axis from the "
            "front (axis=x.ndim - 1 for the last).")
    if bound < WRAPS_AT:
        return
    does = {ACROSS: "a step all-reduces (SUM) integers", REDUCE: "strategy.reduce adds integers"
            }.get(kind, "integers are computed (a sum, a product, an addition, a loop...)")
    raise errors.X64RequiredError(
        f"{what}: {does} from int64 host numbers (the arguments' leaves {keys}, in "
        "jax.tree_util.tree_leaves order with distributed values as leaves) whose magnitudes "
        f"may reach 2**31{'' if math.isinf(bound) else f' ({int(bound)})'}: TF computes them "
        "in int64, while JAX without x64 holds int32, which would wrap. Enable x64 "
        "(jax.config.update('jax_enable_x64', True)) before creating the arrays, or give "
        "the step int32 host numbers if int32 arithmetic is what you want.")


def _magnitudes(keyed):
    """``magnitude(key)`` of a form's key on this call, each found once (a host array's is
    summed on the host; many forms share keys)."""
    known = {CONST: 1, OTHER: math.inf}

    def magnitude(key):
        if key not in known:
            known[key] = _magnitude(key[0], keyed[key[1]])
        return known[key]
    return magnitude


def _magnitude(kind, value):
    if isinstance(value, (int, np.integer)):  # A number the call gives: its own.
        return abs(int(value))
    if not holds_tf_int64(value):
        return math.inf  # An int32 array from elsewhere: nothing bounds its numbers here.
    if kind == TOTAL:
        return int64_sum_magnitude(value)
    return int64_max_magnitude(value, per_replica=kind == SUM)


def _evaluate(form, magnitude):
    total = 0
    for key, coefficient in form.items():
        m = magnitude(key)
        total += 0 if m == 0 else coefficient * m
    return total


def _keyed_leaves(checks, leaves):
    """The leaves ``checks`` read, by index: from the flattened ``leaves``, or from the call
    itself along their paths (found once per program), which spares a walk over every leaf
    of a call made of dicts, lists and tuples (`argument_paths`)."""
    if isinstance(leaves, list):
        return {k: leaves[k] for k in checks.keys}
    at = checks.lookup.get("at")
    if at is None:
        paths = argument_paths.paths_of(leaves, checks.keys, is_distributed)
        at = checks.lookup["at"] = False if paths is None else tuple(zip(checks.keys, paths))
    if at is False:
        return _keyed_leaves(checks, jax.tree_util.tree_flatten(leaves, is_distributed)[0])
    return {k: argument_paths.known_leaf_at(leaves, path) for k, path in at}


def _hand_over(checks, keyed, outputs):
    """``checks`` on the traced function's own argument leaves, and its ``outputs``' bounds
    recorded as forms in them (`function_trace`)."""
    for kind, form in checks.checks:
        _function_trace.found.add_check(_function_trace.tree, (kind, _outer(form, keyed)))
    if checks.outputs and outputs is not None:  # Flat (`run`'s programs), or a nest.
        outputs = jax.tree_util.tree_leaves(outputs, is_leaf=is_distributed)
    for index, bound in checks.outputs if outputs is not None else ():
        record_traced_bounds(outputs[index], int64_bounds.Bound(
            *(_outer(form, keyed) for form in bound)))


def _outer(form, keyed):
    """``form`` (in a traced ``run``'s argument leaves ``keyed``) in the function's own
    argument leaves: a leaf the function computed counts by its traced bounds, or as one
    that nothing bounds (`OTHER`)."""
    outer = {}
    for key, coefficient in form.items():
        parts = {key: 1}
        if isinstance(key, tuple):
            leaf = keyed[key[1]]
            index = _function_trace.inputs.get(id(_array(leaf)))
            traced = traced_bounds(leaf)
            parts = ({(key[0], index): 1} if index is not None
                     else {OTHER: 1} if traced is None
                     else traced.elem if key[0] == MAX else traced.replica)
        for part, factor in parts.items():
            outer[part] = (math.inf if part == OTHER
                           else outer.get(part, 0) + coefficient * factor)
    return outer


def _traced(leaf):
    return isinstance(_array(leaf), jax.core.Tracer)


def _array(leaf):
    if isinstance(leaf, PerReplica) and not leaf.ragged:
        return leaf.stacked
    return leaf.value if isinstance(leaf, Mirrored) else leaf
