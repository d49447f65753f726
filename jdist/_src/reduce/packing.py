"""Packing many small values into a few collectives, and the options that ask for it.

Each collective has a fixed latency, so a batch of small values of one dtype is concatenated
into flat buffers, all-reduced pack by pack and split back. As in TF, ``bytes_per_pack > 0``
(`CommunicationOptions`) keeps values whole and closes a pack once it holds that many bytes
(``group_by_size``); ``num_packs > 0`` (``NcclAllReduce``) cuts each dtype's buffer into that
many slices (``_ConcatAndSplitPacker``); with neither each value is its own pack. The plan is
static, so a compiled program holds one all-reduce per pack (`jdist.testing.count_all_reduces`).
"""

import dataclasses
import enum
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jdist._src.reduce import collectives
from jdist._src import errors


class CommunicationImplementation(enum.Enum):
    """Which collective implementation to prefer (``tf.distribute.experimental``'s enum):
    recorded only, since XLA chooses the algorithm of the all-reduce it compiles."""
    AUTO = "AUTO"
    RING = "RING"
    NCCL = "NCCL"


class CommunicationOptions:
    """Hints for cross-device communication (``tf.distribute.experimental.CommunicationOptions``).

    Args:
      bytes_per_pack: when > 0, values of a batch are packed into buckets of about this many
        bytes and each bucket is all-reduced at once (0: the implementation's own packing).
      timeout_seconds: accepted for TF compatibility; XLA's collectives have no per-call timeout.
      implementation: a `CommunicationImplementation` or its name (``"nccl"``, ``"RING"``, ...).

    Raises:
      InvalidArgumentError: ``bytes_per_pack`` < 0, or an unknown ``implementation``.

    Example:
      >>> import jdist
      >>> o = jdist.CommunicationOptions(bytes_per_pack=32768, implementation="nccl")
      >>> o.merge(jdist.CommunicationOptions(timeout_seconds=5.0))
      CommunicationOptions(bytes_per_pack=32768, timeout_seconds=5.0, implementation=NCCL)
    """

    def __init__(self, bytes_per_pack: int = 0, timeout_seconds: "float | None" = None,
                 implementation: object = CommunicationImplementation.AUTO) -> None:
        if isinstance(bytes_per_pack, bool) or not isinstance(bytes_per_pack, (int, np.integer)):
            raise errors.InvalidArgumentError(
                f"bytes_per_pack must be an int >= 0, got {bytes_per_pack!r}.")
        if bytes_per_pack < 0:
            raise errors.InvalidArgumentError(
                f"bytes_per_pack must be >= 0, got {bytes_per_pack}; use 0 for no packing hint.")
        if timeout_seconds is not None and not isinstance(timeout_seconds, (int, float)):
            raise errors.InvalidArgumentError(
                f"timeout_seconds must be a number or None, got {timeout_seconds!r}.")
        self.bytes_per_pack = int(bytes_per_pack)
        self.timeout_seconds = timeout_seconds
        self.implementation = _as_implementation(implementation)

    def merge(self, options: "CommunicationOptions | None") -> "CommunicationOptions":
        """New options: ``options``' values (or None's) where they are not the defaults, else ours."""
        merged = CommunicationOptions(self.bytes_per_pack, self.timeout_seconds,
                                      self.implementation)
        if options is None:
            return merged
        options = as_options(options)
        if options.bytes_per_pack != 0:
            merged.bytes_per_pack = options.bytes_per_pack
        if options.timeout_seconds is not None:
            merged.timeout_seconds = options.timeout_seconds
        if options.implementation is not CommunicationImplementation.AUTO:
            merged.implementation = options.implementation
        return merged

    def _key(self):
        return (self.bytes_per_pack, self.timeout_seconds, self.implementation)

    def __eq__(self, other):
        return isinstance(other, CommunicationOptions) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        return (f"CommunicationOptions(bytes_per_pack={self.bytes_per_pack}, "
                f"timeout_seconds={self.timeout_seconds}, "
                f"implementation={self.implementation.name})")


def _as_implementation(implementation):
    if isinstance(implementation, CommunicationImplementation):
        return implementation
    if isinstance(implementation, str) and implementation.upper() in (
            CommunicationImplementation.__members__):
        return CommunicationImplementation[implementation.upper()]
    raise errors.InvalidArgumentError(
        f"{implementation!r} is not a CommunicationImplementation; use "
        "CommunicationImplementation.AUTO, RING or NCCL (or their names).")


def as_options(options):
    """``options`` as `CommunicationOptions` (None gives the defaults)."""
    if options is None:
        return CommunicationOptions()
    if not isinstance(options, CommunicationOptions):
        raise errors.InvalidArgumentError(
            f"options must be a CommunicationOptions, got {type(options).__name__}.")
    return options


@dataclasses.dataclass(frozen=True)
class PackGroup:
    """Values of one ``dtype`` (``members``: their indices) sharing a flat buffer, cut into packs
    at ``bounds``: pack ``i`` is ``buffer[bounds[i]:bounds[i+1]]``."""
    dtype: str
    members: tuple
    bounds: tuple

    @property
    def num_packs(self):
        return len(self.bounds) - 1


@dataclasses.dataclass(frozen=True)
class PackPlan:
    """How values of ``shapes`` are cut into packs (hashable: programs are cached per plan);
    values of size zero belong to no `PackGroup`."""
    shapes: tuple
    groups: tuple

    @property
    def num_packs(self):
        """How many collectives the plan needs: one per pack."""
        return sum(g.num_packs for g in self.groups)


