"""Tracing a replica function for an uneven step (`uneven`): per replica, merge_calls resolved.

Calls that hold a collective are inlined. A ``merge_call``'s result shapes are known only once
every replica reaches it, so tracing stops there (`_Suspend`), ``merge_fn`` is traced on every
replica's arguments, and the replicas are traced again. Checks what the replicas must agree on.
"""

import dataclasses
import functools
import itertools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.xla_metadata import set_xla_metadata
from jax.extend import core, source_info_util

from jdist._src import context, errors, host_values
from jdist._src.base import PER_REPLICA, STATIC
from jdist._src.uneven import schedule as uneven_schedule
from jdist._src.uneven.merge import MergeBody, merge_p
from jdist._src.values import ARRAYS, DistributedValues, Mirrored, PerReplica, is_distributed

# Collective primitives: each is a cut of the step.
COLLECTIVES = frozenset({"psum", "pmax", "pmin", "all_gather", "ppermute", "all_to_all",
                         "psum_scatter", "reduce_scatter", "pgather", "psum_invariant",
                         "all_gather_invariant"})

_OPERAND = object()  # Marks the array positions among a merge_call's flattened arguments.
OUTPUT = object()  # Marks the arrays among a replica function's output leaves (`spmd.trace`).


class _Suspend(BaseException):
    """Stops tracing one replica at a merge_call whose result shapes are not known yet (a
    BaseException: a user's ``except Exception`` does not swallow it)."""

    def __init__(self, index, request):
        super().__init__(index)
        self.index, self.request = index, request


@dataclasses.dataclass(frozen=True)
class _MergeRequest:
    """What one replica passed to a merge_call."""
    merge_fn: Any
    tree: Any
    statics: tuple  # The non-array leaves; `_OPERAND` where an array goes.
    avals: tuple  # The avals of the array leaves.


@dataclasses.dataclass(frozen=True)
class Merge:
    """A resolved merge_call: its traced ``merge_fn`` and what each replica receives."""
    out_tree: Any
    out_statics: tuple  # Per output leaf: a Python object, or `_OPERAND` for an array.
    out_same: tuple  # Per array output: whether every replica receives the same value.
    replica_avals: tuple  # Per replica: the avals of its array outputs.
    replica_outputs: tuple  # Per replica: indices of its array outputs among `run`'s results.
    replica_in_avals: tuple  # Per replica: the avals of its array arguments.
    run: Any  # Jitted: every replica's operand blocks, replica by replica -> result blocks.
    numbers: frozenset  # Argument leaves that are Python numbers differing between replicas.
    body: MergeBody

    def rebuild(self, arrays: list) -> Any:
        it = iter(arrays)
        leaves = [next(it) if s is _OPERAND else s for s in self.out_statics]
        return jax.tree_util.tree_unflatten(self.out_tree, leaves)


class _ReplicaTrace:
    """The replica context's view of one replica's trace (`context._Binding.exact`)."""

    def __init__(self, resolved, replica):
        self._resolved, self._replica, self._count = resolved, replica, 0

    def merge_call(self, merge_fn: Any, args: tuple, kwargs: dict) -> Any:
        """The replica's result of a merge_call."""
        index, self._count = self._count, self._count + 1
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs), is_leaf=is_distributed)
        merge = self._resolved.get(index)
        if merge is not None and merge.numbers:
            leaves = [_number_array(x) if i in merge.numbers else x for i, x in enumerate(leaves)]
        operands = [leaf for leaf in leaves if _is_array(leaf)]
        if merge is None:
            statics = tuple(_OPERAND if _is_array(leaf) else leaf for leaf in leaves)
            avals = tuple(jax.typeof(jnp.asarray(x)) for x in operands)
            raise _Suspend(index, _MergeRequest(merge_fn, tree, statics, avals))
        outs = merge_p.bind(*operands, index=index, out_avals=merge.replica_avals[self._replica],
                            out_same=merge.out_same, gathers=merge_fn is _gather_all,
                            merge_body=merge.body)
        return merge.rebuild(outs)

    def all_gather(self, value, axis, all_sum, axis_name):
        """Every replica's ``value`` concatenated along ``axis``, sizes differing: a merge_call.
        Its gradient is TF's: each replica's rows of ``all_sum`` of the upstream gradients
        (where they start read at ``axis_name``'s index: replicas of one shape share a trace)."""
        leaves, tree = jax.tree_util.tree_flatten(value)
        arrays = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]
        starts = []  # Per array: where each replica's rows start, and the axis.

        @jax.custom_vjp
        def gather(*xs):
            flat = list(leaves)
            for i, x in zip(arrays, xs):
                flat[i] = x
            gathered = self.merge_call(_gather_all, (tree.unflatten(flat), axis), {})
            return tuple(jax.tree_util.tree_leaves(gathered)[i] for i in arrays)

        def forward(*xs):
            result = gather(*xs)
            in_avals = self._resolved[self._count - 1].replica_in_avals
            starts[:] = [_row_starts(in_avals, j, axis) for j in range(len(xs))]
            return result, tuple(x.shape for x in xs)

        def backward(shapes, cotangents):
            summed = iter(all_sum([c for c in cotangents if _differentiable(c)]))
            replica = lax.axis_index(axis_name)
            return tuple(
                lax.dynamic_slice_in_dim(next(summed), jnp.asarray(start)[replica],
                                         shape[a], axis=a) if _differentiable(c) else None
                for c, shape, (start, a) in zip(cotangents, shapes, starts))

        gather.defvjp(forward, backward)
        gathered = iter(gather(*(leaves[i] for i in arrays)))
        return tree.unflatten([next(gathered) if i in arrays else leaf
                               for i, leaf in enumerate(leaves)])


