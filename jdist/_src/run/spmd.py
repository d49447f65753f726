"""``strategy.run``: a replica function as one cached SPMD program over the strategy's mesh.

``fn`` becomes ``jax.jit(jax.shard_map(body, check_vma=False))`` (TF's per-replica gradients,
`invariance`), traced once: outputs provably equal on every replica leave as `Mirrored`
(``P()``), the rest as `PerReplica`, without tracing again (`staged_outputs`). Ragged
arguments go to `uneven`.
"""

import dataclasses
import functools
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jdist._src.run import argument_paths
from jdist._src import context
from jdist._src import dispatch
from jdist._src import jax_internals
from jdist._src import errors
from jdist._src.run import fn_cache
from jdist._src import invariance
from jdist._src.run import merge
from jdist._src.run import arguments as run_arguments
from jdist._src.run import staged_outputs
from jdist._src.uneven import plan as uneven
from jdist._src.run.arguments import PER_REPLICA
from jdist._src.run.arguments import STATIC
from jdist._src.uneven.trace import OUTPUT
from jdist._src.values import ARRAYS
from jdist._src.values import DistributedValues
from jdist._src.values import Mirrored
from jdist._src.values import PerReplica
from jdist._src.values import is_distributed
from jdist._src.values import wrap_at


@dataclasses.dataclass(frozen=True)
class _Call:
    """One call's arguments as the program cache sees them."""
    kinds: tuple  # Per argument leaf: per-replica, mirrored, array or static.
    dynamic: list  # The arrays the program takes (placed on the mesh unless tracing).
    signature: tuple  # Per leaf: what selects the program (shapes, dtypes, static values).
    ragged: bool  # Whether some per-replica argument's replicas differ in shape.
    tracing: bool  # Whether the arguments are tracers (run inside jdist.function).


@dataclasses.dataclass(eq=False)  # Hashed by identity: jax.jit's fast path keys on it.
class _Program:
    function: Any  # The program as a traceable function (the direct program inlines it).
    out_tree: Any
    out_varying: tuple  # Per output array: whether it differs between replicas.
    out_statics: tuple  # Per output leaf: a Python object returned as it is, or `OUTPUT`.
    num_replicas: int
    token_index: Optional[int]  # The output the CPU guard waits on (the fast path's).

    def __post_init__(self):
        self.mirrored_at = tuple(i for i, v in enumerate(self.out_varying)
                                 if not v and self.num_replicas > 1)
        self.per_replica_at = tuple(i for i, v in enumerate(self.out_varying) if v)
        self.has_statics = any(st is not OUTPUT for st in self.out_statics)

    @functools.cached_property
    def jitted(self) -> Any:
        return jax.jit(self.function)