def plan_packs(specs, bytes_per_pack=0, num_packs=0):
    """Plans the packs for values with the given ``(shape, dtype)`` specs.

    ``bytes_per_pack`` > 0 packs whole values of one dtype until a pack holds that many bytes;
    else ``num_packs`` > 0 splits each dtype's buffer into that many packs; else each value is
    its own pack.

    Example:
      >>> plan = plan_packs([((256,), "float32")] * 10, bytes_per_pack=4096)
      >>> plan.num_packs  # 1 KB each: four values fill a 4 KB pack.
      3
    """
    shapes = tuple(tuple(int(d) for d in shape) for shape, _ in specs)
    dtypes = [np.dtype(dtype) for _, dtype in specs]
    sizes = [math.prod(s) for s in shapes]
    if bytes_per_pack <= 0 and num_packs <= 0:
        groups = tuple(PackGroup(dt.name, (i,), (0, n))
                       for i, (dt, n) in enumerate(zip(dtypes, sizes)) if n)
        return PackPlan(shapes, groups)
    by_dtype = {}
    for i, (dt, n) in enumerate(zip(dtypes, sizes)):
        if n:
            by_dtype.setdefault(dt, []).append(i)
    groups = []
    for dt, members in by_dtype.items():
        total = sum(sizes[i] for i in members)
        if bytes_per_pack > 0:
            bounds, offset, in_pack = [0], 0, 0
            for i in members:
                offset += sizes[i]
                in_pack += sizes[i] * dt.itemsize
                if in_pack >= bytes_per_pack:
                    bounds.append(offset)
                    in_pack = 0
            if bounds[-1] != total:
                bounds.append(total)
        else:
            k = min(num_packs, total)
            step = total // k
            bounds = [i * step for i in range(k)] + [total]  # The last pack takes the remainder.
        groups.append(PackGroup(dt.name, tuple(members), tuple(bounds)))
    return PackPlan(shapes, tuple(groups))


def packed_reduce(values, plan, reduce_pack):
    """Traced ``values`` reduced pack by pack by ``reduce_pack`` (of one flat array), back in
    their order and shapes; a value of size zero comes back as it is."""
    out = list(values)
    for group in plan.groups:
        starts = np.cumsum([0] + [math.prod(plan.shapes[i]) for i in group.members]).tolist()
        if set(group.bounds) <= set(starts):  # Packs of whole values: concatenate each pack.
            packs = [[i for i, start in zip(group.members, starts) if a <= start < b]
                     for a, b in zip(group.bounds[:-1], group.bounds[1:])]
        else:  # Packs cut through values: one buffer for the group, cut at the bounds.
            packs = [list(group.members)]
        for members in packs:
            flats = [jnp.ravel(values[i]) for i in members]
            buffer = flats[0] if len(flats) == 1 else jnp.concatenate(flats)
            if len(packs) == 1 and len(group.bounds) > 2:
                pieces = [reduce_pack(buffer[a:b])
                          for a, b in zip(group.bounds[:-1], group.bounds[1:])]
                reduced = jnp.concatenate(pieces)
            else:
                reduced = reduce_pack(buffer)
            offset = 0
            for i in members:
                size = math.prod(plan.shapes[i])
                out[i] = reduced[offset:offset + size].reshape(plan.shapes[i])
                offset += size
    return out


def packed_psum(values, plan, axis_name):
    """`packed_reduce` with `collectives.replica_sum`: one all-reduce per pack."""
    return packed_reduce(values, plan,
                         lambda buffer: collectives.replica_sum(buffer, axis_name))


def packed_replica_all_reduce(axis_name, num_replicas, op, value, bytes_per_pack):
    """``ReplicaContext.all_reduce`` of a nest inside a replica function, packed by bytes."""
    leaves, tree = jax.tree_util.tree_flatten(value)
    if len(leaves) == 1:  # Nothing to pack: the value keeps its shape, which errors name.
        return collectives.replica_all_reduce(axis_name, op, value)
    xs = [jnp.asarray(x) for x in leaves]
    plan = plan_packs([(x.shape, x.dtype) for x in xs], bytes_per_pack=bytes_per_pack)
    divisors = {}
    out = [collectives.finish(op, o, num_replicas, divisors)
           for o in packed_psum(xs, plan, axis_name)]
    return jax.tree_util.tree_unflatten(tree, out)


@functools.lru_cache(maxsize=256)
def all_reduce_program(sharding, op, bytes_per_pack, num_packs, signature):
    """``(program, plan)``: a ``jit(shard_map)`` all-reducing arrays stacked over ``sharding``
    (``signature``: their shapes and dtypes) to replicated results, one all-reduce per pack."""
    plan = plan_packs([(shape[1:], dtype) for shape, dtype in signature],
                      bytes_per_pack=bytes_per_pack, num_packs=0 if bytes_per_pack else num_packs)
    axis, mesh = sharding.spec[0], sharding.mesh
    n = mesh.devices.size
    count = len(plan.shapes)
    grouped = {i for g in plan.groups for i in g.members}

    def body(*blocks):
        out = packed_psum([b[0] for b in blocks], plan, axis)
        # A zero-size value is in no pack: its (empty) result is built here.
        divisors = {}
        return [collectives.finish(op, o if i in grouped else jnp.zeros(o.shape, o.dtype), n,
                                   divisors) for i, o in enumerate(out)]

    # Unchecked: a bfloat16 pack's sum is a gather (`collectives.replica_sum`), the same on
    # every replica though shard_map types a gather as varying.
    program = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(axis),) * count,
                                    out_specs=[P()] * count, check_vma=False))
    return program, plan
