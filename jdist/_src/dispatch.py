"""The CPU dispatch guard: never two collective programs in flight on the CPU runtime.

JAX's CPU runtime can deadlock when a collective program is dispatched while the previous one
still runs on some simulated devices (XLA aborts after 40 s, ``docs/cpu_devices.md``). Waiting
for the previous program first removes the hang at no measurable cost. User programs around
``strategy.run`` go through the guard when compiled with `function`; ``strategy.run`` refuses to
be traced into any other (`check_traced_run`). On GPU and TPU the guard is off.
"""

import contextlib
import functools
import threading
from typing import Any, Callable, Optional, Sequence

import jax
from jax.extend import core

from jdist._src import context, errors, host_values, jax_internals
from jdist._src.values import ARRAYS, Mirrored, PerReplica, SCALARS, is_distributed, is_step_output


class DispatchGuard:
    """Serialises collective programs on one platform: call `dispatch` around each launch."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.observer: Optional[Callable[[], None]] = None  # The multi-worker watchdog's.
        self._lock = threading.Lock()
        self._in_flight: tuple = ()
        self._owner: Optional[int] = None  # The thread inside a launch (maybe tracing it).

    def dispatch(self, program: Callable[..., Any], *args: Any,
                 spans_all_devices: bool = True) -> Any:
        """Runs ``program(*args)`` after the previous guarded program has finished.

        ``spans_all_devices``: every output lives on all the program's devices (jdist's own
        programs), so waiting on one waits for the whole program; else all are waited on.
        """
        def waited(outputs):
            leaves = [x for x in jax.tree_util.tree_leaves(outputs)
                      if hasattr(x, "block_until_ready")]
            return tuple(leaves[:1] if spans_all_devices else leaves)
        return self.launch(program, args, waited)

    def launch(self, program: Callable[..., Any], args: Sequence[Any],
               waited: Callable[[Any], tuple]) -> Any:
        """`dispatch` where the next launch waits on ``waited(outputs)``, arrays the caller picks
        (so the guard never walks a large output tree)."""
        if self.observer is not None:
            self.observer()
        if not self.enabled:
            return program(*args)
        thread = threading.get_ident()
        if self._owner == thread:  # `inside_launch`, read once: this runs on every step.
            return _launch_while_tracing(program, args, waited)
        with self._lock:
            self._owner = thread
            try:
                try:
                    _ready(self._in_flight)  # One C++ call: this runs on every step.
                except RuntimeError:
                    _wait(self._in_flight)  # One was deleted: the others one by one.
                outputs = program(*args)
                self._in_flight = waited(outputs)
            finally:
                self._owner = None
            return outputs

    def inside_launch(self) -> bool:
        """Whether this thread is inside a launch (tracing its program, or code that runs)."""
        return self._owner == threading.get_ident()

    def wait(self) -> None:
        """Blocks until the last guarded program has finished (used before host-side reads)."""
        if self.inside_launch():
            return  # The launch waited for the last program before tracing.
        with self._lock:
            _wait(self._in_flight)
            self._in_flight = ()


def _launch_while_tracing(program, args, waited):
    """A launch from inside another one's trace on this thread (a merge_fn's reduce, a `function`
    in a replica function): the outer launch waited already, so this one runs alone."""
    if jax.sharding.get_abstract_mesh().manual_axes and not any(
            isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(args)):
        raise errors.WrongContextError(
            "a merge_fn computed on a distributed value from outside the step (captured, not "
            "passed in): jdist traces merge_fn into the step's program, which cannot run another "
            "program on such a value. Pass the value to strategy.run and on to merge_call "
            "(merge_call(fn, args=(value,))), or compute it before strategy.run.")
    outputs = program(*args)
    _wait(waited(outputs))
    return outputs


_ready = jax_internals.batched_block_until_ready  # One C++ call.


def _wait(arrays):
    for array in arrays:
        try:
            array.block_until_ready()
        except RuntimeError:
            pass  # Deleted (donated to a later program): that program ran after it.


class _FunctionTrace(threading.local):
    """How many `function` calls are under way on this thread, and how many run as Python."""
    def __init__(self):
        self.depth = 0
        self.as_python = 0


_function_trace = _FunctionTrace()


@contextlib.contextmanager
def _counted(field):
    """Counts in ``_function_trace.<field>`` the calls under way."""
    setattr(_function_trace, field, getattr(_function_trace, field) + 1)
    try:
        yield
    finally:
        setattr(_function_trace, field, getattr(_function_trace, field) - 1)


def check_traced_run(guard: DispatchGuard) -> None:
    """Raises `UnguardedTraceError` when ``strategy.run`` is being traced into an unguarded program.

    On several CPU devices a ``strategy.run`` traced by ``jax.jit``, ``lax.scan``, ... is part
    of a collective program JAX launches outside the guard; that is allowed only while a
    `function` call or a jdist replica function (a ``merge_fn``) traces it.

    Args:
      guard: the `DispatchGuard` of the strategy whose ``run`` is called.
    """
    if not guard.enabled or _function_trace.depth or not under_a_trace():
        return
    if context.in_replica_trace() or context.in_merge():
        return  # Part of a program jdist traces and launches itself.
    if _function_trace.as_python:
        raise errors.UnevenValuesError(
            "strategy.run was traced (inside lax.scan, jax.jit or another transformation) while "
            "jdist.function ran its function as Python, because its arguments hold per-replica "
            "values of different shapes (a partial batch), which no compiled program can hold. "
            "Call strategy.run directly in the function for such a batch, or batch the data "
            "with drop_remainder=True.")
    raise errors.UnguardedTraceError(
        "strategy.run was traced inside jax.jit, lax.scan, jax.grad or another JAX "
        "transformation that jdist does not launch. On several CPU devices that program's "
        "collectives run outside jdist's dispatch guard, and programs launched back to back "
        "deadlock in the all-reduce rendezvous (XLA then aborts the process). Compile the "
        "outermost function with jdist.function instead of jax.jit (the same jit, launched "
        "through the guard), e.g. train = jdist.function(lambda w, x: strategy.run(step, "
        "args=(w, x))); lax.scan and jax.grad inside it are fine.")


def under_a_trace() -> bool:
    """Whether a JAX transformation is tracing on this thread (not plain eager evaluation)."""
    return type(jax_internals.TRACE_STATE.value) is not _EVAL_TRACE


_EVAL_TRACE = type(core.find_top_trace(()))  # The eager trace, at the bottom of every stack.


def under_a_staging_trace() -> bool:
    """Whether this thread's code is being staged into a program (``jax.jit``, ``lax.scan``, at
    any depth), not only under an eager ``jax.grad`` or ``jax.vmap``."""
    trace = core.find_top_trace(())
    while trace is not None and type(trace).__name__ != "EvalTrace":  # Eager: the bottom one.
        if type(trace).__name__ == "DynamicJaxprTrace":
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


def function(fun: Optional[Callable[..., Any]] = None, **jit_kwargs: Any) -> Any:
    """``jax.jit`` for functions that call ``strategy.run``: the ``tf.function`` of jdist.

    Each call goes through the CPU dispatch guard as jdist's own programs do (on GPU and TPU it
    adds nothing); on several CPU devices a ``strategy.run`` traced by a plain ``jax.jit``
    raises `UnguardedTraceError` instead. Arguments holding per-replica values of different
    shapes (a partial batch) have no compiled program: ``fun`` then runs as Python, as TF's
    ``tf.function`` retraces for them.

    Args:
      fun: the function to compile (omit it to use ``jdist.function(**jit_kwargs)`` as a
        decorator).
      **jit_kwargs: passed to ``jax.jit`` (``static_argnums``, ``donate_argnums``, ...).

    Returns:
      The compiled function, with ``.lower(*args)`` as ``jax.jit``'s and the ``jax.jit``
      object as ``.jitted``.

    Example:
      >>> import jax, jax.numpy as jnp, jdist
      >>> s = jdist.MirroredStrategy(jax.devices()[:2])
      >>> @jdist.function
      ... def two_steps(w):
      ...   for _ in range(2):
      ...     w = s.run(lambda w: w + jdist.get_replica_context().all_reduce("sum", 1.0),
      ...               args=(w,))
      ...   return w
      >>> float(two_steps(jnp.float32(0.0)))
      4.0
    """
    if fun is None:
        return lambda f: function(f, **jit_kwargs)
    if not callable(fun):
        raise errors.UnsupportedValueError(
            f"jdist.function expects a function, got {type(fun).__name__}.")
    guarded = _GuardedFunction(fun, jit_kwargs)

    def call(*args, **kwargs):  # A plain function: a method decorated with it binds.
        return guarded(args, kwargs)
    vars(call).update(jitted=guarded.jitted, lower=guarded.lower, __wrapped__=fun)
    call.__name__ = getattr(fun, "__name__", "function")
    call.__doc__ = getattr(fun, "__doc__", None)
    return call


class _GuardedFunction:
    """What `function` compiles: ``fun`` under ``jax.jit``, each call through the CPU guard; a
    call on ragged per-replica values runs ``fun`` as Python."""

    def __init__(self, fun, jit_kwargs):
        self._fun = fun
        traced = functools.wraps(fun)(lambda *args, **kwargs: self._traced(args, kwargs))
        self.jitted = jax.jit(traced, **jit_kwargs)
        self._guard = guard_for(jax.default_backend(), jax.local_device_count())

    def _traced(self, args, kwargs):
        if _holds_ragged_values((args, kwargs)):
            raise _RaggedArguments()  # Before ``fun`` is traced: the call runs it as Python.
        return _checked_outputs(self._fun(*args, **kwargs))

    def __call__(self, args, kwargs):
        try:
            with _counted("depth"):
                # An int64 host number int32 cannot hold raises (JAX would wrap it).
                host_values.check_host_leaves(jax.tree_util.tree_leaves((args, kwargs)))
                if self._guard.inside_launch():  # Traced by a launch: part of its program.
                    return self.jitted(*args, **kwargs)
                return self._guard.dispatch(lambda: self.jitted(*args, **kwargs),
                                            spans_all_devices=False)
        except (_RaggedArguments, TypeError):
            # Ragged values run as Python (another worker's replicas, `jax.ShapeDtypeStruct`s,
            # make jax.jit raise TypeError first).
            if not _holds_ragged_values((args, kwargs)):
                raise
        with _counted("as_python"):  # A ``strategy.run`` traced in there raises.
            return _returned(self._fun(*args, **kwargs))

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """``jax.jit``'s ``lower``; its ``compile()`` takes what the function takes."""
        with _counted("depth"):
            host_values.check_host_leaves(jax.tree_util.tree_leaves((args, kwargs)))
            try:
                return self.jitted.lower(*args, **kwargs)
            except _RaggedArguments as ragged:
                raise errors.UnevenValuesError(str(ragged)) from None