def _row_starts(in_avals, j, axis):
    a = axis % len(in_avals[0][j].shape)
    sizes = [avals[j].shape[a] for avals in in_avals]
    return np.cumsum([0] + sizes[:-1], dtype=np.int32), a


def _differentiable(cotangent):
    return jnp.issubdtype(cotangent.dtype, jnp.inexact)


def _gather_all(strategy, value, axis):
    return jax.tree_util.tree_map(lambda v: strategy.gather(v, axis), value,
                                  is_leaf=is_distributed)


def _is_array(x):
    return isinstance(x, ARRAYS)


@dataclasses.dataclass(frozen=True)
class Trace:
    """One replica's traced body, flat (no collective inside a call)."""
    jaxpr: Any  # The shard_map body: blocks in, blocks out.
    sources: tuple  # Per body input: ("arg", i) for dynamic argument i, or ("const", value).
    replicated_in: tuple  # Per body input: whether it is the same on every replica.
    out_tree: Any
    out_statics: tuple  # Per output leaf: a Python object the replica returned, or `OUTPUT`.

    @functools.cached_property
    def cuts(self) -> tuple:
        return tuple(i for i, e in enumerate(self.jaxpr.eqns) if is_cut(e))


def is_cut(eqn: core.JaxprEqn) -> bool:
    return (eqn.primitive.name in COLLECTIVES or eqn.primitive is merge_p
            or eqn.primitive is uneven_schedule.collectives_p)


def _has_cut(jaxpr):
    return any(is_cut(e) or any(_has_cut(j) for j in core.jaxprs_in_params(e.params))
               for e in jaxpr.eqns)


# Call-like primitives: their sub-program runs once on the operands, so it can be inlined.
_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "remat", "remat2", "checkpoint",
                    "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})


def _call_body(eqn):
    """The closed sub-program of a call-like equation taking its operands one to one, or None."""
    if eqn.primitive.name not in _CALLS:
        return None
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = eqn.params.get(key)
        if isinstance(sub, core.Jaxpr):
            sub = core.ClosedJaxpr(sub, ())
        if isinstance(sub, core.ClosedJaxpr) and len(sub.jaxpr.invars) == len(eqn.invars):
            return sub
    return None


def _eval_inlined(jaxpr, consts, args):
    """Evaluates ``jaxpr`` (each equation with its name stack), inlining calls holding a cut."""
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))

    def read(v):
        return v.val if isinstance(v, core.Literal) else env[v]
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        sub = _call_body(eqn)
        names = source_info_util.current_name_stack() + eqn.source_info.name_stack
        with source_info_util.user_context(eqn.source_info.traceback, name_stack=names):
            if sub is not None and _has_cut(sub.jaxpr):
                outs = _eval_inlined(sub.jaxpr, sub.consts, invals)
            else:
                with eqn.ctx.manager:
                    outs = eqn.primitive.bind(*invals,
                                              **eqn.primitive.get_bind_params(eqn.params))
                outs = outs if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _sources(traced, eqn, outer_sources=None):
    """Where each operand of the shard_map equation comes from (see `Trace.sources`)."""
    args = {v: i for i, v in enumerate(traced.jaxpr.invars)}
    consts = dict(zip(traced.jaxpr.constvars, traced.consts))
    out = []
    for v in eqn.invars:
        if isinstance(v, core.Literal):
            out.append(("const", v.val))
        elif v in args:
            i = args[v]
            out.append(("arg", i) if outer_sources is None else outer_sources[i])
        else:
            out.append(("const", consts[v]))
    return tuple(out)


