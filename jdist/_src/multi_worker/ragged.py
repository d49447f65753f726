"""Exact uneven (ragged) per-replica values across the processes of a multi-worker strategy.

Each process holds only its own replicas' arrays; the others' are ``jax.ShapeDtypeStruct`` s
whose shapes were agreed when the value was made, so every worker traces the exact step alike.
`agree_step` compares the workers' views before each step: a typed error, not a hang.
"""

import functools
import hashlib
import json
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jdist._src import errors
from jdist._src.input import batches as input_batches
from jdist._src.multi_worker import input as multi_worker_input
from jdist._src.multi_worker.runtime import Agreement
from jdist._src.multi_worker.runtime import Cluster
from jdist._src.values import PerReplica
from jdist._src.values import ragged_components

_RAGGED_ACROSS = "ragged across workers"  # A `RaggedRowsPlacer` leaf kind.


def spec(shape: Sequence[int], dtype: Any) -> jax.ShapeDtypeStruct:
    """The placeholder of another worker's replica: its shape and JAX's dtype for ``dtype``."""
    return jax.ShapeDtypeStruct(tuple(shape), jax.dtypes.canonicalize_dtype(np.dtype(dtype)))


def ragged_from_local(devices: Sequence[jax.Device], local_ids: Sequence[int],
                      local_arrays: Sequence, shapes: Sequence, dtype: Any) -> PerReplica:
    """A ragged `PerReplica`: ``local_arrays`` on the devices of replicas ``local_ids``, and
    placeholders (``shapes[r]``, ``dtype``) for the other workers' replicas."""
    placed = jax.device_put(list(local_arrays), [devices[r] for r in local_ids])
    mine = dict(zip(local_ids, placed))
    return PerReplica._from_ragged(
        [mine[r] if r in mine else spec(shape, dtype) for r, shape in enumerate(shapes)])


class RaggedRowsPlacer(multi_worker_input.LocalRowsPlacer):
    """`multi_worker_input.LocalRowsPlacer` keeping a partial batch ragged (TF's semantics).

    Other workers' chunks are shape-only already (the split rule, or the PER_WORKER exchange,
    gives every worker every replica's shape): they become the placeholders.
    """

    def split(self, chunks: list, rows: Any) -> tuple:
        if len({c.shape for c in chunks}) == 1:
            return super().split(chunks, rows)
        shapes = [tuple(c.shape) for c in chunks]
        return (list(chunks[self._lo:self._hi]), (shapes, chunks[0].dtype), _RAGGED_ACROSS)

    def place(self, leaves: list) -> list:
        ragged = [i for i, (_, _, kind) in enumerate(leaves) if kind == _RAGGED_ACROSS]
        if not ragged:
            return super().place(leaves)
        others = iter(super().place([leaf for leaf in leaves if leaf[2] != _RAGGED_ACROSS]))
        devices = self._targets[input_batches.RAGGED]
        local_ids = tuple(range(self._lo, self._hi))
        return [ragged_from_local(devices, local_ids, leaf[0], *leaf[1])
                if leaf[2] == _RAGGED_ACROSS else next(others) for leaf in leaves]


def agree_step(agreement: Agreement, cluster: Cluster, signature: Sequence) -> None:
    """Raises on every worker unless every worker runs an exact step on the same signature.

    ``signature`` is `spmd`'s per-leaf one; its static leaves are skipped (`arguments` compares
    them by value).

    Raises:
      UnevenValuesError: the workers' views of the replicas' shapes differ.
      UnavailableError: a peer did not reach the step within the timeout.
    """
    described = [repr(entry) for entry in signature if entry[0] != "static"]
    digest = hashlib.blake2b(json.dumps(described).encode(), digest_size=12).hexdigest()
    everyone = agreement.exchange("strategy.run (exact uneven step)", digest)
    if len(set(everyone)) != 1:
        raise errors.UnevenValuesError(
            "the workers called strategy.run with per-replica values whose replicas' shapes they "
            "see differently (" + "; ".join(f"{cluster.name(w)}: signature {d}"
                                           for w, d in enumerate(everyone))
            + "); every worker must pass values of the same distributed batch. Make ragged "
            "values with a distributed dataset or experimental_distribute_values_from_function.")


