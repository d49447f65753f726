"""The primitive of a ``merge_call`` in one replica's trace of an uneven step.

`trace` binds it and `plan` cuts the trace there. Its parameters are what analyses of the
trace read: ``out_same`` (outputs every replica receives alike), ``gathers`` (an all_gather),
``merge_body`` (``merge_fn``'s program).
"""

import dataclasses
import functools
import operator
from typing import Any

import jax.numpy as jnp
from jax.extend import core
from jax.interpreters import ad

merge_p = core.Primitive("jdist_merge")
merge_p.multiple_results = True
merge_p.def_abstract_eval(
    lambda *operands, index, out_avals, out_same, gathers, merge_body: list(out_avals))


@dataclasses.dataclass(frozen=True, eq=False)
class MergeBody:
    """A merge_call's traced ``merge_fn`` (``count`` operands per replica, in replica order) and
    per replica the indices of its outputs (``outputs``)."""
    jaxpr: Any
    count: int
    outputs: tuple

    def __repr__(self):  # Part of an equation's description (`output_forms`): by identity.
        return f"MergeBody({id(self):x})"


def _merge_jvp(primals, tangents, **params):
    """Zero tangents tied to the arguments', so a gradient back through the result reaches
    `merge.without_gradient`'s check (TF: no gradient through merge_call)."""
    outs = merge_p.bind(*primals, **params)
    tied = [jnp.sum(t) * 0 for t in tangents if not isinstance(t, ad.Zero)]
    zero = functools.reduce(operator.add, tied)
    return outs, [jnp.broadcast_to(zero, a.shape).astype(a.dtype)
                  if jnp.issubdtype(a.dtype, jnp.inexact) else ad.Zero(a.to_tangent_aval())
                  for a in params["out_avals"]]


ad.primitive_jvps[merge_p] = _merge_jvp
