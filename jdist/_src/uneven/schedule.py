"""Fewer cuts in an exact uneven step: independent all-reduces grouped into one collective.

`plan` cuts a step at every collective, each cut a program and a wait, and ``all_reduce`` of
a gradient tree binds one ``psum`` per leaf. Here the body's equations are scheduled in rounds
(each as early as its operands allow) and one round's ``psum``/``pmax``/``pmin`` of the same
parameters become one `collectives_p` equation, each operand reduced as before (`bind_cut`).
Effects keep their order; every other collective (``merge_call``, ``all_gather``...) is a
barrier. ``benchmarks/bench_uneven.py``'s partial step goes from 7 cuts to 1 (1.6-2x faster).
"""

from typing import Callable

from jax.extend import core

# Element-wise collectives, grouped when one round has several with the same parameters.
_GROUPED = frozenset({"psum", "pmax", "pmin"})

# Several collectives as one cut: ``members`` holds each one's (primitive, parameters, number of
# operands). Only `bind_cut` binds it.
collectives_p = core.Primitive("jdist_collectives")
collectives_p.multiple_results = True


def bind_cut(eqn: core.JaxprEqn, operands: list) -> list:
    """The outputs of the collective equation ``eqn`` on ``operands`` (a group's, each member's)."""
    if eqn.primitive is not collectives_p:
        outs = eqn.primitive.bind(*operands, **eqn.params)
        return list(outs) if eqn.primitive.multiple_results else [outs]
    outs, start = [], 0
    for primitive, params, count in eqn.params["members"]:
        out = primitive.bind(*operands[start:start + count], **dict(params))
        outs += list(out) if primitive.multiple_results else [out]
        start += count
    return outs


def grouped_collectives(jaxpr: core.Jaxpr, is_cut: Callable) -> core.Jaxpr:
    """``jaxpr`` (a replica body; ``is_cut``: its collectives) with its equations in rounds and
    each round's like all-reduces as one: the same outputs from the same inputs."""
    by_round: dict = {}  # Round -> (its other equations, its collectives), in program order.
    for eqn, (at, cut) in zip(jaxpr.eqns, _rounds(jaxpr, is_cut)):
        by_round.setdefault(at, ([], []))[cut].append(eqn)
    eqns = []
    for at in sorted(by_round):
        others, cuts = by_round[at]
        eqns += others + _grouped(cuts)
    return jaxpr.replace(eqns=eqns)


def _rounds(jaxpr, is_cut):
    """Per equation, ``(round, is_cut)``: the round its operands exist in (a collective's
    outputs exist from the next one)."""
    ready, out = {}, []
    barrier = effects = 0  # The first round later collectives / effects may take.
    after_cuts = 0  # The round after every collective so far.
    for eqn in jaxpr.eqns:
        r = max([ready.get(v, 0) for v in eqn.invars if isinstance(v, core.Var)], default=0)
        cut = bool(is_cut(eqn))
        ordered = _orders(eqn)
        if ordered:
            r = max(r, effects)
        if cut:
            r = max(r, barrier)
            if eqn.primitive.name not in _GROUPED:  # A barrier: after every collective so far.
                r = max(r, after_cuts)
                barrier = r + 1
            after_cuts = max(after_cuts, r + 1)
        if ordered:
            effects = r + cut
        ready.update((v, r + cut) for v in eqn.outvars)
        out.append((r, cut))
    return out


def _orders(eqn):
    """Whether ``eqn`` has effects whose order matters (not a collective's named-axis one)."""
    return any(type(e).__name__ != "NamedAxisEffect" for e in eqn.effects)


def _grouped(cuts):
    """One round's collectives, like element-wise ones merged (in the order of their first)."""
    groups = {}
    for eqn in cuts:
        key = (eqn.primitive, repr(sorted(eqn.params.items())))
        if eqn.primitive.name not in _GROUPED or any(v.aval.size == 0 for v in eqn.invars):
            key = id(eqn)  # Alone: a zero-size operand's collective is skipped, not run.
        groups.setdefault(key, []).append(eqn)
    return [group[0] if len(group) == 1 else group[0].replace(
        primitive=collectives_p,
        params={"members": tuple((e.primitive, tuple(sorted(e.params.items())), len(e.invars))
                                 for e in group)},
        invars=[v for e in group for v in e.invars],
        outvars=[v for e in group for v in e.outvars]) for group in groups.values()]