def gather_operands(programs: Any, local: Sequence[int], blocks: dict, avals: Sequence,
                    device: jax.Device) -> list:
    """Every replica's merge_call arguments on ``device`` (one of this worker's), a flat list
    replica by replica, in their true shapes.

    ``programs`` is the strategy's `ReplicaMesh`; ``blocks[r]`` local replica ``r``'s argument
    blocks (a leading axis of 1); ``avals[r]`` every replica's avals, known on every worker.
    """
    n, count = len(avals), len(avals[0])
    columns = []
    for i in range(count):
        shapes = [(1,) + tuple(a[i].shape) for a in avals]  # Blocks: a leading axis of 1.
        dtypes = {str(a[i].dtype) for a in avals}
        if len(dtypes) != 1:
            raise errors.UnevenValuesError(
                f"merge_call argument {i} has dtypes {sorted(dtypes)} on different replicas; "
                "pass values of one dtype on every replica.")
        columns.append((shapes, avals[0][i].dtype))
    targets = [tuple(max(s[d] for s in shapes) for d in range(len(shapes[0])))
               for shapes, _ in columns]
    gathered = _all_gather(programs, local, blocks, columns, targets)
    out: list[list[Any]] = [[None] * count for _ in range(n)]
    for i, ((shapes, dtype), full) in enumerate(zip(columns, gathered)):
        for r, shape in enumerate(shapes):
            out[r][i] = (jnp.zeros(shape, dtype) if full is None
                         else full[(slice(r, r + 1),) + tuple(slice(0, d) for d in shape[1:])])
    return jax.device_put([x for row in out for x in row], device)


def _all_gather(programs, local, blocks, columns, targets):
    """Per argument: every replica's padded blocks on this worker's first device, or None when
    they are all empty (XLA rejects zero-size collectives)."""
    devices = programs.devices
    inputs, where = [], []
    for i, ((_, dtype), target) in enumerate(zip(columns, targets)):
        if int(np.prod(target)) == 0:
            continue
        padded = [_pad(blocks[r][i], target) for r in local]
        inputs.append(jax.make_array_from_single_device_arrays(
            (len(devices),) + target[1:], programs.per_replica_sharding, padded))
        where.append(i)
    out = [None] * len(columns)
    if inputs:
        if programs.guard.enabled:  # Never start a collective while a piece still runs (CPU).
            jax.block_until_ready(inputs)
        results = programs.guard.dispatch(_replicate(programs.replicated_sharding, len(inputs)),
                                          *inputs)
        first = devices[local[0]]
        for i, x in zip(where, results):
            out[i] = next(s.data for s in x.addressable_shards if s.device == first)
    return out


def _pad(block, target):
    widths = [(0, t - s) for s, t in zip(block.shape, target)]
    return block if all(w == (0, 0) for w in widths) else _pad_program(tuple(widths))(block)


@functools.lru_cache(maxsize=None)
def _pad_program(widths):
    return jax.jit(lambda x: jnp.pad(x, widths))


@functools.lru_cache(maxsize=None)
def _replicate(sharding, count):
    """A compiled all-gather: ``count`` per-replica arrays to copies on every device."""
    return jax.jit(lambda *xs: xs, out_shardings=(sharding,) * count)


def as_padded(mesh: jax.sharding.Mesh, axis_name: str, value: PerReplica) -> PerReplica:
    """A ragged `PerReplica` spanning workers as a padded one (``lengths``), which
    ``strategy.reduce`` and ``strategy.gather`` combine exactly across hosts.

    Raises:
      UnevenValuesError: the replicas' values differ beyond their first axis.
    """
    components = ragged_components(value)
    shapes = [tuple(c.shape) for c in components]
    if len({s[1:] for s in shapes}) != 1 or any(len(s) == 0 for s in shapes):
        raise errors.UnevenValuesError(
            f"the replicas of several workers hold values of shapes {shapes}, which differ "
            "beyond their first axis; reduce or gather them inside strategy.run (e.g. "
            "ReplicaContext.all_gather), or give them one shape but for the first axis.")
    rows = max(s[0] for s in shapes)
    local = [(r, c) for r, c in enumerate(components) if not isinstance(c, jax.ShapeDtypeStruct)]
    blocks = [_pad(c[None], (1, rows) + shapes[0][1:]) for _, c in local]
    stacked = jax.make_array_from_single_device_arrays(
        (len(components), rows) + shapes[0][1:], NamedSharding(mesh, P(axis_name)), blocks)
    return PerReplica._from_stacked(stacked, tuple(s[0] for s in shapes))
