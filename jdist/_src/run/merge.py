"""``merge_call`` inside a traced step: ``merge_fn`` runs SPMD on every replica's gathered values.

TF runs ``merge_fn`` once, on the host, between two halves of the replica function. A jdist step
is one compiled program, so ``merge_fn`` runs inside it on every device, on the same all-gathered
inputs (``docs/design.md``, section 6). Exact uneven steps merge differently (`uneven_trace`).
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


def merge_call(strategy, num_replicas, binding, merge_fn, args, kwargs):
    """``merge_fn(strategy, *args, **kwargs)`` inside a traced even step, as TF's merge_call.

    Every array argument is all-gathered into a `PerReplica` view that every device holds, so
    ``merge_fn`` runs SPMD on the same inputs in a cross-replica context; its result reaches
    each replica with `PerReplica` and `Mirrored` values unpacked (TF's ``select_replica``).

    Args:
      strategy: the strategy whose replica function is traced.
      num_replicas: its replica count.
      binding: the replica context's `context._Binding` (its axis name).
      merge_fn, args, kwargs: as given to ``ReplicaContext.merge_call``.

    Returns:
      This replica's view of ``merge_fn``'s result.
    """
    axis = binding.axis_name
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs), is_leaf=is_distributed)
    views = []
    for leaf in leaves:
        host_values.check_host_numbers(leaf)  # A host array the step closed over.
        if not isinstance(leaf, ARRAYS) or num_replicas == 1:
            views.append(leaf)  # Python objects pass as they are; so does one replica's value.
            continue
        # Every replica gets every replica's value: merge_fn runs SPMD on the same inputs.
        views.append(PerReplica._from_stacked(lax.all_gather(jnp.asarray(leaf), axis)))
    m_args, m_kwargs = jax.tree_util.tree_unflatten(tree, views)
    with context.cross_replica_scope(strategy, in_merge=True):
        result = merge_fn(strategy, *m_args, **m_kwargs)
    replica = lax.axis_index(axis)

    def unpack(x):  # Distributed results per replica, as TF's select_replica unpacks them.
        if isinstance(x, PerReplica):
            return x.stacked[replica]
        return x.value if isinstance(x, Mirrored) else x
    return jax.tree_util.tree_map(unpack, result, is_leaf=is_distributed)


def without_gradient(value):
    """``value``, the arguments of a ``merge_call`` on a strategy whose ``merge_fn`` TF runs
    outside the replica's gradient tape (``MirroredStrategy``'s merge_fn runs on another
    thread): TF's ``tape.gradient`` records nothing through it, and gives None where nothing
    else connects. ``jax.grad`` has no None, so a gradient that comes back through
    ``merge_call`` to these arguments raises `NoGradientError` instead of being one TF does
    not compute. A ``merge_call`` inside a differentiated function whose result the loss does
    not use (logging a loss) is fine: its gradient is a symbolic zero.

    Args:
      value: merge_call's ``(args, kwargs)``.

    Returns:
      ``value`` with its traced inexact arrays behind the gradient boundary.
    """
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
