"""``merge_call`` inside a traced step: ``merge_fn`` runs SPMD on every replica's gathered values.

TF runs ``merge_fn`` once on the host; a jdist step is one compiled program, so ``merge_fn`` runs
inside it on every device, on the same all-gathered inputs (``docs/design.md``, section 6).
Exact uneven steps merge in `uneven_trace`.
"""

import jax
from jax import lax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from jdist._src import context
from jdist._src import errors
from jdist._src import host_values
from jdist._src.values import ARRAYS
from jdist._src.values import Mirrored
from jdist._src.values import PerReplica
from jdist._src.values import is_distributed


def merge_call(strategy, num_replicas: int, binding, merge_fn, args: tuple, kwargs: dict):
    """``merge_fn(strategy, *args, **kwargs)`` inside a traced even step: its array arguments
    all-gathered into `PerReplica` views, its result as this replica sees it (TF's
    ``select_replica``). ``binding`` is the replica context's `context._Binding`."""
    axis = binding.axis_name
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs), is_leaf=is_distributed)
    views = []
    for leaf in leaves:
        host_values.check_host_numbers(leaf)  # A host array the step closed over.
        if not isinstance(leaf, ARRAYS) or num_replicas == 1:
            views.append(leaf)
            continue
        views.append(PerReplica._from_stacked(lax.all_gather(jnp.asarray(leaf), axis)))
    m_args, m_kwargs = jax.tree_util.tree_unflatten(tree, views)
    with context.cross_replica_scope(strategy, in_merge=True):
        result = merge_fn(strategy, *m_args, **m_kwargs)
    replica = lax.axis_index(axis)

    def unpack(x):
        if isinstance(x, PerReplica):
            return x.stacked[replica]
        return x.value if isinstance(x, Mirrored) else x
    return jax.tree_util.tree_map(unpack, result, is_leaf=is_distributed)


def without_gradient(value):
    """merge_call's ``(args, kwargs)`` behind a gradient boundary: TF runs ``merge_fn`` off the
    replica's tape (no gradient, None), and ``jax.grad`` has no None, so a gradient reaching
    them through the result raises `NoGradientError`; an unused result's (a symbolic zero)
    passes."""
    def leaf(x):
        if isinstance(x, jax.core.Tracer) and jnp.issubdtype(x.dtype, jnp.inexact):
            return _no_gradient(x)
        return x
    return jax.tree_util.tree_map(leaf, value, is_leaf=is_distributed)


@jax.custom_vjp
def _no_gradient(x):
    return x


def _no_gradient_forward(x):
    return x.value, None


def _no_gradient_backward(_, cotangent):
    if isinstance(cotangent, SymbolicZero):
        return (None,)
    raise errors.NoGradientError(
        "jax.grad (or another derivative) reached an argument of merge_call through its "
        "result. TF's MirroredStrategy runs merge_fn outside the replica's gradient tape, so "
        "no gradient flows through merge_call (tape.gradient gives None, or only the other "
        "paths' gradient). For TF's numbers pass jax.lax.stop_gradient(x) to merge_call; to "
        "differentiate through the combination use ReplicaContext.all_reduce or all_gather, "
        "whose gradients are TF's.")


_no_gradient.defvjp(_no_gradient_forward, _no_gradient_backward, symbolic_zeros=True)
