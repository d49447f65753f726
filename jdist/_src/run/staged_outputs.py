"""Replicated outputs of a traced replica program, set without tracing it again.

`spmd` traces ``jit(shard_map(body, out_specs=P(axis)))`` with every output a ``(1, ...)``
block; which outputs are equal on every replica is known only afterwards (`invariance`).
Re-binding ``shard_map`` would evaluate the body again, and a second ``shard_map`` adds
operations per output for XLA; so `unblock_replicated` edits the jaxpr: a replicated output's
block becomes its value, its ``out_specs`` entry ``P()``. A form it does not know falls back to
the second ``shard_map``.
"""

from typing import Callable, Optional, Sequence

import jax
from jax.extend import core
from jax.sharding import PartitionSpec as P

from jdist._src import jax_internals


def staged_program(staged: core.ClosedJaxpr, replicated: Sequence[bool], mesh: jax.sharding.Mesh,
                   axis: str) -> Callable:
    """The program as a function of its arguments, its body not traced again: a tuple with
    each ``replicated`` output as the value, the others stacked ``(num_replicas, ...)``."""
    edited = unblock_replicated(staged, replicated)
    if edited is not None:
        edited_fn = core.jaxpr_as_fun(edited)
        return lambda *arrays: tuple(edited_fn(*arrays))
    staged_fn = core.jaxpr_as_fun(staged)
    unblock = jax.shard_map(
        lambda *outs: tuple(o[0] if r else o for o, r in zip(outs, replicated)), mesh=mesh,
        in_specs=P(axis), out_specs=tuple(P() if r else P(axis) for r in replicated),
        check_vma=False)

    def program(*arrays):
        outs = staged_fn(*arrays)
        return tuple(unblock(*outs)) if outs else ()
    return program


def unblock_replicated(staged: core.ClosedJaxpr,
                       replicated: Sequence[bool]) -> Optional[core.ClosedJaxpr]:
    """``staged`` (``make_jaxpr(jit(shard_map(body, out_specs=P(axis))))``, each output a
    ``(1, ...)`` ``broadcast_in_dim``) with output ``i`` unblocked and replicated where
    ``replicated[i]``; None where ``staged`` is not of that form."""
    call, mapped = _single_eqn(staged), None
    if call is not None:
        mapped = _single_eqn(call.params["jaxpr"])
    if mapped is None or mapped.primitive is not jax_internals.shard_map_p:
        return None
    body = mapped.params["jaxpr"]
    outvars, specs = list(body.outvars), list(mapped.params["out_specs"])
    made_by = {v: eqn for eqn in body.eqns for v in eqn.outvars}
    for i, block in enumerate(body.outvars):
        if replicated[i]:
            value = _blocked_value(made_by.get(block), block)
            if value is None:
                return None
            outvars[i], specs[i] = value, P()
    avals = [jax_internals.unshard_aval(mapped.params["mesh"], False, spec, v.aval)
             for spec, v in zip(specs, outvars)]
    mapped_out = [core.Var(aval) for aval in avals]
    mapped = mapped.replace(outvars=mapped_out, params={
        **mapped.params, "jaxpr": body.replace(outvars=outvars), "out_specs": tuple(specs)})
    inner = call.params["jaxpr"]
    inner = core.ClosedJaxpr(inner.jaxpr.replace(eqns=[mapped], outvars=mapped_out), inner.consts)
    call_out = [core.Var(aval) for aval in avals]
    call = call.replace(outvars=call_out, params={**call.params, "jaxpr": inner})
    return core.ClosedJaxpr(staged.jaxpr.replace(eqns=[call], outvars=call_out), staged.consts)


def _single_eqn(closed):
    """The one equation of ``closed`` whose outputs are the jaxpr's, else None."""
    eqns = closed.jaxpr.eqns
    if len(eqns) != 1 or list(closed.jaxpr.outvars) != list(eqns[0].outvars):
        return None
    return eqns[0]


def _blocked_value(eqn, block):
    """The value ``block`` is a ``(1, ...)`` broadcast of, or None if ``eqn`` is not that."""
    if eqn is None or eqn.primitive is not jax.lax.broadcast_in_dim_p:
        return None
    value = eqn.invars[0]
    rank = len(value.aval.shape)
    if (tuple(block.aval.shape) != (1,) + tuple(value.aval.shape)
            or tuple(eqn.params["broadcast_dimensions"]) != tuple(range(1, rank + 1))):
        return None
    return value
