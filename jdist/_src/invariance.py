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

from jax.extend import core


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