def _flat_trace(traced, eqn, mesh, out_tree, out_statics):
    """The `Trace` of a traced body, re-traced with cut-holding calls inlined if it has any."""
    sources = _sources(traced, eqn)
    inner = eqn.params["jaxpr"]
    if any(not is_cut(e) and _call_body(e) is not None and _has_cut(_call_body(e).jaxpr)
           for e in inner.eqns):
        avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype,
                                      weak_type=getattr(v.aval, "weak_type", False))
                 for v in eqn.invars]
        mapped = jax.shard_map(lambda *a: tuple(_eval_inlined(inner, (), a)), mesh=mesh,
                               in_specs=eqn.params["in_specs"],
                               out_specs=eqn.params["out_specs"], check_vma=False)
        traced = jax.make_jaxpr(mapped)(*avals)
        (eqn,) = traced.jaxpr.eqns
        sources, inner = _sources(traced, eqn, sources), eqn.params["jaxpr"]
    for e in inner.eqns:
        if not is_cut(e) and any(_has_cut(j) for j in core.jaxprs_in_params(e.params)):
            raise errors.UnevenValuesError(
                f"strategy.run got per-replica values of different shapes, and the step calls a "
                f"collective (all_reduce, all_gather or merge_call) inside `{e.primitive.name}` "
                "(lax.scan, lax.while_loop, lax.cond or a custom derivative rule): each replica "
                "would run that loop with its own shapes, which one collective program cannot "
                "do. Move the collective out of the loop, run this batch's steps one by one outside "
                "it, or batch the data with drop_remainder=True.")
    replicated = tuple(all(a is None for a in spec) for spec in eqn.params["in_specs"])
    return Trace(inner, sources, replicated, out_tree, out_statics)


def _resolve_merge(strategy, requests):
    """Traces the merge_fn of one merge_call on every replica's arguments."""
    numbers = _differing_numbers(requests)
    requests = [_numbers_as_operands(r, numbers) for r in requests]
    first, n = requests[0], len(requests)
    for request in requests[1:]:
        if request.tree != first.tree or len(request.avals) != len(first.avals) or any(
                not (a is b or a is _OPERAND or _equal(a, b))
                for a, b in zip(first.statics, request.statics)):
            raise errors.UnevenValuesError(
                "the replicas called merge_call with arguments of different structures; every "
                "replica must pass the same nest (arrays may differ in shape).")
    counts = [len(r.avals) for r in requests]
    record = {}

    def merge_body(*blocks):
        values = iter(b[0] for b in blocks)
        per_replica = [[next(values) for _ in range(c)] for c in counts]
        views = iter(PerReplica._from_components([per_replica[r][j] for r in range(n)])
                     for j in range(counts[0]))
        leaves = [next(views) if s is _OPERAND else s for s in first.statics]
        args, kwargs = jax.tree_util.tree_unflatten(first.tree, leaves)
        with context.cross_replica_scope(strategy, in_merge=True):
            result = first.merge_fn(strategy, *args, **kwargs)
        out_leaves, record["tree"] = jax.tree_util.tree_flatten(result, is_leaf=is_distributed)
        record["leaves"] = out_leaves
        return [jnp.asarray(x)[None] for x in _merge_outputs(out_leaves, n)]

    avals = [jax.ShapeDtypeStruct((1,) + a.shape, a.dtype) for r in requests for a in r.avals]
    closed = jax.make_jaxpr(merge_body)(*avals)
    return _merge_from(closed, record["tree"], record["leaves"], n,
                       tuple(r.avals for r in requests), numbers)


def _differing_numbers(requests):
    """The argument leaves where the replicas passed differing Python numbers (``x.shape[0]``):
    TF regroups them into a PerReplica of int32 or float32 tensors."""
    columns = zip(*(r.statics for r in requests)) if len({len(r.statics) for r in requests}) == 1 \
        else ()
    return frozenset(i for i, column in enumerate(columns)
                     if all(isinstance(x, (int, float)) and not isinstance(x, bool)
                            for x in column) and len(set(column)) > 1)


