"""Several steps' batches as one value: each replica's K batches stacked on a leading step axis.

For K steps in one program (TF's ``steps_per_execution``), a ``lax.scan`` over steps runs
inside the replica function. A `PerReplica`'s stacked array has the replicas first, so a scan
outside ``run`` would cut across replicas; here each replica gets its own ``(K, batch, ...)``
block, still sharded over the replicas.
"""

import functools

import jax
import jax.numpy as jnp

from jdist._src import errors
from jdist._src.values import Mirrored
from jdist._src.values import PerReplica
from jdist._src.values import is_distributed


def signature(element):
    """What the batches of one group share: structure, shapes and dtypes."""
    leaves, tree = jax.tree_util.tree_flatten(element, is_leaf=is_distributed)
    return tree, tuple(_leaf_signature(leaf) for leaf in leaves)


def _leaf_signature(leaf):
    if isinstance(leaf, PerReplica) and leaf.ragged:
        return "ragged", tuple((tuple(c.shape), c.dtype) for c in leaf.values)
    return tuple((jnp.shape(a), jnp.result_type(a)) for a in jax.tree_util.tree_leaves(leaf))


def stack_steps(elements):
    """One element, each replica's batches of ``elements`` (one `signature`) stacked, steps first."""
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
    # Compiled: the stack keeps its inputs' sharding (replicas on axis 0), with no transfer.
    return jax.jit(lambda *xs: jnp.stack(xs, axis=axis))