class ReplicatedRunner:
    """Runs replica functions as cached SPMD programs on a `replica_mesh.ReplicaMesh`."""

    def __init__(self, strategy: Any, programs: Any) -> None:
        self._strategy = strategy
        self._programs = programs
        self._mesh = programs.mesh
        self._axis = programs.axis_name
        self._guard = programs.guard
        self._n = programs.num_replicas
        self._caches = fn_cache.FunctionCaches()
        # The fast path hands argument checks and placement to jax.jit; across processes host
        # values must enter through the multi-worker strategy's own placement instead.
        self._fast_ok = all(d.process_index == jax.process_index()
                            for d in programs.mesh.devices.flat)

    @property
    def strategy(self) -> Any:
        """The strategy whose replica functions this runner compiles."""
        return self._strategy

    @property
    def programs(self) -> Any:
        """The strategy's `replica_mesh.ReplicaMesh` (mesh, shardings, dispatch guard)."""
        return self._programs

    def run(self, fn: Any, args: tuple, kwargs: dict) -> Any:
        """``strategy.run`` of ``fn``. Canonical arguments (on the mesh, replicated ones as
        `Mirrored`: a loop's steady state) go to the direct program, one ``jax.jit`` whose C++
        dispatch does the per-leaf work; others are made canonical first, or go general."""
        if jax_internals.JIT_DISABLED.value:
            # The replicas run as one compiled SPMD program: there is no eager one to fall to.
            with jax.disable_jit(False):
                return self.run(fn, args, kwargs)
        traced = dispatch.under_a_trace()
        if traced:
            dispatch.check_traced_run(self._guard)  # Before anything is dispatched.
        while isinstance(fn, functools.partial):  # Its arguments are arguments, as in jax.jit.
            fn, args, kwargs = fn.func, (*fn.args, *args), {**fn.keywords, **kwargs}
        cache = self._caches.get(fn)
        if traced or not self._fast_ok:
            if traced and context.in_merge():
                return self._run_in_merge(cache.fn, args, kwargs)
            return self._run_general(cache, args, kwargs)
        call, outputs = (args, kwargs), None
        if cache.direct is None:
            cache.direct = jax.jit(functools.partial(self._direct_body, cache))
            cache.token = functools.partial(_waited_outputs, cache)
        if not cache.flatten_first:
            try:
                outputs = self._guard.launch(cache.direct, call, cache.token)
            except (_NotCanonical, TypeError, ValueError, OverflowError) as refused:
                cache.flatten_first = cache.direct_missed  # Two in a row: not a one-off.
                cache.direct_missed = True
                if not isinstance(refused, _NotCanonical):  # A leaf jax.jit refuses (a
                    return self._run_general(cache, args, kwargs)  # string, an array elsewhere).
            else:
                cache.direct_missed = False
        if outputs is None:
            outputs = self._launch_canonical(cache, call)
            if outputs is None:
                return self._run_general(cache, args, kwargs)
        (number, arrays), = outputs.items()
        return self._wrap_outputs(cache.plans[number], arrays)

    def _launch_canonical(self, cache, call):
        """The direct program's outputs on ``call`` made canonical (None: it cannot be)."""
        placing = cache.placing
        if placing is not None:
            outputs = self._launch_placed_as_before(cache, placing, call)
            if outputs is not None:
                return outputs
            cache.placing = None
        canonical, changed = self._canonical(cache, call)
        if canonical is None:
            return None
        outputs = self._launch_direct(cache, canonical, changed)
        if outputs is None:
            return None
        (number, _), = outputs.items()
        if cache.placing is not None:  # The program the next call's placing is checked by.
            cache.placing = (cache.placing[0], number)
        return outputs

    def _launch_direct(self, cache, canonical, changed):
        if not changed:  # Arguments the direct program takes as they come: try it again.
            cache.flatten_first = False
        try:
            return self._guard.launch(cache.direct, canonical, cache.token)
        except (TypeError, ValueError):
            return None

    def _canonical(self, cache, call):
        """``(arguments, changed)``: ``call`` as the direct program takes it, or ``(None, False)``.
        Records in ``cache.placing`` the paths of the arrays it placed, for the next call."""
        leaves, tree = jax.tree_util.tree_flatten(call, is_leaf=is_distributed)
        if not all(run_arguments.fast_leaf(leaf, self._n) for leaf in leaves):
            return None, False
        place = self._programs
        placed = [run_arguments.placed(leaf, place) if is_distributed(leaf) else leaf
                  for leaf in leaves]
        plain = tuple(i for i, leaf in enumerate(placed) if not is_distributed(leaf))
        changed = any(new is not old for new, old in zip(placed, leaves))
        for i, x in zip(plain, place.place_replicated_all([placed[i] for i in plain])):
            placed[i] = x
        moved = plain if self._n > 1 else tuple(i for i in plain if placed[i] is not leaves[i])
        paths = None if changed else argument_paths.paths_of(call, moved, is_distributed)
        cache.placing = None if paths is None else (paths, None)
        if self._n > 1 and plain:
            wrap_at(placed, plain, self._n)
        return jax.tree_util.tree_unflatten(tree, placed), changed or bool(moved)

    def _launch_placed_as_before(self, cache, placing, call):
        """The direct program on ``call`` with only the last canonical call's placed paths
        placed again (a host batch every step: no Python work per parameter), or None."""
        paths, number = placing
        leaves = [argument_paths.leaf_at(call, path) for path in paths]
        if number is None or not all(
                isinstance(x, ARRAYS) and not is_distributed(x) for x in leaves):
            return None
        placed = self._programs.place_replicated_all(leaves)
        changed = self._n > 1 or any(x is not y for x, y in zip(placed, leaves))
        if self._n > 1:
            wrap_at(placed, range(len(placed)), self._n)
        for path, x in zip(paths, placed):
            call = argument_paths.with_leaf(call, path, x)
        try:
            outputs = self._launch_direct(cache, call, changed)
        except _NotCanonical:
            return None
        return outputs if outputs is not None and next(iter(outputs)) == number else None

    def _run_in_merge(self, fn, args, kwargs):
        """``run`` inside a traced ``merge_fn``, whose arguments hold every replica's values:
        the replicas run as one ``jax.vmap`` over an axis of their own."""
        leaves, in_tree = jax.tree_util.tree_flatten((args, kwargs), is_leaf=is_distributed)
        axis, in_axes, dynamic = f"{self._axis}_in_merge", [], []
        for leaf in leaves:
            if isinstance(leaf, PerReplica) and leaf.ragged:
                raise errors.UnevenValuesError(
                    "strategy.run inside a merge_fn got per-replica values of different shapes; "
                    "it runs the replicas as one vectorised program, which needs one shape. "
                    "Give the replicas one shape, or run the step outside the merge_fn.")
            in_axes.append(0 if isinstance(leaf, PerReplica) else None)
            dynamic.append(leaf.stacked if isinstance(leaf, PerReplica) else (
                leaf.value if isinstance(leaf, Mirrored) else leaf))

        def body(*values):
            return self._in_replica(context._Binding(axis, lax.axis_index(axis)), fn,
                                    *jax.tree_util.tree_unflatten(in_tree, values))
        out = jax.vmap(body, in_axes=in_axes, axis_name=axis, axis_size=self._n)(*dynamic)
        return jax.tree_util.tree_map(PerReplica._from_stacked, out)

    def _in_replica(self, binding, fn, args, kwargs):
        """``fn(*args, **kwargs)`` in the replica context of ``binding``, closed after it."""
        ctx = context.ReplicaContext(self._strategy, binding.replica_id, _binding=binding)
        try:
            with context.replica_scope(ctx):
                return fn(*args, **kwargs)
        finally:
            binding.active = False

    def _run_general(self, cache, args, kwargs):
        """Any arguments: classified leaf by leaf, placed, then the cached program (or plan)."""
        leaves, in_tree = jax.tree_util.tree_flatten((args, kwargs), is_leaf=is_distributed)
        call = self._classify(leaves)
        if call.ragged:
            return self._run_exact(cache, in_tree, call, leaves)
        program = self._program(cache, in_tree, call.kinds, call.signature, leaves)
        outputs = (program.jitted(*call.dynamic) if call.tracing  # Inside jdist.function.
                   else self._guard.dispatch(program.jitted, *call.dynamic))
        return self._wrap_outputs(program, outputs)

    def _classify(self, leaves):
        """The call's `_Call`, placing what is not yet on the mesh."""
        kinds, dynamic, signature, tracing, ragged = [], [], [], False, False
        for leaf in leaves:
            kind, value, entry, traced = run_arguments.classify_leaf(leaf, self._programs)
            kinds.append(kind)
            signature.append(entry)
            tracing = tracing or traced
            if kind != STATIC:
                dynamic.append(value)
            ragged = ragged or isinstance(leaf, PerReplica) and leaf.ragged
        return _Call(tuple(kinds), dynamic, tuple(signature), ragged, tracing)

    def _program(self, cache, in_tree, kinds, signature, leaves, build=None):
        """The cached program (or `uneven` plan, with ``build``) of these arguments."""
        key = run_arguments.program_key(in_tree, kinds, signature)
        program = cache.programs.get(key)
        if program is None:
            self._strategy.extended._check_host_arguments(in_tree, leaves)
            statics = run_arguments.trace_statics(leaves, kinds)
            program = cache.programs[key] = (build or self._compile)(
                cache.fn, in_tree, kinds, statics, leaves)
        return program

    def _direct_body(self, cache, args, kwargs):
        """The direct program's body: the general path on tracers of canonical arguments;
        others raise `_NotCanonical` before ``fn`` is traced, so they never compile."""
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs), is_leaf=is_distributed)
        if not all(self._is_canonical(leaf) for leaf in leaves):
            raise _NotCanonical()
        leaves = [leaf.value if isinstance(leaf, Mirrored) else leaf for leaf in leaves]
        call = self._classify(leaves)
        program = self._program(cache, tree, call.kinds, call.signature, leaves)
        outputs = program.function(*call.dynamic)  # Inlined: a jit level fewer to lower.
        # Flat, keyed by program number: a custom pytree node would turn jit's C++ path off.
        return {cache.plan_number(program): tuple(outputs)}

    def _is_canonical(self, leaf):
        """Whether a direct program's traced argument came placed on this mesh (its type says)."""
        if isinstance(leaf, PerReplica):
            if leaf.ragged or leaf.num_replicas != self._n:
                return False
            leaf = leaf.stacked
        elif isinstance(leaf, Mirrored):
            leaf = leaf.value
        elif self._n > 1:
            return False  # Replicated values arrive as `Mirrored`, as run returns them.
        return (isinstance(leaf, jax.core.Tracer)
                and jax.typeof(leaf).sharding.mesh == self._mesh.abstract_mesh)

    def _compile(self, fn, in_tree, kinds, statics, leaves):
        n = self._n
        abstract = [run_arguments.abstract(leaf, kind) for leaf, kind in zip(leaves, kinds)
                    if kind != STATIC]
        traced, eqn, record = self.trace(fn, in_tree, kinds, statics, abstract, staged=True)
        inner = eqn.params["jaxpr"]
        replicated_in = [all(a is None for a in spec) for spec in eqn.params["in_specs"]]
        same = ([True] * len(inner.outvars) if n == 1
                else invariance.same_outputs(inner, replicated_in))
        program = staged_outputs.staged_program(record["staged"], same, self._mesh, self._axis)
        varying = tuple(not s for s in same)
        # The CPU guard waits on the smallest output: a device's outputs are ready at once.
        sizes = [math.prod(shape) * (1 if s else n) for s, shape in zip(same, record["shapes"])]
        token = min(range(len(sizes)), key=sizes.__getitem__, default=None)
        return _Program(program, record["tree"], varying, record["statics"], n, token)

    def trace(self, fn: Any, in_tree: Any, kinds: tuple, statics: list, abstract: list,
              exact: Any = None, staged: bool = False) -> tuple:
        """``(traced, eqn, record)`` of ``fn`` traced as a ``shard_map`` body: the closed jaxpr,
        its ``shard_map`` equation, the outputs' ``tree``, ``statics``, ``shapes`` (and with
        ``staged``, the ``jit(shard_map)`` jaxpr). ``exact``: an `uneven_trace` replica state."""
        axis, record = self._axis, {}

        def body(*arrays):
            it = iter(arrays)
            values = [static if kind == STATIC else next(it)[0] if kind == PER_REPLICA
                      else next(it) for kind, static in zip(kinds, statics)]
            out = self._in_replica(context._Binding(axis, lax.axis_index(axis), exact=exact), fn,
                                   *jax.tree_util.tree_unflatten(in_tree, values))
            out_leaves, record["tree"] = jax.tree_util.tree_flatten(out, is_leaf=is_distributed)
            record["statics"] = tuple(_output_static(x) for x in out_leaves)
            returned = [x for x, st in zip(out_leaves, record["statics"]) if st is OUTPUT]
            arrays = [jnp.asarray(x) for x in returned]
            record["shapes"] = tuple(x.shape for x in arrays)
            return [x[None] for x in arrays]

        in_specs = [P(axis) if k == PER_REPLICA else P() for k in kinds if k != STATIC]
        mapped = jax.shard_map(body, mesh=self._mesh, in_specs=tuple(in_specs),
                               out_specs=P(axis), check_vma=False)
        if staged:
            record["staged"] = jax.make_jaxpr(jax.jit(mapped))(*abstract)
            (call,) = record["staged"].jaxpr.eqns
            traced = call.params["jaxpr"]
        else:
            traced = jax.make_jaxpr(mapped)(*abstract)
        (eqn,) = traced.jaxpr.eqns
        return traced, eqn, record

    def _run_exact(self, cache, in_tree, call, leaves):
        """``run`` on ragged inputs: every replica computes with its own shapes (`uneven`)."""
        if dispatch.under_a_trace():
            raise errors.UnevenValuesError(
                "strategy.run got per-replica values of different shapes while being traced "
                "(inside jax.jit, lax.scan or jdist.function); a traced program has one shape "
                "per value, so it cannot give each replica its own. Pass the values to "
                "jdist.function as arguments (it runs its function as Python for such a batch), "
                "call strategy.run outside the jitted function for this batch, or batch the data "
                "with drop_remainder=True.")
        # Across workers: agree on every replica's shapes before any collective runs.
        self._strategy.extended._agree_uneven_step(call.signature)
        plan = self._program(cache, in_tree, call.kinds, call.signature, leaves,
                             functools.partial(self._plan, dynamic=call.dynamic))
        return plan(call.dynamic)

    def _plan(self, fn, in_tree, kinds, statics, leaves, dynamic):
        abstract = [[run_arguments.abstract(leaf, kind, replica=r)
                     for leaf, kind in zip(leaves, kinds) if kind != STATIC]
                    for r in range(self._n)]
        return uneven.plan(self, fn, in_tree, kinds, statics, dynamic, abstract)

    def _wrap_outputs(self, program, outputs):
        wrapped = list(outputs)
        wrap_at(wrapped, program.mirrored_at, self._n, program.per_replica_at)
        if program.has_statics:  # Python objects the function returned, TF's regroup.
            arrays = iter(wrapped)
            wrapped = [next(arrays) if st is OUTPUT else st for st in program.out_statics]
        return program.out_tree.unflatten(wrapped)

    def merge_call(self, binding: Any, merge_fn: Any, args: tuple, kwargs: dict) -> Any:
        """A replica context's ``merge_call`` while its function is traced (`merge`)."""
        return merge.merge_call(self._strategy, self._n, binding, merge_fn, args, kwargs)


class _NotCanonical(Exception):
    """Raised while the direct program traces arguments `_canonical` did not prepare."""


def _waited_outputs(cache, outputs):
    """What the CPU guard waits on of a direct program's outputs: its smallest array."""
    (number, arrays), = outputs.items()
    index = cache.plans[number].token_index
    return () if index is None else (arrays[index],)


def _output_static(x):
    """`OUTPUT` for a returned array; a Python object as it is (TF's regroup)."""
    if isinstance(x, DistributedValues):
        raise errors.UnsupportedValueError(
            f"the replica function returned a {type(x).__name__}; inside strategy.run return "
            "per-replica arrays (merge_call results are already unpacked per replica).")
    return OUTPUT if isinstance(x, ARRAYS) else x