def _checked_outputs(outputs):
    """`_returned` ``outputs`` of a traced `function`; raises `UnsupportedValueError` for what a
    compiled program cannot return (a string, another Python object)."""
    outputs = _returned(outputs)
    for leaf in jax.tree_util.tree_leaves(outputs):
        if not isinstance(leaf, ARRAYS + SCALARS):
            raise errors.UnsupportedValueError(
                f"a jdist.function returned a {type(leaf).__name__} ({str(leaf)[:40]!r}); a "
                "compiled program returns arrays and numbers only (tf.function would return a "
                "string as a tf.string tensor, which JAX has no type for). Return the object "
                "from Python code around the jdist.function, or encode it as numbers.")
    return outputs


def _returned(outputs):
    """``outputs`` as ``tf.function`` returns them: a `Mirrored` that is not a step output leaves
    as its one array; ``run``'s outputs stay as they are."""
    return jax.tree_util.tree_map(
        lambda x: x.value if isinstance(x, Mirrored) and not is_step_output(x) else x,
        outputs, is_leaf=is_distributed)


class _RaggedArguments(errors.UnevenValuesError):
    """Raised while `function` traces ragged arguments (its call then runs them as Python)."""

    def __init__(self):
        super().__init__(
            "per-replica values of different shapes (a partial batch) have no compiled "
            "program: a program has one shape per value. Call the jdist.function itself (it "
            "runs its function as Python for such values), or lower it on a full batch.")


def _holds_ragged_values(tree):
    """Whether ``tree`` holds a ragged `PerReplica`."""
    return any(isinstance(leaf, PerReplica) and leaf.ragged
               for leaf in jax.tree_util.tree_leaves(tree, is_leaf=is_distributed))


_guards: dict = {}
_guards_lock = threading.Lock()


def guard_for(platform: str, num_devices: int) -> DispatchGuard:
    """Returns the process-wide guard for ``platform`` (enabled on CPU with several devices)."""
    enabled = platform == "cpu" and num_devices > 1
    with _guards_lock:
        key = (platform, enabled)
        if key not in _guards:
            _guards[key] = DispatchGuard(enabled)
        return _guards[key]
