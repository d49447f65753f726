"""Which outputs of a replica function are provably equal on every replica.

``strategy.run`` returns `Mirrored` for those and `PerReplica` for the rest. The answer comes
from a dataflow analysis of the traced program (the body of the ``shard_map``), not from
shard_map's own varying-axes types, because jdist compiles with ``check_vma=False``: under
``check_vma=True`` a replicated input is one shared value, so ``jax.grad`` with respect to it
already sums the replicas' gradients and a ported ``all_reduce("mean", grads)`` would return
the sum -- a silent factor of ``num_replicas``. With ``check_vma=False`` (what ``pmap`` uses)
every replica differentiates its own copy, as in TF. See ``docs/design.md``.

The rule: a value is *same* when it is computed only from replicated inputs, constants and the
results of collectives that give every replica the same result (``psum``, ``pmax``,
``all_gather``...); ``axis_index``, per-replica inputs, permutations and host callbacks make it
*differ*. Control flow is followed into its sub-programs (loop carries to a fixpoint); a
primitive with sub-programs that the analysis does not know is treated as *differ*, so the
answer errs towards `PerReplica`, never towards a wrong `Mirrored`.
"""

import jax.numpy as jnp
from jax.extend import core
from jax.extend import source_info_util

from jdist._src import errors

# Collectives whose result is the same on every replica of the axis ("jdist_collectives": an
# exact uneven step's group of psums, pmaxes and pmins, `uneven_schedule`).
_SAME_COLLECTIVES = frozenset({"psum", "psum_invariant", "pmax", "pmin", "pmean", "all_gather",
                               "all_gather_invariant", "pbroadcast", "axis_size",
                               "jdist_collectives"})
# Primitives whose result can differ between replicas whatever their inputs.
_DIFFERING = frozenset({"axis_index", "ppermute", "all_to_all", "psum_scatter", "reduce_scatter",
                        "pgather", "pure_callback", "io_callback", "debug_callback", "shard_map"})
# Call-like primitives: their sub-program takes the operands one to one.
_CALL_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def propagate(jaxpr, inputs, eqn_rule, constant):
    """A forward dataflow analysis: one state per variable, computed equation by equation.

    Args:
      jaxpr: a ``jax.extend.core.Jaxpr``.
      inputs: the state of each input.
      eqn_rule: ``(eqn, operand_states) -> output_states``.
      constant: the state of literals and closed-over constants.

    Returns:
      The state of each output.
    """
    env = {v: constant for v in jaxpr.constvars}
    env.update(zip(jaxpr.invars, inputs))

    def read(v):
        return constant if isinstance(v, core.Literal) else env.get(v, constant)

    for eqn in jaxpr.eqns:
        env.update(zip(eqn.outvars, eqn_rule(eqn, [read(v) for v in eqn.invars])))
    return [read(v) for v in jaxpr.outvars]


def call_body(eqn):
    """The sub-program of a call-like equation (``jit``, ``custom_jvp_call``, ``checkpoint``...)
    that takes the equation's operands one to one, or None."""
    for key in _CALL_PARAMS:
        sub = eqn.params.get(key)
        if isinstance(sub, (core.Jaxpr, core.ClosedJaxpr)):
            inner = open_jaxpr(sub)
            if len(inner.invars) == len(eqn.invars):
                return inner
    return None


def same_outputs(jaxpr, inputs_same):
    """Returns, per output of ``jaxpr``, whether it is equal on every replica.

    Args:
      jaxpr: a ``jax.extend.core.Jaxpr`` (the per-replica body of the program).
      inputs_same: per input of ``jaxpr``, whether it is equal on every replica.

    Returns:
      A list of bools, one per output.
    """
    return propagate(jaxpr, inputs_same, _eqn_same, True)


def open_jaxpr(closed_or_open):
    """The ``Jaxpr`` of a ``ClosedJaxpr`` (a sub-program's parameter), or the ``Jaxpr`` itself."""
    return getattr(closed_or_open, "jaxpr", closed_or_open)


def _eqn_same(eqn, ins):
    name = eqn.primitive.name
    n_out = len(eqn.outvars)
    if name in _SAME_COLLECTIVES:
        return [True] * n_out
    if name in _DIFFERING:
        return [False] * n_out
    if name == "jdist_merge":  # A merge_call of an uneven step: its result says (`uneven`).
        return list(eqn.params["out_same"])
    if name == "scan":
        return _scan_same(eqn, ins)
    if name == "while":
        return _while_same(eqn, ins)
    if name == "cond":
        return _cond_same(eqn, ins)
    inner = call_body(eqn)
    if inner is not None:
        return same_outputs(inner, ins)
    if any(isinstance(p, (core.Jaxpr, core.ClosedJaxpr)) or (
            isinstance(p, tuple) and p and isinstance(p[0], (core.Jaxpr, core.ClosedJaxpr)))
           for p in eqn.params.values()):
        return [False] * n_out  # A sub-program we do not know how to follow: assume it differs.
    return [all(ins)] * n_out


