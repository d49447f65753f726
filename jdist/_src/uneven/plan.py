"""Exact steps on per-replica values of different shapes: each replica computes with its own.

TF runs the replica function per replica, so on a partial batch ``x.shape[0]`` is each
replica's true row count. One SPMD program has one shape per value, so jdist runs the replica
body in pieces (``docs/design.md``, section 10): traced once per distinct replica signature
(`uneven_trace`; at most three for a partial batch), cut at each collective and ``merge_call``;
each piece runs on every replica's device with its own values (`uneven_mesh`: one program over
the mesh; else per device), each collective as one ``shard_map`` program binding the same
primitive, each ``merge_call`` once on the replicas' true values. Plans are cached per
signature, like even programs.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core
from jax.sharding import PartitionSpec as P

from jdist._src import errors
from jdist._src import host_values
from jdist._src import invariance
from jdist._src.base import PER_REPLICA
from jdist._src.uneven import mesh as uneven_mesh
from jdist._src.uneven.mesh import BLOCK
from jdist._src.uneven.mesh import PLAIN
from jdist._src.uneven.mesh import SQUEEZE
from jdist._src.multi_worker import ragged as uneven_multi_worker
from jdist._src.uneven import schedule as uneven_schedule
from jdist._src.uneven import trace as uneven_trace
from jdist._src.uneven.merge import merge_p
from jdist._src.values import Mirrored
from jdist._src.values import PerReplica
from jdist._src.values import SCALARS
from jdist._src.values import ragged_components


def plan(runner, fn, in_tree, kinds, statics, dynamic, abstract):
    """The `_Plan` of ``fn`` on ragged arguments, called with each call's ``dynamic`` arguments.
    ``abstract``: per replica, its trace's arguments (stacked as if every replica had its
    shapes); the rest as `spmd.ReplicatedRunner` classified them."""
    traces, merges = uneven_trace.trace_replicas(runner, fn, in_tree, kinds, statics, abstract)
    return _Plan.build(runner.programs, traces, merges, dynamic, kinds)


# ------------------------------------------------------------------------ pieces and steps
MIRRORED, STACKED, RAGGED = "mirrored", "stacked", "ragged"


@dataclasses.dataclass(frozen=True)
class _Segment:
    """One piece between two cuts, compiled for one device."""
    run: Any  # Jitted: (replica id, *inputs) -> outputs.
    inputs: tuple  # Environment keys read: (var, form).
    outputs: tuple  # Environment keys written: (var, PLAIN), ("in", cut, i) or ("out", j).
    body: Any  # ``run`` before jit (`uneven_mesh` maps it over the mesh).
    effects: bool


@dataclasses.dataclass(frozen=True)
class _TraceProgram:
    """An `uneven_trace.Trace` cut into segments (one more than cuts)."""
    trace: Any
    input_keys: tuple  # Per body input: the environment key its value is stored under.
    segments: tuple


def _program(trace, out_forms, ragged_args):
    """Cuts ``trace`` into `_Segment` s."""
    jaxpr, cuts = trace.jaxpr, trace.cuts
    stored = {v: SQUEEZE if src[0] == "arg" and src[1] in ragged_args else PLAIN
              for v, src in zip(jaxpr.invars, trace.sources)}
    stored.update((v, BLOCK) for c in cuts for v in jaxpr.eqns[c].outvars)
    bounds = (-1,) + cuts + (len(jaxpr.eqns),)
    last = len(bounds) - 2
    uses = []  # Per segment: what its eqns, the next cut or the outputs read.
    for k in range(last + 1):
        atoms = [a for e in jaxpr.eqns[bounds[k] + 1:bounds[k + 1]] for a in e.invars]
        atoms += jaxpr.eqns[bounds[k + 1]].invars if k < last else jaxpr.outvars
        uses.append([a for a in atoms if isinstance(a, core.Var)])
    later = [set().union(*map(set, uses[k + 1:])) for k in range(last + 1)]
    segments = tuple(
        _segment(jaxpr, bounds, k, last, stored, uses[k], later[k], out_forms)
        for k in range(last + 1))
    input_keys = tuple((v, stored[v]) for v in jaxpr.invars)
    return _TraceProgram(trace, input_keys, segments)


def _segment(jaxpr, bounds, k, last, stored, uses, later, out_forms):
    body = jaxpr.eqns[bounds[k] + 1:bounds[k + 1]]
    axis_vars = [e.outvars[0] for e in body if e.primitive.name == "axis_index"]
    body = [e for e in body if e.primitive.name != "axis_index"]
    defined = set(axis_vars).union(*(e.outvars for e in body))
    inputs = list(dict.fromkeys(v for v in uses if v not in defined))
    outs = [((v, PLAIN), v, PLAIN) for v in dict.fromkeys(
        v for e in body for v in e.outvars) if v in later]
    outs += [((v, PLAIN), v, PLAIN) for v in axis_vars if v in later]
    if k < last:
        outs += [(("in", k, i), a, BLOCK) for i, a in enumerate(jaxpr.eqns[bounds[k + 1]].invars)]
    else:
        outs += [(("out", j), a, f) for j, (a, f) in enumerate(zip(jaxpr.outvars, out_forms))]
    in_keys = tuple((v, stored.get(v, PLAIN)) for v in inputs)
    effects = frozenset().union(*(e.effects for e in body))
    invars, outvars = inputs + axis_vars, [a for _, a, _ in outs]
    debug = core.DebugInfo("jdist uneven step", None, (None,) * len(invars),
                           tuple(str(key) for key, _, _ in outs))
    piece = core.Jaxpr([], invars, outvars, body, effects, debug)
    fun = core.jaxpr_as_fun(core.ClosedJaxpr(piece, []))
    in_forms, out_forms_k, n_axis = [f for _, f in in_keys], [f for _, _, f in outs], len(axis_vars)

    def run(replica_id, *values):
        values = [_to_plain(x, f) for x, f in zip(values, in_forms)]
        results = fun(*values, *([replica_id] * n_axis))
        return [_from_plain(x, f) for x, f in zip(results, out_forms_k)]
    # The replica id, kept even if unused, places a piece that reads nothing on its device.
    return _Segment(jax.jit(run, keep_unused=True), in_keys, tuple(key for key, _, _ in outs),
                    run, bool(effects))


def _to_plain(x, form):
    return x[0] if form == BLOCK else x[None] if form == SQUEEZE else x


def _from_plain(x, form):
    x = jnp.asarray(x)  # A literal the trace folded in.
    return x[None] if form == BLOCK else x[0] if form == SQUEEZE else x


@dataclasses.dataclass(frozen=True)
class _CollectiveStep:
    """A collective cut: one ``shard_map`` program binding the same primitive on the blocks."""
    programs: Any
    run: Any  # Jitted over the replica mesh, or None for zero-size operands.
    out_avals: tuple

    def __call__(self, envs, eqns, k):
        n, local = len(eqns), list(envs)
        devices = [self.programs.devices[r] for r in local]
        blocks = [[envs[r].pop(("in", k, i)) for i in range(len(eqns[r].invars))]
                  for r in local]
        stacked = [jax.make_array_from_single_device_arrays(
            (n,) + column[0].shape[1:], self.programs.per_replica_sharding, list(column))
            for column in zip(*blocks)]
        results = [_by_device(x, devices) for x in self.on_stacked(stacked)]
        for j, r in enumerate(local):
            envs[r].update(((v, BLOCK), column[j]) for v, column in zip(eqns[r].outvars, results))

    def on_stacked(self, stacked):
        """The collective's results on its operands stacked over the replicas, stacked so."""
        sharding = self.programs.per_replica_sharding
        if self.run is None:  # XLA rejects zero-size collectives; their results are empty.
            n = sharding.mesh.devices.size
            return [jax.make_array_from_callback(
                (n,) + a.shape, sharding, lambda index, a=a: np.zeros((n,) + a.shape, a.dtype)[
                    index]) for a in self.out_avals]
        guard = self.programs.guard
        if guard.enabled:  # No collective while a piece still runs (CPU).
            jax.block_until_ready(stacked)
        return guard.dispatch(self.run, *stacked)


