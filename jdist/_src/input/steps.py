"""Several steps' batches as one value: each replica's K batches stacked on a leading step axis.

A loop that runs K steps in one program (TF's ``steps_per_execution``; in TF, ``for _ in
tf.range(K): strategy.run(step, args=(next(iterator),))`` inside a ``tf.function``) scans over
steps inside the replica function. A `PerReplica`'s stacked array has the replicas first, so a
``lax.scan`` over it outside ``run`` would cut across replicas (`values._check_not_sliced`
refuses that); here each replica gets its own ``(K, batch, ...)`` block instead, still sharded
over the replicas, and ``strategy.run(lambda s, xs: lax.scan(step, s, xs), args=(s, xs))``
scans the steps.
"""

import functools

import jax
import jax.numpy as jnp

from jdist._src import errors
from jdist._src.values import Mirrored
from jdist._src.values import PerReplica
from jdist._src.values import is_distributed


def signature(element):
    """What must agree between the batches of one group: structure, shapes and dtypes (the
    last partial batch has other per-replica shapes, so it starts a group of its own)."""
    leaves, tree = jax.tree_util.tree_flatten(element, is_leaf=is_distributed)
    return tree, tuple(_leaf_signature(leaf) for leaf in leaves)


def _leaf_signature(leaf):
    if isinstance(leaf, PerReplica) and leaf.ragged:
        return "ragged", tuple((tuple(c.shape), c.dtype) for c in leaf.values)
    return tuple((jnp.shape(a), jnp.result_type(a)) for a in jax.tree_util.tree_leaves(leaf))


def stack_steps(elements):
    """One element whose every replica holds its ``len(elements)`` batches stacked, step
    axis first (``elements`` share one `signature`)."""
    return jax.tree_util.tree_map(lambda *leaves: _stack_leaf(leaves), *elements,
                                  is_leaf=is_distributed)


def _stack_leaf(leaves):
    first = leaves[0]
    if isinstance(first, PerReplica) and first.ragged:
        if any(isinstance(c, jax.ShapeDtypeStruct) for c in first._components):
            raise errors.UnevenValuesError(
                "get_next_steps cannot stack a partial batch spread over several workers; use "
                "drop_remainder=True, or run the last batch with next(iterator).")
        return PerReplica._from_components(
            [jnp.stack(parts) for parts in zip(*(leaf.values for leaf in leaves))])
    if isinstance(first, PerReplica):
        return PerReplica._from_stacked(_stack_axis(1)(*(leaf.stacked for leaf in leaves)))
    if isinstance(first, Mirrored):
        return Mirrored._from_value(_stack_axis(0)(*(leaf.value for leaf in leaves)),
                                    first.num_replicas)
    return _stack_axis(0)(*leaves)  # One replica's plain batches.


@functools.lru_cache(maxsize=None)
def _stack_axis(axis):
    # Compiled: the stacked array keeps its inputs' sharding (replicas on axis 0), one
    # transfer-free program per shape, as the step itself.
    return jax.jit(lambda *xs: jnp.stack(xs, axis=axis))