def scan_counts(params) -> tuple:
    """How many of a ``scan``'s operands are constants and carries: its ``num_consts`` and
    ``num_carry`` (JAX 0.10), or the sizes of the first two groups of its ``ft_in`` (0.11)."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()  # Flat trees: one value per operand.
    return len(list(consts.vals)), len(list(carry.vals))


def _scan_same(eqn, ins):
    body = open_jaxpr(eqn.params["jaxpr"])
    n_consts, n_carry = scan_counts(eqn.params)
    consts, carry, xs = ins[:n_consts], ins[n_consts:n_consts + n_carry], ins[n_consts + n_carry:]
    carry, outs = loop_fixpoint(same_outputs, all, body, consts, carry, xs)
    return carry + outs[n_carry:]


def _while_same(eqn, ins):
    cond, body = open_jaxpr(eqn.params["cond_jaxpr"]), open_jaxpr(eqn.params["body_jaxpr"])
    nc, nb = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    cond_consts, body_consts, carry = ins[:nc], ins[nc:nc + nb], ins[nc + nb:]
    carry, _ = loop_fixpoint(same_outputs, all, body, body_consts, carry, [])
    if not all(same_outputs(cond, cond_consts + carry)):
        return [False] * len(carry)  # Replicas may run different numbers of iterations.
    return carry


def loop_fixpoint(analyse, merge, body, before, carry, after):
    """The states of a loop's carry, for a forward analysis ``analyse(jaxpr, input_states)``
    whose states only rise under ``merge(list_of_states)``: the carry entering an iteration is
    the merge of the one before it and the body's new carry (the body's first outputs), until
    that no longer changes. ``body`` takes ``before + carry + after``.

    Returns:
      ``(carry_states, body_output_states)``.
    """
    while True:
        outs = analyse(body, before + carry + after)
        merged = [merge([c, o]) for c, o in zip(carry, outs)]
        if merged == carry:
            return carry, outs
        carry = merged


def _cond_same(eqn, ins):
    index_same, operands = ins[0], ins[1:]
    branch_outs = [same_outputs(open_jaxpr(b), operands) for b in eqn.params["branches"]]
    return [index_same and all(outs) for outs in zip(*branch_outs)]


_CONSTANT, _PYTHON, _ARRAY = 0, 1, 2  # What an output is computed from, in increasing order.


def python_outputs(jaxpr, inputs_python):
    """Per output of ``jaxpr``: whether it is computed from Python-number arguments (and
    constants) only. In TF such a result is a Python value, the same object on every replica,
    which ``strategy.run`` returns as it is; jdist returns it as a plain array, not `Mirrored`.

    Args:
      jaxpr: a ``jax.extend.core.Jaxpr`` (the per-replica body).
      inputs_python: per input, whether it is a Python number argument.

    Returns:
      A list of bools, one per output.
    """
    states = propagate(jaxpr, [_PYTHON if p else _ARRAY for p in inputs_python],
                       _eqn_python, _CONSTANT)
    return [s == _PYTHON for s in states]


# What Python's operators on numbers compute (+, -, *, /, //, %, **, abs, round, comparisons,
# bitwise ones, and the primitives jnp builds them of): on Python numbers TF's result is a
# Python number too. Any other operation is a TF op (tf.reduce_sum, tf.exp, tf.cast), whose
# result is a tensor, each replica's own.
_PYTHON_OPERATORS = frozenset({
    "add", "sub", "mul", "div", "rem", "pow", "integer_pow", "neg", "abs", "sign", "floor",
    "ceil", "round", "max", "min", "select_n", "eq", "ne", "lt", "le", "gt", "ge", "and", "or",
    "not", "xor", "shift_left", "shift_right_arithmetic", "shift_right_logical", "copy",
    "copy_p",
    # Shapes alone: the (1, ...) block a replica's output leaves in (`spmd.trace`).
    "broadcast_in_dim", "reshape", "squeeze", "expand_dims"})


def _eqn_python(eqn, ins):
    inner = call_body(eqn)  # jnp wraps some operators in a jit (floor_divide, remainder).
    if inner is not None:
        return propagate(inner, ins, _eqn_python, _CONSTANT)
    name = eqn.primitive.name
    strong = name == "convert_element_type" and not eqn.params.get("weak_type")
    if name in _PYTHON_OPERATORS or (name == "convert_element_type" and not strong):
        return [max(ins, default=_CONSTANT)] * len(eqn.outvars)
    if max(ins, default=_CONSTANT) == _CONSTANT and not strong:
        return [_CONSTANT] * len(eqn.outvars)  # Literals and closed-over constants.
    return [_ARRAY] * len(eqn.outvars)


# Arithmetic whose float result is rounded. On Python numbers TF's operators compute it in
# Python's float64, TF's ops in float32; jdist's traced numbers compute it in float32 either way.
_ROUNDING = frozenset({
    "add", "sub", "mul", "div", "rem", "pow", "integer_pow", "square", "sqrt", "rsqrt", "cbrt",
    "exp", "exp2", "log", "log1p", "expm1", "logistic", "sin", "cos", "tan", "asin", "acos",
    "atan", "atan2", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh", "erf", "erfc",
    "erf_inv", "lgamma", "digamma"})


MERGE_SCOPE = "jdist_merge_call"  # The name scope of an even step's merge_call gathers.


def check_python_merges(jaxpr, inputs_python):
    """Raises `InvalidArgumentError` where a ``merge_call`` in ``jaxpr`` takes a value computed
    from Python-number arguments alone by Python's operators (``k * 2``). TF's replicas hold
    that Python number as one object and hand it to ``merge_fn`` as it is (its SUM raises, its
    MEAN is the number), where jdist's traced value would reach it per replica. A number
    passed on as it is, or made an array first (``jnp.int32(k)``), is TF's.

    Args:
      jaxpr: a ``jax.extend.core.Jaxpr`` (the per-replica body).
      inputs_python: per input, whether it is a Python number argument.
    """
    def check(eqn, ins, outs):
        name = eqn.primitive.name
        merged = name == "jdist_merge" or (
            name == "all_gather" and MERGE_SCOPE in str(eqn.source_info.name_stack))
        if merged and _PYTHON in ins:
            raise errors.InvalidArgumentError(
                "merge_call got a value computed from Python numbers passed to strategy.run "
                "by Python's operators (k * 2): TF computes it as a Python "
                "number, which every replica holds as one object, so its merge_fn gets that "
                "number (a SUM of it raises, a MEAN is the number), not one value per replica. "
                "Pass the number itself, compute it before strategy.run, or make it an array "
                "of its dtype (jnp.int32(k), jnp.float32(lr)), which TF holds per replica as "
                "jdist does.")
    _walk_python(jaxpr, inputs_python, check)


def check_python_float_arithmetic(jaxpr, inputs_python):
    """Raises `InvalidArgumentError` where ``jaxpr`` rounds a float computed from Python-number
    arguments (and constants) alone, before any array meets it.

    TF hands ``strategy.run``'s Python-number arguments to the replica function as they are:
    ``lr / 3`` there is Python's float64 division, ``tf.constant(lr) / 3`` float32's, and the
    trace cannot tell which the port wrote. A conversion to a strong dtype
    (``jnp.float32(lr)``) is TF's tensor and ends the check.

    Args:
      jaxpr: a ``jax.extend.core.Jaxpr`` (the per-replica body).
      inputs_python: per input, whether it is a Python number argument.
    """
    def check(eqn, ins, outs):
        inexact = any(jnp.issubdtype(v.aval.dtype, jnp.inexact) for v in eqn.outvars)
        if eqn.primitive.name in _ROUNDING and outs[0] == _PYTHON and inexact:
            raise errors.InvalidArgumentError(
                f"the replica function computes `{eqn.primitive.name}` on Python numbers "
                f"passed to strategy.run ({source_info_util.summarize(eqn.source_info)}): TF "
                "hands them over as Python numbers, so its operators compute that in Python's "
                "float64 (lr / 3) where jdist computes in float32, and the numbers differ. "
                "Compute it before strategy.run and pass the result, or make the number an "
                "array first (jnp.float32(lr)), which TF's ops compute in float32 as jdist does.")
    _walk_python(jaxpr, inputs_python, check)


def _walk_python(jaxpr, inputs_python, check):
    """`python_outputs`' dataflow over ``jaxpr``, into jitted calls, with ``check(eqn, ins,
    outs)`` called on each other equation (its operands' and results' states)."""
    def rule(eqn, ins):
        inner = call_body(eqn)
        if inner is not None:
            return propagate(inner, ins, rule, _CONSTANT)
        outs = _eqn_python(eqn, ins)  # A strong convert (jnp.float32(lr)) is TF's tensor.
        check(eqn, ins, outs)
        return outs
    propagate(jaxpr, [_PYTHON if p else _ARRAY for p in inputs_python], rule, _CONSTANT)