def _collective_step(programs, eqn):
    out_avals = tuple(v.aval for v in eqn.outvars)
    if any(v.aval.size == 0 for v in eqn.invars) or any(a.size == 0 for a in out_avals):
        return _CollectiveStep(programs, None, out_avals)

    def body(*blocks):
        return tuple(o[None] for o in uneven_schedule.bind_cut(eqn, [b[0] for b in blocks]))
    axis = programs.axis_name
    mapped = jax.shard_map(body, mesh=programs.mesh, in_specs=(P(axis),) * len(eqn.invars),
                           out_specs=(P(axis),) * len(out_avals), check_vma=False)
    return _CollectiveStep(programs, jax.jit(mapped), out_avals)


@dataclasses.dataclass(frozen=True)
class _MergeStep:
    """A merge_call cut: ``merge_fn`` once, on one device, over every replica's true values."""
    programs: Any
    merge: Any  # An `uneven_trace.Merge`.

    def __call__(self, envs, eqns, k):
        devices, local = list(self.programs.devices), list(envs)
        blocks = {r: [envs[r].pop(("in", k, i)) for i in range(len(eqns[r].invars))]
                  for r in local}
        if len(local) == len(eqns):  # One process holds every replica's arguments.
            operands = jax.device_put([b for r in local for b in blocks[r]], devices[0])
        else:  # Across workers, each runs merge_fn on every replica's arguments.
            operands = uneven_multi_worker.gather_operands(
                self.programs, local, blocks, [[v.aval for v in e.invars] for e in eqns],
                devices[local[0]])
        results = self.merge.run(*operands)
        targets = [(r, i) for r in local for i in self.merge.replica_outputs[r]]
        placed = iter(jax.device_put([results[i] for _, i in targets],
                                     [devices[r] for r, _ in targets]))
        for r in local:
            envs[r].update(((v, BLOCK), next(placed)) for v in eqns[r].outvars)


