"""Host values given to ``strategy.run`` must be equal on every worker: checked once per program.

Each worker places its own copy of a host argument, so copies that differ would silently give
each worker its own numbers (or programs that hang in a collective). When ``run`` compiles a
program, the workers exchange a cheap description of each argument leaf (`describe`) and all
raise the same error if they differ. Global arrays agree by construction.
"""

import enum
import hashlib
from typing import Any, Sequence

import jax
import numpy as np

from jdist._src import errors
from jdist._src.multi_worker.runtime import Agreement
from jdist._src.multi_worker.runtime import Cluster
from jdist._src.values import DistributedValues
from jdist._src.values import Mirrored
from jdist._src.values import PerReplica

HASHED_BYTES = 1 << 20  # Host arrays up to 1 MiB are compared by value, larger ones by shape.
_SIMPLE = (bool, int, float, complex, str, bytes, type(None), enum.Enum)


def describe(leaf: Any) -> list:
    """A JSON-able description of an argument leaf of ``run``: kind, shape, dtype, a hash of
    host arrays up to `HASHED_BYTES`, the value of simple constants."""
    if isinstance(leaf, Mirrored):
        return ["Mirrored", list(leaf.shape), str(leaf.dtype)]
    if isinstance(leaf, PerReplica):
        if leaf.ragged:
            return ["PerReplica", "ragged", str(leaf.values[0].dtype)]
        return ["PerReplica", list(leaf.stacked.shape), str(leaf.stacked.dtype)]
    if isinstance(leaf, DistributedValues):
        return [type(leaf).__name__]
    if isinstance(leaf, jax.core.Tracer):
        return ["traced", list(leaf.shape), str(leaf.dtype)]
    if isinstance(leaf, jax.Array):
        if not leaf.is_fully_addressable:
            return ["global", list(leaf.shape), str(leaf.dtype)]
        return ["array", list(leaf.shape), str(leaf.dtype), _digest(leaf)]
    if isinstance(leaf, (np.ndarray, np.generic)):
        return ["numpy", list(leaf.shape), str(leaf.dtype), _digest(leaf)]
    if isinstance(leaf, _SIMPLE):
        return [type(leaf).__name__, repr(leaf)]
    return [f"{type(leaf).__module__}.{type(leaf).__qualname__}"]


def _digest(array):
    """A hash of the array's bytes when it is small, else None (compared by shape only)."""
    if array.size * array.dtype.itemsize > HASHED_BYTES:
        return None
    data = np.ascontiguousarray(np.asarray(array))
    return hashlib.blake2b(data.tobytes(), digest_size=16).hexdigest()


def check_equal(agreement: Agreement, cluster: Cluster, in_tree: Any,
                leaves: Sequence) -> None:
    """Raises on every worker unless every worker passes the same arguments to ``run``.

    ``leaves`` flatten ``(args, kwargs)`` by ``in_tree``, `DistributedValues` kept whole.

    Raises:
      InvalidArgumentError: an argument differs between workers (named, with each worker's).
      UnavailableError: a peer did not reach the check within the timeout.
    """
    mine = [describe(leaf) for leaf in leaves]
    everyone = agreement.exchange("strategy.run arguments", mine)
    if all(theirs == everyone[0] for theirs in everyone):
        return
    if len({len(theirs) for theirs in everyone}) != 1:
        raise errors.InvalidArgumentError(
            "strategy.run got arguments of different structures on different workers ("
            + "; ".join(f"{cluster.name(w)}: {len(d)} leaves" for w, d in enumerate(everyone))
            + "); every worker must call run with the same arguments.")
    i = next(i for i in range(len(mine)) if len({repr(d[i]) for d in everyone}) != 1)
    raise errors.InvalidArgumentError(
        f"strategy.run got {_path(in_tree, len(leaves), i)} with different values on different "
        "workers (" + "; ".join(f"{cluster.name(w)}: {_shown(d[i])}"
                                for w, d in enumerate(everyone))
        + "). Host values (NumPy arrays, Python numbers, this process's jax.Arrays) given to run "
        "must be equal on every worker: compute them the same way (same seed), or pass "
        "per-worker data as a distributed dataset or "
        "experimental_distribute_values_from_function.")


def _shown(description):
    kind, rest = description[0], description[1:]
    if kind in ("array", "numpy"):
        shape, dtype, digest = rest
        return f"{kind} {tuple(shape)} {dtype}" + (f" hash {digest[:8]}" if digest else "")
    return " ".join([kind] + [str(tuple(x)) if isinstance(x, list) else str(x) for x in rest])


def _path(in_tree, count, index):
    """``args[1]['w']`` style name of leaf ``index`` of ``(args, kwargs)``."""
    paths = jax.tree_util.tree_flatten_with_path(
        jax.tree_util.tree_unflatten(in_tree, list(range(count))))[0]
    path = paths[index][0]
    head = "args" if getattr(path[0], "idx", 0) == 0 else "kwargs"
    return head + jax.tree_util.keystr(tuple(path[1:]))
