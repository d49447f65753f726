"""Replicated outputs of a traced replica program, set without tracing it again.

`spmd` traces a replica function once, as ``jit(shard_map(body, out_specs=P(axis)))`` whose body
returns every output as a ``(1, ...)`` block: which outputs are equal on every replica is only
known after the trace (`invariance`). Those then leave the program as the value itself
(``out_specs=P()``), the rest as the stacked ``(num_replicas, ...)`` array.

Re-binding ``shard_map`` with new ``out_specs`` would evaluate the whole body again, and a second
``shard_map`` taking the blocks apart adds two array operations per output for XLA to compile
(with 400 parameters, 11% more operations). `unblock_replicated` instead edits the traced
program: each replicated output's block is replaced by the value it was made from, and its
``out_specs`` entry by ``P()``. It uses JAX's jaxpr types (``jax.extend.core``), checked against
the form `spmd.ReplicatedRunner.trace` produces; any other form gives None and the caller keeps
the second ``shard_map``.
"""

from typing import Callable, Optional, Sequence

import jax
from jax.extend import core
from jax.sharding import PartitionSpec as P

from jdist._src import jax_internals


def staged_program(staged: core.ClosedJaxpr, replicated: Sequence[bool], mesh: jax.sharding.Mesh,
                   axis: str) -> Callable:
    """The traced program as a function, called as it was staged (a jit equation holding the
    traced shard_map), so its body is neither traced nor evaluated again.

    Args:
      staged: as `unblock_replicated` takes it.
      replicated: per output, whether every replica computes the same value.
      mesh, axis: the replica mesh and its axis name.

    Returns:
      A function of the program's arguments giving a tuple: each replicated output as the value,
      the others stacked ``(num_replicas, ...)``.
    """
    edited = unblock_replicated(staged, replicated)
    if edited is not None:
        edited_fn = core.jaxpr_as_fun(edited)
        return lambda *arrays: tuple(edited_fn(*arrays))
    # A form the edit does not know: a second shard_map takes the replicated blocks apart.
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
    """``staged`` with output ``i`` returned unblocked and replicated where ``replicated[i]``.

    Args:
      staged: ``make_jaxpr(jit(shard_map(body, out_specs=P(axis))))``, every output of ``body``
        a ``broadcast_in_dim`` of a value to a leading axis of size 1.
      replicated: per output, whether every replica computes the same value.

    Returns:
      The edited closed jaxpr (same inputs, the replicated outputs without their leading axis),
      or None where ``staged`` is not of that form.
    """
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
    """The one equation of ``closed`` when its outputs are exactly that equation's, else None."""
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