def _by_device(array, devices):
    shards = {s.device: s.data for s in array.addressable_shards}
    return [shards[d] for d in devices]


# ------------------------------------------------------------------------------ the plan
@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything a call of an uneven step needs; built once per input signature."""
    programs: Any
    replica_programs: tuple  # Per replica: its `_TraceProgram`.
    local: tuple  # The replicas whose devices this process holds (all of them on one).
    replica_consts: dict  # Per local replica: per body input, its constant on its device.
    replica_ids: dict  # Per local replica: its id as an int32 on its device.
    steps: tuple  # Per cut: a `_CollectiveStep` or a `_MergeStep`.
    out_kinds: tuple  # Per output: MIRRORED, STACKED or RAGGED.
    out_tree: Any
    out_statics: tuple  # Per output leaf: a Python object returned as it is, or `OUTPUT`.
    ragged_args: frozenset
    stacked_args: frozenset  # Even per-replica arguments: their stacked array, a block each.
    mesh_pieces: Any  # A `uneven_mesh.MeshPieces`, or None: one device at a time.

    @classmethod
    def build(cls, programs, traces, merges, dynamic, kinds):
        devices = programs.devices
        distinct = list({id(t): t for t in traces}.values())
        uneven_trace.check_cuts(distinct)
        out_kinds = _out_kinds(traces, distinct)
        ragged_args = frozenset(i for i, x in enumerate(dynamic)
                                if isinstance(x, PerReplica) and x.ragged)
        stacked_args = frozenset(i for i, k in enumerate(uneven_trace.dynamic_kinds(kinds))
                                 if k == PER_REPLICA and i not in ragged_args)
        forms = [PLAIN if kind == STACKED else SQUEEZE for kind in out_kinds]
        by_trace = {id(t): _program(t, forms, ragged_args) for t in distinct}
        first = distinct[0]
        steps = tuple(
            _MergeStep(programs, merges[first.jaxpr.eqns[i].params["index"]])
            if first.jaxpr.eqns[i].primitive is merge_p
            else _collective_step(programs, first.jaxpr.eqns[i]) for i in first.cuts)
        local = tuple(r for r, d in enumerate(devices) if d.process_index == jax.process_index())
        replica_programs = tuple(by_trace[id(t)] for t in traces)
        mesh_pieces = None
        if uneven_mesh.serves(replica_programs):
            collective_cuts = {k for k, step in enumerate(steps)
                               if isinstance(step, _CollectiveStep)}
            output_specs = tuple(None if kind == RAGGED else P(programs.axis_name)
                                 if kind == STACKED else P() for kind in out_kinds)
            mesh_pieces = uneven_mesh.MeshPieces(programs, replica_programs, local,
                                                 collective_cuts, output_specs)
        by_device = mesh_pieces is None  # Only running one device at a time reads these.
        consts = {r: tuple(jax.device_put(np.asarray(v), devices[r]) if kind == "const" else None
                           for kind, v in traces[r].sources) for r in local} if by_device else {}
        ids = {r: jax.device_put(np.int32(r), devices[r]) for r in local} if by_device else {}
        return cls(programs, replica_programs, local, consts, ids, steps, out_kinds,
                   first.out_tree, _regroup(programs, traces), ragged_args, stacked_args,
                   mesh_pieces)

    def __call__(self, dynamic):
        replicated = [None if i in self.ragged_args or i in self.stacked_args
                      else _replicated(x, self.programs) for i, x in enumerate(dynamic)]
        mesh = self.mesh_pieces  # Takes a replicated argument as it is, not a copy per device.
        per_arg = [None if mesh is not None and replicated[i] is not None else _per_device(
            x, i in self.ragged_args, replicated[i], self.programs, self.local)
            for i, x in enumerate(dynamic)]
        if mesh is not None:
            envs = {r: {} for r in self.local}
            merged = mesh(per_arg, replicated, envs, self.steps, self._cut_eqns)
        else:
            envs, merged = self._replica_envs(per_arg), {}
            for k in range(len(self.steps) + 1):
                self._run_per_device(k, envs)
                if k < len(self.steps):
                    self.steps[k](envs, self._cut_eqns(k), k)
        outputs = [self._wrap(j, merged[j]) if j in merged else
                   self._output(j, [env[("out", j)] for env in envs.values()])
                   for j in range(len(self.out_kinds))]
        if self.programs.guard.enabled:
            jax.block_until_ready(outputs)
        arrays = iter(outputs)
        return jax.tree_util.tree_unflatten(self.out_tree, [
            next(arrays) if s is uneven_trace.OUTPUT else s for s in self.out_statics])

    def _replica_envs(self, per_arg):
        """Per local replica: its first piece's inputs, by environment key."""
        envs = {}
        for j, r in enumerate(self.local):
            program = self.replica_programs[r]
            envs[r] = {key: per_arg[src[1]][j] if src[0] == "arg" else const
                       for key, src, const in zip(program.input_keys, program.trace.sources,
                                                  self.replica_consts[r])}
        return envs

    def _run_per_device(self, k, envs):
        for r, env in envs.items():
            segment = self.replica_programs[r].segments[k]
            outs = segment.run(self.replica_ids[r], *[env[key] for key in segment.inputs])
            env.update(zip(segment.outputs, outs))

    def _cut_eqns(self, k):
        return [p.trace.jaxpr.eqns[p.trace.cuts[k]] for p in self.replica_programs]

    def _output(self, j, values):
        """Output ``j`` from its value on each local replica's device."""
        kind, n = self.out_kinds[j], len(self.replica_programs)
        if kind == RAGGED and len(values) < n:  # Other workers' replicas: their shapes.
            mine = dict(zip(self.local, values))
            return PerReplica._from_ragged([
                mine[r] if r in mine else uneven_multi_worker.spec(a.shape[1:], a.dtype)
                for r, a in enumerate(p.trace.jaxpr.outvars[j].aval
                                      for p in self.replica_programs)])
        if kind == RAGGED:
            return PerReplica._from_components(tuple(values))
        if kind == MIRRORED:
            return self._wrap(j, jax.make_array_from_single_device_arrays(
                values[0].shape, self.programs.replicated_sharding, values))
        return self._wrap(j, jax.make_array_from_single_device_arrays(
            (n,) + values[0].shape[1:], self.programs.per_replica_sharding, values))

    def _wrap(self, j, array):
        """Output ``j`` from its whole-mesh ``array``."""
        kind = self.out_kinds[j]
        if kind == STACKED:
            return PerReplica._from_stacked(array)
        return Mirrored._from_value(array, len(self.replica_programs), True)