def _numbers_as_operands(request, numbers):
    if not numbers:
        return request
    statics, avals, arrays = list(request.statics), [], iter(request.avals)
    for i, leaf in enumerate(request.statics):
        if i in numbers:
            statics[i] = _OPERAND
            avals.append(jax.typeof(_number_array(leaf)))
        elif leaf is _OPERAND:
            avals.append(next(arrays))
    return dataclasses.replace(request, statics=tuple(statics), avals=tuple(avals))


def _number_array(x):
    """A Python number as TF converts it (an int to int32, a float to float32)."""
    return jnp.asarray(host_values.python_numbers_as_tf(x))


def _merge_outputs(out_leaves, n):
    """The arrays of a merge result, flat: a PerReplica leaf gives its n components."""
    flat = []
    for leaf in out_leaves:
        if isinstance(leaf, PerReplica):
            if leaf.num_replicas != n:
                raise errors.InvalidArgumentError(
                    f"merge_fn returned a PerReplica with {leaf.num_replicas} components; the "
                    f"strategy has {n} replicas.")
            flat.extend(leaf.values)
        elif isinstance(leaf, Mirrored):
            flat.append(leaf.value)
        elif _is_array(leaf):
            flat.append(leaf)
        elif isinstance(leaf, DistributedValues):
            raise errors.UnsupportedValueError(
                f"merge_fn returned a {type(leaf).__name__}; return arrays, PerReplica or "
                "Mirrored values, or Python objects.")
    return flat


def _merge_from(closed, out_tree, out_leaves, n, in_avals, numbers):
    statics, same, outputs, position = [], [], [[] for _ in range(n)], 0
    for leaf in out_leaves:
        stacked = isinstance(leaf, PerReplica)  # A PerReplica's n components, one per replica.
        if not (stacked or isinstance(leaf, Mirrored) or _is_array(leaf)):
            statics.append(leaf)
            continue
        for r in range(n):
            outputs[r].append(position + r if stacked else position)
        position += n if stacked else 1
        same.append(not stacked)
        statics.append(_OPERAND)
    out_avals = [jax.core.ShapedArray(a.shape[1:], a.dtype) for a in closed.out_avals]
    outs = tuple(tuple(o) for o in outputs)
    return Merge(out_tree, tuple(statics), tuple(same),
                 tuple(tuple(out_avals[i] for i in o) for o in outs), outs, in_avals,
                 jax.jit(core.jaxpr_as_fun(closed)), numbers,
                 MergeBody(closed, len(in_avals[0]), outs))


def _equal(a, b):
    try:
        return bool(a == b)
    except Exception:  # pylint: disable=broad-except
        return False


def dynamic_kinds(kinds: tuple) -> list:
    return [k for k in kinds if k != STATIC]


def _row_counts(abstract, kinds):
    """The leading sizes (rows) of the replica's per-replica inputs."""
    return {a.shape[1] for a, k in zip(abstract, dynamic_kinds(kinds))
            if k == PER_REPLICA and len(a.shape) >= 2}


# Added to an error the replica function raised on an empty batch: JAX's does not say why.
_EMPTY_BATCH = (
    "jdist: replica {replica} ran on an empty batch (0 rows): a partial last batch with fewer "
    "rows than replicas leaves some empty, as in TF. JAX's reductions without an identity "
    "(jnp.max, jnp.min, jnp.argmax, jnp.argmin) raise on empty arrays where TF's reduce_max and "
    "reduce_min return -inf and inf: pass initial= (jnp.max(x, initial=-jnp.inf)), branch on "
    "x.shape[0], or batch with drop_remainder=True.")


def trace_replicas(runner: Any, fn: Any, in_tree: Any, kinds: tuple, statics: list,
                   per_replica: list) -> tuple:
    """Each replica's `Trace`, traced once per distinct signature, merges resolved in order."""
    resolved: dict = {}
    while True:
        keys, traces, suspended = [], {}, {}
        for r, abstract in enumerate(per_replica):
            key = (tuple((a.shape, a.dtype) for a in abstract),
                   tuple(resolved[k].replica_avals[r] for k in sorted(resolved)))
            keys.append(key)
            if key in traces or key in suspended:
                continue
            state = _ReplicaTrace(resolved, r)
            try:
                with _fresh_inner_traces():
                    traced, eqn, record = runner.trace(fn, in_tree, kinds, statics, abstract,
                                                       exact=state)
            except _Suspend as stop:
                suspended[key] = stop
                continue
            except Exception as error:
                if 0 in _row_counts(abstract, kinds):  # A partial batch's empty replica.
                    error.add_note(_EMPTY_BATCH.format(replica=r))
                raise
            traces[key] = _flat_trace(traced, eqn, runner.programs.mesh, record["tree"],
                                      record["statics"])
        if not suspended:
            traces = _grouped(traces)
            return [traces[key] for key in keys], resolved
        if traces or len({s.index for s in suspended.values()}) != 1:
            raise errors.UnevenValuesError(
                "the replicas called merge_call or all_gather different numbers of times; every "
                "replica must reach the same collectives in the same order.")
        index = len(resolved)
        resolved[index] = _resolve_merge(runner.strategy,
                                         [suspended[key].request for key in keys])


