"""The primitive of a ``merge_call`` inside one replica's trace of an uneven step.

`jdist._src.uneven.trace` binds it where a replica's function calls ``merge_call``: the trace is
cut there, and `jdist._src.uneven.plan` runs the merge across the replicas between the pieces. Its
equation carries what the analyses of the trace read of the merge: which outputs every replica
receives alike (``out_same``), whether it is an all_gather (``gathers``), and ``merge_fn``'s own
program (``merge_body``, for the int64 bounds).
"""

import dataclasses
import functools
import operator
from typing import Any

import jax.numpy as jnp
from jax.extend import core
from jax.interpreters import ad

# Its outputs come from the resolved merge (`uneven_trace.Merge`).
merge_p = core.Primitive("jdist_merge")
merge_p.multiple_results = True
# ``merge_body``: the merge's `MergeBody` (what the int64 analysis reads of merge_fn).
merge_p.def_abstract_eval(
    lambda *operands, index, out_avals, out_same, gathers, merge_body: list(out_avals))


@dataclasses.dataclass(frozen=True, eq=False)
class MergeBody:
    """A merge_call's traced ``merge_fn`` over every replica's operands (``jaxpr``: replica by
    replica, ``count`` operands each), and per replica the indices of its outputs among the
    jaxpr's (``outputs``)."""
    jaxpr: Any
    count: int
    outputs: tuple

    def __repr__(self):  # Part of an equation's description (`output_forms`): by identity.
        return f"MergeBody({id(self):x})"


def _merge_jvp(primals, tangents, **params):
    """No gradient flows through a merge_call (TF runs merge_fn outside the replica's tape).
    Its tangents are zeros tied to the arguments', so a gradient that comes back through the
    result reaches `merge.without_gradient`'s check, which raises; an unused result's gradient
    is a symbolic zero and passes."""
    outs = merge_p.bind(*primals, **params)
    tied = [jnp.sum(t) * 0 for t in tangents if not isinstance(t, ad.Zero)]
    zero = functools.reduce(operator.add, tied)
    return outs, [jnp.broadcast_to(zero, a.shape).astype(a.dtype)
                  if jnp.issubdtype(a.dtype, jnp.inexact) else ad.Zero(a.to_tangent_aval())
                  for a in params["out_avals"]]


ad.primitive_jvps[merge_p] = _merge_jvp