def _out_kinds(traces, distinct):
    """Per output: MIRRORED where provably one value on several replicas, RAGGED where the
    replicas' shapes differ, else STACKED."""
    same = [all(col) for col in zip(*(
        invariance.same_outputs(t.jaxpr, list(t.replicated_in)) for t in distinct))]
    if len(distinct) > 1:  # Constants (x.shape[0]) differ between traces of other shapes.
        forms = uneven_trace.output_forms(distinct)
        same = [s and len({f[j] for f in forms}) == 1 for j, s in enumerate(same)]
    shapes = [[tuple(v.aval.shape) for v in t.jaxpr.outvars] for t in traces]
    return tuple((MIRRORED if s and len(traces) > 1 else STACKED)
                 if len({sh[j] for sh in shapes}) == 1 else RAGGED for j, s in enumerate(same))


def _regroup(programs, traces):
    """The Python objects the replicas returned, TF's regroup: one where all are equal, else a
    `PerReplica` of the replicas' numbers."""
    statics = []
    for values in zip(*(t.out_statics for t in traces)):
        first = values[0]
        if first is uneven_trace.OUTPUT or all(v == first for v in values[1:]):
            statics.append(first)
        elif all(isinstance(v, SCALARS) for v in values):
            # PerReplica picks their dtype; from a callback, each process places its own.
            numbers = np.asarray(values, PerReplica(list(values)).stacked.dtype)
            statics.append(PerReplica._from_stacked(jax.make_array_from_callback(
                numbers.shape, programs.per_replica_sharding, lambda index: numbers[index])))
        else:
            raise errors.UnsupportedValueError(
                f"the replicas returned different Python objects ({list(values)}); return "
                "arrays, numbers or objects every replica computes the same.")
    return tuple(statics)


def _replicated(x, programs):
    """A replicated argument placed on every device of the mesh."""
    if not isinstance(x, (jax.Array, np.ndarray, np.generic)):
        x = host_values.python_numbers_as_tf(x)  # As the trace typed it.
    return programs.place_replicated(x)


def _per_device(x, ragged, replicated, programs, local):
    """A dynamic argument as one array per local replica's device: a ragged one's components,
    an even per-replica one's blocks, a ``replicated`` one's copies."""
    devices = [programs.devices[r] for r in local]
    if ragged:
        components = ragged_components(x)
        return jax.device_put([components[r] for r in local], devices)
    return _by_device(x if replicated is None else replicated, devices)