_TRACE_NUMBERS = itertools.count()


def _fresh_inner_traces():
    """A context in which the ``jax.jit`` functions a replica function calls trace anew: a
    merge_call inside binds shapes that depend on the other replicas. ``jax.jit``'s cache keys on
    XLA metadata (which XLA ignores), so a number per replica trace keeps its jaxprs its own."""
    return set_xla_metadata(jdist_replica_trace=next(_TRACE_NUMBERS))


def _grouped(traces):
    """``traces`` with their independent all-reduces grouped (`uneven_schedule`) where every
    trace groups them alike (code branching on a shape may not), else as they are."""
    grouped = {key: dataclasses.replace(t, jaxpr=uneven_schedule.grouped_collectives(
        t.jaxpr, is_cut)) for key, t in traces.items()}
    cuts = {tuple(_describe(t.jaxpr.eqns[i]) for i in t.cuts) for t in grouped.values()}
    return grouped if len(cuts) == 1 else traces


def _describe(eqn):
    if eqn.primitive is merge_p:
        return ("merge_call", eqn.params["index"])
    return (eqn.primitive.name, tuple(sorted((k, repr(v)) for k, v in eqn.params.items())))


def check_cuts(traces: list) -> None:
    """Every replica must reach the same collectives; an all_reduce needs one shape (TF)."""
    first = traces[0]
    for t in traces[1:]:
        if [_describe(first.jaxpr.eqns[i]) for i in first.cuts] != [
                _describe(t.jaxpr.eqns[i]) for i in t.cuts]:
            raise errors.UnevenValuesError(
                "the replicas reached different collectives (all_reduce, all_gather, merge_call) "
                "with their own shapes; every replica must call the same collectives in the same "
                "order. Make the collectives independent of the batch size.")
        if first.out_tree != t.out_tree or [st is OUTPUT for st in first.out_statics] != [
                st is OUTPUT for st in t.out_statics]:
            raise errors.UnevenValuesError(
                "the replica function returned different structures on replicas with different "
                f"batch shapes: {first.out_tree} and {t.out_tree}.")
    for k, i in enumerate(first.cuts):
        eqn = first.jaxpr.eqns[i]
        if eqn.primitive is merge_p:
            continue
        shapes = {tuple((tuple(v.aval.shape), str(v.aval.dtype))
                        for v in t.jaxpr.eqns[t.cuts[k]].invars) for t in traces}
        if len(shapes) > 1:
            raise errors.ShapeMismatchError(
                f"a collective ({eqn.primitive.name}, e.g. ReplicaContext.all_reduce) got values "
                f"of different shapes on different replicas: {sorted(shapes)}. Collectives "
                "combine the replicas element-wise and need one shape, as in TF; reduce inside "
                "each replica first (e.g. jnp.sum over the batch) before the all_reduce.")


def output_forms(traces: list) -> list:
    """Per trace, a canonical id of each output's computation: equal ids across traces mean the
    output is computed the same way from the same inputs (constants and shapes included)."""
    interned: dict = {}

    def intern(key):
        return interned.setdefault(key, len(interned))
    forms = []
    for t in traces:
        env = {v: intern(("in", i, str(v.aval))) for i, v in enumerate(t.jaxpr.invars)}
        for k, i in enumerate(t.cuts):
            env.update((v, intern(("cut", k, j))) for j, v in enumerate(t.jaxpr.eqns[i].outvars))

        def read(a):
            return intern(("lit", repr(a.val), str(a.aval))) if isinstance(a, core.Literal) else (
                env[a])
        for i, e in enumerate(t.jaxpr.eqns):
            if i in t.cuts:
                continue
            key = (e.primitive.name, repr(sorted(e.params.items())), tuple(map(read, e.invars)))
            env.update((v, intern(key + (j, str(v.aval)))) for j, v in enumerate(e.outvars))
        forms.append([read(a) for a in t.jaxpr.outvars])
    return forms

