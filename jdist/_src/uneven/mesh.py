"""An exact step's pieces as one program each over the whole mesh, for all traces (`uneven`).

A piece jitted per device compiles once per device. Here piece ``k`` of every trace is one
``shard_map`` over the strategy's mesh (``docs/design.md``, section 10): each device takes its
replica's branch of a ``lax.switch`` over the traces, with every trace's inputs (its own value
where the shapes agree, else zeros) and zeros for other traces' outputs. Inputs are assembled
from one buffer per device (``P()``); outputs of one type in every trace share a *merged* slot
(a collective's operands, ``P(axis)``; even step outputs). Served where traces are fewer than
replicas and no piece has effects (callbacks keep replica order).
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

# How `uneven` holds a value between pieces: as it is, with a leading axis of 1 (a collective
# program's blocks), or without its leading axis.
PLAIN, BLOCK, SQUEEZE = "plain", "block", "squeeze"


def held_shape(aval, form: str) -> tuple:
    """The shape a value of ``aval`` is held in, in ``form``."""
    return (1,) + aval.shape if form == BLOCK else aval.shape[1:] if form == SQUEEZE else (
        aval.shape)


def serves(replica_programs) -> bool:
    """Whether `MeshPieces` runs the plan of ``replica_programs`` (see the module doc)."""
    distinct = {id(p): p for p in replica_programs}.values()
    return len(distinct) < len(replica_programs) and not any(
        s.effects for p in distinct for s in p.segments)


class MeshPieces:
    """Runs an exact plan's pieces as whole-mesh programs: values stay whole-mesh arrays;
    what a ``merge_call`` or a ragged output reads goes to the replicas' ``envs``. Per-device
    lists follow ``local``. ``output_specs``: ``P(axis)``, ``P()``, or None (taken apart)."""

    def __init__(self, programs, replica_programs, local, collective_cuts, output_specs):
        self._sharding = programs.replicated_sharding
        self._local = local
        self._devices = [programs.devices[r] for r in local]
        self._guard = programs.guard
        self._owner = [replica_programs[r] for r in local]
        self._distinct = list({id(p): p for p in replica_programs}.values())
        self._own = {id(p): [j for j, q in enumerate(self._owner) if q is p]
                     for p in self._distinct}
        self._pieces, self.shared_cuts = [], set()
        for k in range(len(self._distinct[0].segments)):
            piece = _Piece(programs.mesh, programs.axis_name, k, self._distinct,
                           self.shared_cuts, collective_cuts, output_specs)
            self._pieces.append(piece)
            if piece.shares_cut:
                self.shared_cuts.add(k)
        self.merged_outputs = self._pieces[-1].merged_outputs
        self._ids = self._assemble([jax.device_put(np.int32(r), d)
                                    for r, d in zip(local, self._devices)])
        self._branch = self._assemble([  # Per device: which trace its replica has.
            jax.device_put(np.int32(self._distinct.index(q)), d)
            for q, d in zip(self._owner, self._devices)])
        self._zeros = {}  # (shape, dtype, device): the stand-in of a value of other shapes.
        self._consts = {id(p): [[jax.device_put(np.asarray(v), d) if kind == "const" else None
                                 for kind, v in p.trace.sources] for d in self._devices]
                        for p in self._distinct}

    def __call__(self, per_arg, replicated, envs, steps, cut_eqns):
        """Runs the step (its cuts by ``steps``); returns the merged outputs by output index."""
        values, shared = self._start(per_arg, replicated), {}
        for k, piece in enumerate(self._pieces):
            self._run(piece, envs, values, shared)
            if k == len(steps):
                break
            if k in self.shared_cuts:
                operands = [shared.pop(("in", k, i)) for i in range(piece.operand_count)]
                shared.update((("cut", k, i), result)
                              for i, result in enumerate(steps[k].on_stacked(operands)))
            else:
                steps[k](envs, cut_eqns(k), k)
                self._after_cut(k, envs, values)
        return {j: shared[("out", j)] for j in self.merged_outputs}

    def _start(self, per_arg, replicated):
        """Per distinct trace, its first piece's inputs: ``replicated[i]`` as it is, else
        ``per_arg[i]`` (one value per device) on its replicas and stand-ins elsewhere."""
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

    def _run(self, piece, envs, values, shared):
        """``piece`` on every device: merged outputs to ``shared``, what a ``merge_call`` or a
        ragged output reads to ``envs``, the rest to each trace's ``values``."""
        outputs = piece.run(self._branch, self._ids, *[
            shared[name] if owner is None else values[owner][name]
            for owner, name in piece.in_names])
        for (owner, key), output in zip(piece.out_names, outputs):
            if owner is None:
                shared[key] = output
            elif key[0] in ("in", "out"):
                shards = {s.device: s.data for s in output.addressable_shards}
                for d in self._own[owner]:
                    envs[self._local[d]][key] = shards[self._devices[d]]
            else:
                values[owner][key] = output
        if self._guard.enabled:
            jax.block_until_ready(outputs)

    def _after_cut(self, k, envs, values):
        """Cut ``k``'s results (in ``envs``) as each trace's whole-mesh arrays."""
        own = [_cut_outvars(q, k) for q in self._owner]  # Per local device, its trace's.
        for p in self._distinct:
            for i, v in enumerate(_cut_outvars(p, k)):
                values[id(p)][v, BLOCK] = self._gather(p, (v, BLOCK), [
                    envs[r].get((outvars[i], BLOCK)) if i < len(outvars) else None
                    for r, outvars in zip(self._local, own)])

    def _gather(self, program, key, per_device):
        """``key``'s whole-mesh array for ``program``: ``per_device``, or `_like` it elsewhere."""
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
            dtype = var.aval.dtype  # A key type (``jax.random.key``) has jnp's zeros only.
            zeros = (jnp.zeros if jax.dtypes.issubdtype(dtype, jax.dtypes.extended)
                     else np.zeros)(shape, dtype)
            self._zeros[zeros_key] = jax.device_put(zeros, device)
        return self._zeros[zeros_key]

    def _assemble(self, buffers):
        return jax.make_array_from_single_device_arrays(buffers[0].shape, self._sharding,
                                                        buffers)


