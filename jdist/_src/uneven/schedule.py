"""Fewer cuts in an exact uneven step: independent all-reduces grouped into one collective.

An exact step on a partial batch runs its body in pieces cut at each collective
(`jdist._src.uneven.plan`): every piece is one dispatch per replica and every cut one collective
program, with a wait before it. ``all_reduce`` of a gradient tree binds one ``psum`` per leaf, so
a model of L leaves cut its step L times although no leaf's sum needs another's. Here the body's
equations are scheduled in rounds: a collective runs in the first round after the one that
computed its operands, every other equation as early as its operands allow, and the ``psum``
(``pmax``, ``pmin``) equations of one round with the same parameters become one equation with
all their operands (`collectives_p`, which binds each of them in the one collective program,
`bind_cut`): each operand is reduced across the replicas as its own equation reduced it. The MLP
step of ``benchmarks/bench_uneven.py`` goes from 7 cuts to 1.

What keeps its place: equations with effects stay in their order, and every other collective
(``merge_call``, an ``all_gather``, a ``ppermute``) is a barrier, run after every collective
before it and before every collective after it, as written.
"""

from typing import Callable

from jax.extend import core

# Element-wise collectives, grouped when one round has several with the same parameters.
_GROUPED = frozenset({"psum", "pmax", "pmin"})

# Several collectives as one cut: ``members`` holds each one's (primitive, parameters, number of
# operands). Only `bind_cut` binds it, inside a collective program; no program traces it.
collectives_p = core.Primitive("jdist_collectives")
collectives_p.multiple_results = True


def bind_cut(eqn, operands):
    """The outputs of the collective equation ``eqn`` on ``operands``, as a list (inside a
    program over the replica mesh; a `collectives_p` group binds each member on its own)."""
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
    """``jaxpr`` with its equations in rounds and each round's like all-reduces as one.

    Args:
      jaxpr: a replica body whose collectives are top-level equations.
      is_cut: whether an equation is a collective (a cut of the exact step).

    Returns:
      A jaxpr computing the same outputs from the same inputs.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax import lax
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.sharding.Mesh(jax.devices()[:1], ("r",))
      >>> body = lambda a, b: (lax.psum(a * 2, "r"), lax.psum(jnp.sin(b), "r"))
      >>> f = jax.shard_map(body, mesh=mesh, in_specs=P("r"), out_specs=P("r"),
      ...                   check_vma=False)
      >>> inner = jax.make_jaxpr(f)(jnp.ones(1), jnp.ones(1)).jaxpr.eqns[0].params["jaxpr"]
      >>> grouped = grouped_collectives(inner, lambda e: e.primitive.name == "psum")
      >>> [e.primitive.name for e in grouped.eqns]
      ['mul', 'sin', 'jdist_collectives']
    """
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
    """Whether ``eqn`` has effects whose order matters (a callback, I/O): the named-axis effect
    that every collective carries only says which mesh axis it needs."""
    return any(type(e).__name__ != "NamedAxisEffect" for e in eqn.effects)


def _grouped(cuts):
    """One round's collectives: like element-wise ones (primitive and parameters) merged, in
    the order of their first, each other one as it is."""
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
