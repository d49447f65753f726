"""Which outputs of a replica function are provably equal on every replica.

``strategy.run`` returns `Mirrored` for those, `PerReplica` for the rest. The answer is a
dataflow analysis of the ``shard_map`` body, not shard_map's varying-axes types, because jdist
compiles with ``check_vma=False``: under ``check_vma=True`` ``jax.grad`` of a replicated input
already sums the replicas' gradients, so a ported ``all_reduce("mean", grads)`` would be off by
``num_replicas`` (``docs/design.md``). A value is *same* when computed only from replicated
inputs, constants and collectives whose result every replica shares; sub-programs are followed
(loop carries to a fixpoint), and an unknown one counts as *differ*: the answer errs towards
`PerReplica`, never towards a wrong `Mirrored`.
"""

from jax.extend import core


# Collectives whose result is the same on every replica ("jdist_collectives": `uneven_schedule`).
_SAME_COLLECTIVES = frozenset({"psum", "psum_invariant", "pmax", "pmin", "pmean", "all_gather",
                               "all_gather_invariant", "pbroadcast", "axis_size",
                               "jdist_collectives"})
# Primitives whose result can differ between replicas whatever their inputs.
_DIFFERING = frozenset({"axis_index", "ppermute", "all_to_all", "psum_scatter", "reduce_scatter",
                        "pgather", "pure_callback", "io_callback", "debug_callback", "shard_map"})
# Call-like primitives: their sub-program takes the operands one to one.
_CALL_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def call_body(eqn: core.JaxprEqn) -> core.Jaxpr | None:
    """The sub-program of a call-like equation (``jit``, ``custom_jvp_call``, ``checkpoint``...)
    that takes the equation's operands one to one, or None."""
    for key in _CALL_PARAMS:
        sub = eqn.params.get(key)
        if isinstance(sub, (core.Jaxpr, core.ClosedJaxpr)):
            inner = open_jaxpr(sub)
            if len(inner.invars) == len(eqn.invars):
                return inner
    return None


def same_outputs(jaxpr: core.Jaxpr, inputs_same: list) -> list:
    """Per output of ``jaxpr``, whether it is equal on every replica (given the inputs')."""
    env = dict(zip(jaxpr.invars, inputs_same))

    def read(v):
        return True if isinstance(v, core.Literal) else env.get(v, True)  # Constants: same.
    for eqn in jaxpr.eqns:
        env.update(zip(eqn.outvars, _eqn_same(eqn, [read(v) for v in eqn.invars])))
    return [read(v) for v in jaxpr.outvars]


def open_jaxpr(closed_or_open) -> core.Jaxpr:
    """The ``Jaxpr`` of a ``ClosedJaxpr``, or the ``Jaxpr`` itself."""
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


def scan_counts(params: dict) -> tuple:
    """A ``scan``'s numbers of constants and carries: ``num_consts`` and ``num_carry`` (JAX
    0.10), or the sizes of the first two groups of its ``ft_in`` (0.11)."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()  # Flat trees: one value per operand.
    return len(list(consts.vals)), len(list(carry.vals))


def _scan_same(eqn, ins):
    body = open_jaxpr(eqn.params["jaxpr"])
    n_consts, n_carry = scan_counts(eqn.params)
    consts, carry, xs = ins[:n_consts], ins[n_consts:n_consts + n_carry], ins[n_consts + n_carry:]
    carry, outs = loop_fixpoint(body, consts, carry, xs)
    return carry + outs[n_carry:]


def _while_same(eqn, ins):
    cond, body = open_jaxpr(eqn.params["cond_jaxpr"]), open_jaxpr(eqn.params["body_jaxpr"])
    nc, nb = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    cond_consts, body_consts, carry = ins[:nc], ins[nc:nc + nb], ins[nc + nb:]
    carry, _ = loop_fixpoint(body, body_consts, carry, [])
    if not all(same_outputs(cond, cond_consts + carry)):
        return [False] * len(carry)  # Replicas may run different numbers of iterations.
    return carry


def loop_fixpoint(body: core.Jaxpr, before: list, carry: list, after: list) -> tuple:
    """``(carry, body outputs)`` of a loop whose ``body`` takes ``before + carry + after``:
    a carry stays *same* only while every iteration keeps it so."""
    while True:
        outs = same_outputs(body, before + carry + after)
        merged = [c and o for c, o in zip(carry, outs)]
        if merged == carry:
            return carry, outs
        carry = merged


def _cond_same(eqn, ins):
    index_same, operands = ins[0], ins[1:]
    branch_outs = [same_outputs(open_jaxpr(b), operands) for b in eqn.params["branches"]]
    return [index_same and all(outs) for outs in zip(*branch_outs)]