def _cut_outvars(program, k):
    return program.trace.jaxpr.eqns[program.trace.cuts[k]].outvars


class _Piece:
    """Piece ``k`` of every trace as one program over ``mesh`` (a ``lax.switch`` per device).

    Inputs and outputs are named ``(None, key)``, shared by every trace (a shared cut's result,
    a merged slot), or ``(id(trace), key)``, a trace's own (zeros on other traces' devices).
    ``shares_cut``: whether the collective after it takes all its operands from merged slots.
    """

    def __init__(self, mesh, axis, k, traces, shared_cuts, collective_cuts, output_specs):
        segments = [p.segments[k] for p in traces]
        names = [[_input_name(p, key, shared_cuts) for key in s.inputs]
                 for p, s in zip(traces, segments)]
        self.in_names = list(dict.fromkeys(name for group in names for name in group))
        position = {name: i for i, name in enumerate(self.in_names)}
        groups = [[position[name] for name in group] for group in names]
        held = [_held(traces, name) for name in self.in_names]
        replica_id = jax.ShapeDtypeStruct((), np.int32)
        types = [dict(zip(s.outputs, jax.eval_shape(
            lambda rid, *x, body=s.body: tuple(body(rid, *x)), replica_id,
            *[held[i] for i in g]))) for s, g in zip(segments, groups)]
        self.operand_count = sum(1 for key in segments[0].outputs if key[0] == "in")
        specs = {("out", j): spec for j, spec in enumerate(output_specs) if spec is not None}
        if k in collective_cuts:
            specs.update((("in", k, i), P(axis)) for i in range(self.operand_count))
        merged = {key: spec for key, spec in specs.items() if key in types[0] and all(
            (t[key].shape, t[key].dtype) == (types[0][key].shape, types[0][key].dtype)
            for t in types)}  # One shape and dtype in every trace.
        # A collective takes its operands all stacked, or all from the replicas one by one.
        self.shares_cut = k in collective_cuts and all(
            ("in", k, i) in merged for i in range(self.operand_count))
        if not self.shares_cut:
            merged = {key: spec for key, spec in merged.items() if key[0] != "in"}
        self.merged_outputs = [key[1] for key in merged if key[0] == "out"]
        self.out_names = [(None, key) for key in merged] + [
            (id(p), key) for p, s in zip(traces, segments) for key in s.outputs
            if key not in merged]
        slot = {name: i for i, name in enumerate(self.out_names)}
        targets = [[slot[(None, key) if key in merged else (id(p), key)] for key in s.outputs]
                   for p, s in zip(traces, segments)]
        # A merged slot is typed strongly, as an output assembled from the replicas' is.
        out_types = [jax.ShapeDtypeStruct(types[0][key].shape, types[0][key].dtype)
                     for key in merged] + [
            t[key] for t, s in zip(types, segments) for key in s.outputs if key not in merged]
        in_specs = [P() if owner is not None else P(axis) for owner, _ in self.in_names]
        out_specs = [merged[key] if owner is None else P() for owner, key in self.out_names]
        self.run = _switched(mesh, [s.body for s in segments], groups, targets, out_types,
                             in_specs, out_specs)


def _switched(mesh, bodies, groups, targets, out_types, in_specs, out_specs):
    """A `_Piece`'s program: on each device, ``bodies[j]`` of its trace ``j`` on inputs
    ``groups[j]`` into slots ``targets[j]``, zeros in the others; a weak value fills a strong
    slot strongly (a device's value may be weak where its trace's variable is not)."""
    def branch(j):
        def run(replica_id, flat):
            results = list(map(_zeros, out_types))
            for t, x in zip(targets[j], bodies[j](replica_id, *[flat[i] for i in groups[j]])):
                results[t] = x if out_types[t].weak_type else lax.convert_element_type(
                    x, out_types[t].dtype)
            return tuple(results)
        return run

    def local(index, replica_id, *flat):
        return lax.switch(index, [branch(j) for j in range(len(bodies))], replica_id, flat)
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), *in_specs),
                                 out_specs=tuple(out_specs), check_vma=False))


def _held(traces, name):
    """The type of a `_Piece` input, as each device holds it."""
    owner, key = name
    if owner is None:  # A shared cut's result: every trace's has its type.
        _, c, i = key
        var, form = _cut_outvars(traces[0], c)[i], BLOCK
    else:
        var, form = key
    return jax.ShapeDtypeStruct(held_shape(var.aval, form), var.aval.dtype)


def _input_name(program, key, shared_cuts):
    """A piece's input name for ``key`` of ``program``'s trace (see `_Piece`)."""
    var, form = key
    trace = program.trace
    for c in shared_cuts:
        outvars = trace.jaxpr.eqns[trace.cuts[c]].outvars
        if form == BLOCK and var in outvars:
            return None, ("cut", c, outvars.index(var))
    return id(program), key


def _zeros(aval):
    """Zeros of ``aval``, weak-typed as it is (``lax.switch``'s branches must match)."""
    if aval.weak_type:
        return lax.full(aval.shape, np.zeros((), aval.dtype).item())
    return jnp.zeros(aval.shape, aval.dtype)
