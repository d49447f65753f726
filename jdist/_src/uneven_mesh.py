"""An exact step's pieces as one program each over the whole mesh, for all traces (`uneven`).

A partial batch gives the replicas at most three distinct traces (ceil, floor, empty), but a
piece jitted for one device compiles once per device: 16 compiles of pieces on 8 devices for a
step of two pieces. Here piece ``k`` of every trace is one ``shard_map`` program over the
strategy's mesh, the mesh the traced pieces' types already name (a program over fewer devices
mixes two meshes, ``docs/design.md``, section 10). Each device takes its replica's branch of a
``lax.switch`` over the traces and computes that trace's piece on its true values; it gives
zeros for the other traces' outputs, and every trace's inputs reach every device (a device's
own value where the shapes agree, zeros where they do not), as a switch's operands must. So a
piece compiles once, whatever the replica count and however many traces.

Each input enters as an array assembled from one buffer per device, its sharding replicated
(one device's shape), and each device reads its own buffer (``in_specs=P()`` without the
replication check); an output a cut or the step returns is taken apart per device the same
way. Nothing is copied.

Served where fewer traces than replicas make a gain and no piece has effects (callbacks: run
one device at a time, the replicas' come in replica order). Across workers each process runs
every program on its own devices, as its piece of one program over the global mesh.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

# How `uneven` holds a value between pieces, relative to its variable's shape: as it is, with
# a leading axis of 1 (what a collective program takes and gives), or without its leading axis.
PLAIN, BLOCK, SQUEEZE = "plain", "block", "squeeze"


def held_shape(aval, form):
    """The shape a value of ``aval`` is held in, in ``form``."""
    return (1,) + aval.shape if form == BLOCK else aval.shape[1:] if form == SQUEEZE else (
        aval.shape)


def serves(replica_programs) -> bool:
    """Whether `MeshPieces` runs the plan of ``replica_programs`` (see the module doc)."""
    distinct = {id(p): p for p in replica_programs}.values()
    return len(distinct) < len(replica_programs) and not any(
        s.effects for p in distinct for s in p.segments)


class MeshPieces:
    """Runs an exact plan's pieces as whole-mesh programs, one per distinct trace and piece.

    A call keeps, per distinct trace, its values as whole-mesh arrays from piece to piece; only
    what a cut or the step's outputs read is taken apart per replica (`envs`, the replicas' own
    environments that `uneven._Plan` hands its cut steps and reads its outputs from).

    Per-device lists follow ``local``: this process's replicas (all of them on one process;
    across workers, each process runs every program on its own devices).

    Args:
      programs: the strategy's `replica_mesh.ReplicaMesh`.
      replica_programs: per replica, its `uneven._TraceProgram`.
      local: the replicas whose devices this process holds, in order.
    """

    def __init__(self, programs, replica_programs, local):
        self._sharding = programs.replicated_sharding
        self._local = local
        self._devices = [tuple(programs.mesh.devices.flat)[r] for r in local]
        self._guard = programs.guard
        self._owner = [replica_programs[r] for r in local]
        self._distinct = list({id(p): p for p in replica_programs}.values())
        self._own = {id(p): [j for j, q in enumerate(self._owner) if q is p]
                     for p in self._distinct}
        self._runs = [_switched(programs.mesh, [p.segments[k] for p in self._distinct])
                      for k in range(len(self._distinct[0].segments))]
        self._ids = self._assemble([jax.device_put(np.int32(r), d)
                                    for r, d in zip(local, self._devices)])
        self._branch = self._assemble([  # Per device: which trace its replica has.
            jax.device_put(np.int32(self._distinct.index(q)), d)
            for q, d in zip(self._owner, self._devices)])
        self._zeros = {}  # (shape, dtype, device): the stand-in of a value of other shapes.
        self._consts = {id(p): [[jax.device_put(np.asarray(v), d) if kind == "const" else None
                                 for kind, v in p.trace.sources] for d in self._devices]
                        for p in self._distinct}

    def start(self, per_arg, replicated):
        """Per distinct trace, the inputs of its first piece: ``replicated[i]`` (a replicated
        array, or None) as it is, else from ``per_arg[i]`` (one value per device) on its own
        replicas and stand-ins elsewhere (both in ``local``'s order)."""
        values = {}
        for p in self._distinct:
            consts, held = self._consts[id(p)], {}
            for j, (key, (kind, i)) in enumerate(zip(p.input_keys, p.trace.sources)):
                if kind == "arg" and replicated[i] is not None:
                    held[key] = replicated[i]
                else:
                    held[key] = self._gather(p, key, [
                        per_arg[i][d] if kind == "arg" else consts[d][j]
                        for d in range(len(self._devices))])
            values[id(p)] = held
        return values

    def run(self, k, envs, values):
        """Piece ``k`` of every trace on every device: its values stay whole-mesh arrays in
        ``values``, what cut ``k`` and the outputs read goes to the replicas' ``envs``."""
        outputs = iter(self._runs[k](self._branch, self._ids, *[
            values[id(p)][key] for p in self._distinct for key in p.segments[k].inputs]))
        waited = []
        for p in self._distinct:
            held = values[id(p)]
            for key, output in zip(p.segments[k].outputs, outputs):
                if key[0] in ("in", "out"):  # Read per replica (a cut's operand, an output).
                    shards = {s.device: s.data for s in output.addressable_shards}
                    for d in self._own[id(p)]:
                        envs[self._local[d]][key] = shards[self._devices[d]]
                else:
                    held[key] = output
                if self._guard.enabled:
                    waited.append(output)
        if waited:  # As every piece before a collective on CPU (`uneven`).
            jax.block_until_ready(waited)

    def after_cut(self, k, envs, values):
        """Cut ``k``'s results (in ``envs``) as each trace's whole-mesh arrays: on the other
        devices, the device's own result where its shape is the trace's, zeros elsewhere."""
        own = [_cut_outvars(q, k) for q in self._owner]  # Per local device, its trace's.
        for p in self._distinct:
            for i, v in enumerate(_cut_outvars(p, k)):
                values[id(p)][v, BLOCK] = self._gather(p, (v, BLOCK), [
                    envs[r].get((outvars[i], BLOCK)) if i < len(outvars) else None
                    for r, outvars in zip(self._local, own)])

    def _gather(self, program, key, per_device):
        """One whole-mesh array of ``key`` for ``program``'s trace: ``per_device[d]`` on its
        own replicas' devices, `_like` it elsewhere."""
        own = set(self._own[id(program)])
        return self._assemble([x if d in own else self._like(x, key, d)
                               for d, x in enumerate(per_device)])

    def _like(self, value, key, device_index):
        """``value`` where it has the held shape of ``key``'s variable, else zeros of it."""
        var, form = key
        shape = held_shape(var.aval, form)
        if value is not None and value.shape == shape and value.dtype == var.aval.dtype:
            return value
        device = self._devices[device_index]
        zeros_key = (shape, var.aval.dtype, device)
        if zeros_key not in self._zeros:
            dtype = var.aval.dtype  # A key type (``jax.random.key``) has jax.numpy's zeros.
            zeros = (jnp.zeros if jax.dtypes.issubdtype(dtype, jax.dtypes.extended)
                     else np.zeros)(shape, dtype)
            self._zeros[zeros_key] = jax.device_put(zeros, device)
        return self._zeros[zeros_key]

    def _assemble(self, buffers):
        return jax.make_array_from_single_device_arrays(buffers[0].shape, self._sharding,
                                                        buffers)


def _cut_outvars(program, k):
    return program.trace.jaxpr.eqns[program.trace.cuts[k]].outvars


def _switched(mesh, segments):
    """One program over every device of ``mesh`` for one piece of every trace: each device
    runs the piece of its replica's trace (``lax.switch`` on the trace's index) on its own
    buffers, and gives zeros for the other traces' outputs."""
    sizes = [len(s.inputs) for s in segments]
    replica_id = jax.ShapeDtypeStruct((), np.int32)
    out_avals = [jax.eval_shape(
        lambda rid, *values, body=s.body: tuple(body(rid, *values)), replica_id, *[
            jax.ShapeDtypeStruct(held_shape(v.aval, form), v.aval.dtype) for v, form in s.inputs])
        for s in segments]

    def branch(j):
        def run(replica_id, groups):
            return tuple(x for t, avals in enumerate(out_avals) for x in (
                segments[j].body(replica_id, *groups[j]) if t == j else map(_zeros, avals)))
        return run

    def local(index, replica_id, *flat):
        bounds = np.cumsum([0] + sizes)
        groups = [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        return lax.switch(index, [branch(j) for j in range(len(segments))], replica_id, groups)
    mapped = jax.shard_map(local, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
    return jax.jit(mapped)


def _zeros(aval):
    """Zeros of ``aval``, weak-typed as it is (a Python number's type, which a branch of
    ``lax.switch`` must match)."""
    if aval.weak_type:
        return lax.full(aval.shape, np.zeros((), aval.dtype).item())
    return jnp.zeros(aval.shape, aval.dtype)
