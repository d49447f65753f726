"""Training state that crosses between jdist and plain JAX: Mirrored pytrees, host copies, keys.

``strategy.run`` returns replica-equal values as `Mirrored` leaves; the JAX ecosystem (flax
serialization, orbax, optax, ``lax.scan`` carries) wants plain arrays. These functions convert
both ways without copying. A `PerReplica` leaf has no single value, so each refuses it.
"""

import functools
from typing import Any, Optional

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jdist._src import context
from jdist._src import errors
from jdist._src import host_values
from jdist._src.base import REPLICA_AXIS
from jdist._src.values import DistributedValues
from jdist._src.values import Mirrored
from jdist._src.values import is_distributed


def _reject_per_replica(leaf, caller):
    raise errors.UnsupportedValueError(
        f"{caller} got a {type(leaf).__name__} leaf: its replicas hold different values, so it "
        "has no single value. Combine it first with strategy.reduce(...) or "
        "strategy.gather(...), or return it all-reduced from the replica function.")


def _map_leaves(fn, tree, caller):
    """``fn`` over the leaves of ``tree`` (Mirrored ones included; PerReplica raises)."""
    def visit(leaf):
        if isinstance(leaf, DistributedValues) and not isinstance(leaf, Mirrored):
            _reject_per_replica(leaf, caller)
        return fn(leaf)
    return jax.tree_util.tree_map(visit, tree, is_leaf=is_distributed)


def unwrap_mirrored(tree: Any) -> Any:
    """Replaces every `Mirrored` leaf of ``tree`` by its replicated ``jax.Array`` (no copy), for
    code that expects plain arrays (flax serialization, orbax, a ``lax.scan`` carry).

    Args:
      tree: a pytree of `Mirrored` values, arrays or Python scalars.

    Returns:
      The same structure with plain arrays in place of the `Mirrored` leaves.

    Raises:
      UnsupportedValueError: a leaf is a `PerReplica` value (it has no single value).

    Example:
      >>> import jax.numpy as jnp, jdist
      >>> s = jdist.MirroredStrategy(["cpu:0", "cpu:1"])
      >>> params = s.run(lambda: {"w": jnp.ones(2)})
      >>> type(params["w"]).__name__, type(jdist.unwrap_mirrored(params)["w"]).__name__
      ('Mirrored', 'ArrayImpl')
    """
    return _map_leaves(lambda x: x.value if isinstance(x, Mirrored) else x, tree,
                       "unwrap_mirrored")


def replicated_sharding(strategy: Optional[Any] = None) -> NamedSharding:
    """The sharding of a `Mirrored` value's array: a full copy on every replica's device.

    Args:
      strategy: the strategy; default: the current one (`get_strategy`).

    Example:
      >>> import jdist
      >>> sharding = jdist.replicated_sharding(jdist.MirroredStrategy(["cpu:0", "cpu:1"]))
      >>> sharding.is_fully_replicated, len(sharding.device_set)
      (True, 2)
    """
    strategy = context.get_strategy() if strategy is None else strategy
    return _replicated_sharding(tuple(strategy.extended.replica_devices))


@functools.lru_cache(maxsize=None)
def _replicated_sharding(devices):
    # Equal to the strategy's own: a mesh equals any other over its devices and axis name.
    return NamedSharding(Mesh(np.array(devices), (REPLICA_AXIS,)), P())


def mirror(tree: Any, strategy: Optional[Any] = None) -> Any:
    """Places every leaf of ``tree`` as `Mirrored` state on ``strategy``'s replicas: one
    replicated array each (`replicated_sharding`), as ``run`` returns it; placed leaves are
    not copied.

    Args:
      tree: a pytree of arrays, Python scalars or `Mirrored` values (parameters, optimizer state).
      strategy: the strategy to place on; default: the current one (`get_strategy`).

    Raises:
      UnsupportedValueError: a leaf is a `PerReplica` value.

    Example:
      >>> import numpy as np, jdist
      >>> s = jdist.MirroredStrategy(["cpu:0", "cpu:1"])
      >>> state = jdist.mirror({"w": np.ones(3, np.float32)}, s)
      >>> state["w"].num_replicas, state["w"].value.sharding.is_fully_replicated
      (2, True)
    """
    strategy = context.get_strategy() if strategy is None else strategy
    sharding = replicated_sharding(strategy)
    n = strategy.num_replicas_in_sync

    def place(leaf):
        array = leaf.value if isinstance(leaf, Mirrored) else leaf
        host_values.check_array(array, "mirror")
        host_values.check_host_numbers(array)
        return Mirrored._from_value(jax.device_put(array, sharding), n)
    return _map_leaves(place, tree, "mirror")


def _host_copy(leaf):
    array = leaf.value if isinstance(leaf, Mirrored) else leaf
    if isinstance(array, jax.Array):
        if not array.is_fully_replicated:
            raise errors.UnsupportedValueError(
                f"to_host got an array sharded as {array.sharding}; only replicated state has "
                "its whole value on one device. Use strategy.gather for sharded values.")
        array = array.addressable_shards[0].data  # This process's first copy: no gather.
    return np.asarray(array)


def to_host(tree: Any) -> Any:
    """NumPy copies of replicated state, each read from one device's copy (no gather).

    Args:
      tree: a pytree of `Mirrored` values, replicated arrays, NumPy arrays or scalars.

    Raises:
      UnsupportedValueError: a leaf is a `PerReplica` value or an array that is not fully
        replicated (no single device holds its whole value).

    Example:
      >>> import jax.numpy as jnp, jdist
      >>> s = jdist.MirroredStrategy(["cpu:0", "cpu:1"])
      >>> jdist.to_host(s.run(lambda: {"b": jnp.arange(2.0)}))
      {'b': array([0., 1.], dtype=float32)}
    """
    return _map_leaves(_host_copy, tree, "to_host")


def replica_key(key: jax.Array) -> jax.Array:
    """A PRNG key for this replica: ``key`` folded with the replica id (``jax.random.fold_in``),
    reproducible and different per replica. For a key equal on every replica, use ``key``.

    Args:
      key: a PRNG key (``jax.random.key`` or a raw ``PRNGKey``).

    Raises:
      WrongContextError: called in a cross-replica context (there is no current replica).

    Example:
      >>> import jax, jdist
      >>> s = jdist.MirroredStrategy(["cpu:0", "cpu:1"])
      >>> noise = s.run(lambda k: jax.random.uniform(jdist.replica_key(k)),
      ...               args=(jax.random.key(0),))
      >>> a, b = s.experimental_local_results(noise)
      >>> float(a) != float(b)
      True
    """
    ctx = context.get_replica_context()
    if ctx is None:
        raise errors.WrongContextError(
            "replica_key needs a replica context: call it inside the function given to "
            "strategy.run (in the cross-replica context there is no current replica).")
    if not (isinstance(key, jax.Array) or np.ndim(key) == 1):
        raise errors.UnsupportedValueError(
            f"replica_key expects a JAX PRNG key (jax.random.key(seed)), got {type(key).__name__}.")
    return jax.random.fold_in(key, ctx.replica_id_in_sync_group)
