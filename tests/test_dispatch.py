"""The CPU dispatch guard: never two collective programs in flight on the CPU runtime."""

import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jdist
from jdist import errors
from jdist._src import dispatch
from jdist.testing import mirrored


class _Output:
    """Stands in for a jax.Array: records when it is waited on."""

    def __init__(self, log, name):
        self.log, self.name = log, name

    def block_until_ready(self):
        self.log.append(f"wait {self.name}")
        return self


def test_guard_waits_for_the_previous_program_before_dispatching_the_next():
    log = []
    guard = dispatch.DispatchGuard(enabled=True)

    def program(name):
        log.append(f"dispatch {name}")
        return [_Output(log, name)]
    guard.dispatch(program, "a")
    guard.dispatch(program, "b")
    guard.wait()
    assert log == ["dispatch a", "wait a", "dispatch b", "wait b"]


def test_disabled_guard_never_waits():
    log = []
    guard = dispatch.DispatchGuard(enabled=False)
    for name in "abc":
        guard.dispatch(lambda n: [_Output(log, n)], name)
    assert log == []


def test_guard_is_on_for_multi_device_cpu_only():
    assert dispatch.guard_for("cpu", 8).enabled
    assert not dispatch.guard_for("cpu", 1).enabled
    assert not dispatch.guard_for("gpu", 8).enabled
    assert not dispatch.guard_for("tpu", 8).enabled
    assert dispatch.guard_for("cpu", 8) is dispatch.guard_for("cpu", 4)


def test_guard_serialises_threads():
    guard = dispatch.DispatchGuard(enabled=True)
    active, peak, calls = [0], [0], [0]
    lock = threading.Lock()

    def program():
        with lock:
            active[0] += 1
            calls[0] += 1
            peak[0] = max(peak[0], active[0])
        sum(range(10000))
        with lock:
            active[0] -= 1
        return [_Output([], "x")]
    threads = [threading.Thread(target=lambda: [guard.dispatch(program) for _ in range(50)])
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert peak[0] == 1 and calls[0] == 200


@pytest.mark.parametrize("kind", ["stand-in", "array"])
def test_deleted_outputs_do_not_break_the_guard(kind):
    class Deleted:
        def block_until_ready(self):
            raise RuntimeError("Array has been deleted")
    waited = Deleted() if kind == "stand-in" else jnp.arange(3.0) + 1
    guard = dispatch.DispatchGuard(enabled=True)
    guard.dispatch(lambda: [waited, jnp.ones(2) * 2], spans_all_devices=False)
    if kind == "array":
        waited.delete()  # Donated to a later program, say: the other output is still waited.
    assert guard.dispatch(lambda: 5) == 5


# --------------------------- issue 9, item 16: strategy.run traced outside jdist.function
def _step(w, x):
    return w + jdist.get_replica_context().all_reduce("sum", x)


def _per_replica_ones(s):
    return s.experimental_distribute_values_from_function(
        lambda ctx: np.float32(ctx.replica_id_in_sync_group + 1))


UNGUARDED = {
    "jax.jit": lambda s, w, x: jax.jit(lambda w, x: s.run(_step, args=(w, x)))(w, x),
    "jax.jit_closure": lambda s, w, x: jax.jit(lambda: s.run(_step, args=(w, x)))(),
    "lax.scan": lambda s, w, x: lax.scan(
        lambda w, _: (s.run(_step, args=(w, x)), None), w, None, length=2)[0],
    "jax.grad": lambda s, w, x: jax.grad(lambda w: jnp.sum(s.run(_step, args=(w, x)).value))(w),
    "jax.vmap": lambda s, w, x: jax.vmap(lambda w: s.run(_step, args=(w, x)).value)(
        jnp.stack([w, w])),
}


@pytest.mark.parametrize("n", [2, 3, 8])
@pytest.mark.parametrize("how", sorted(UNGUARDED))
def test_run_traced_outside_jdist_function_raises_on_cpu(n, how):
    # A program JAX launches itself escapes the CPU guard (it aborts the process when launched
    # back to back): run refuses to be traced into it, naming jdist.function.
    s = mirrored(n)
    with pytest.raises(errors.UnguardedTraceError, match="jdist.function"):
        UNGUARDED[how](s, jnp.float32(0), _per_replica_ones(s))


def test_unguarded_trace_error_is_a_wrong_context_runtime_error():
    assert issubclass(errors.UnguardedTraceError, errors.WrongContextError)
    assert issubclass(errors.UnguardedTraceError, RuntimeError)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_scan_and_grad_inside_jdist_function_match_eager_steps(n):
    s = mirrored(n)
    x = _per_replica_ones(s) if n > 1 else np.float32(1)

    def step(w, x):  # A gradient step inside the replica function, mean-reduced.
        g = jax.grad(lambda w: jnp.sum((w * x - 1.0) ** 2))(w)
        return w - 0.1 * jdist.get_replica_context().all_reduce("mean", g)

    @jdist.function
    def train(w, x):
        return lax.scan(lambda w, _: (s.run(step, args=(w, x)), None), w, None, length=4)[0]
    w = eager = s.run(lambda: jnp.zeros(3))  # Mirrored on several replicas: scan's carry type.
    for _ in range(4):
        eager = s.run(step, args=(eager, x))
    np.testing.assert_allclose(train(w, x), eager, rtol=1e-6)
    assert train.lower(w, x).as_text()  # .lower traces under the guard too.


def test_one_device_strategy_may_be_traced_by_plain_jit():
    s = mirrored(1)  # One device: no collectives between devices, no guard.
    w = jax.jit(lambda w: lax.scan(lambda w, _: (s.run(_step, args=(w, 1.0)), None), w, None,
                                   length=3)[0])(jnp.float32(0))
    assert float(w) == 3.0


def test_disabled_guard_never_refuses_a_trace():
    # GPU and TPU: the guard is off, dispatch stays asynchronous, tracing run is fine.
    jax.jit(lambda: dispatch.check_traced_run(dispatch.DispatchGuard(enabled=False)))()


def test_enabled_guard_refuses_only_traces_outside_function():
    guard = dispatch.DispatchGuard(enabled=True)
    dispatch.check_traced_run(guard)  # Eager: nothing to refuse.
    with pytest.raises(errors.UnguardedTraceError):
        jax.jit(lambda: dispatch.check_traced_run(guard))()
    jdist.function(lambda: dispatch.check_traced_run(guard))()


LOOP = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp, numpy as np, jdist

strategy = jdist.MirroredStrategy()
def step(w, x):
    return w - 0.01 * jdist.get_replica_context().all_reduce("mean", jnp.tanh(x @ w))
compile_ = {"jax.jit": jax.jit, "jdist.function": jdist.function}[sys.argv[1]]
train = compile_(lambda w, x: strategy.run(step, args=(w, x)))
xs = [np.full((16, 16), r / 8, np.float32) for r in range(8)]
x = strategy.experimental_distribute_values_from_function(
    lambda ctx: xs[ctx.replica_id_in_sync_group])
w = jnp.eye(16)
for _ in range(200):  # Back to back, no host work in between: what aborted the process.
    w = train(w, x)
ref = np.eye(16, dtype=np.float32)
for _ in range(200):
    ref = ref - 0.01 * np.mean([np.tanh(xr @ ref) for xr in xs], axis=0)
np.testing.assert_allclose(np.asarray(w), ref, rtol=1e-4, atol=1e-5)
print("200 steps OK")
"""


@pytest.mark.parametrize("compile_", ["jax.jit", "jdist.function"])
def test_200_step_jitted_loop_raises_or_completes_never_aborts(compile_):
    # The loop every JAX user writes first. With a plain jax.jit it used to abort the process
    # (SIGABRT after XLA's 40 s rendezvous timeout, 40-60 steps in); now the first call raises
    # the typed error. Under jdist.function it completes with NumPy's numbers.
    proc = subprocess.run([sys.executable, "-c", LOOP, compile_], capture_output=True, text=True,
                          timeout=120, check=False)
    if compile_ == "jax.jit":
        assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
        assert "jdist._src.errors.UnguardedTraceError" in proc.stderr
        assert "jdist.function" in proc.stderr
    else:
        assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
        assert "200 steps OK" in proc.stdout


REENTERED = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=3"
import jax, jax.numpy as jnp, numpy as np, jdist
s = jdist.MirroredStrategy()
x = s.experimental_distribute_values_from_function(
    lambda c: np.full((2,), c.replica_id_in_sync_group, np.float32))
outer = s.experimental_distribute_values_from_function(
    lambda c: np.full((2,), 10 + c.replica_id_in_sync_group, np.float32))
ctx = jdist.get_replica_context
def show(value):
    return [np.asarray(v).tolist() for v in s.experimental_local_results(value)]
cases = {
    "function in run": lambda: show(s.run(jdist.function(
        lambda v: ctx().all_reduce("sum", v.sum())), args=(x,))),
    "function in function": lambda: show(jdist.function(lambda a: jdist.function(
        lambda b: s.run(lambda v: ctx().all_reduce("sum", v * 2.0), args=(b,)))(a))(x)),
    "reduce in function": lambda: np.asarray(
        jdist.function(lambda: s.reduce("sum", outer, axis=None))()).tolist(),
    "outer value in merge_fn": lambda: s.run(lambda v: ctx().merge_call(
        lambda st, a: st.reduce("sum", outer, axis=None), args=(v,)), args=(x,)),
}
for name, case in cases.items():
    try:
        print(name, "=", case())
    except Exception as error:
        print(name, "raises", type(error).__name__)
"""


def test_jdist_calls_inside_a_traced_launch_compute_or_raise_never_hang():
    """Code a guarded program runs while it is traced (a jdist.function called in a replica
    function or in another jdist.function, a merge_fn that reduces or waits) launched again
    through the guard, whose lock its own launch held: each of these hung for ever."""
    proc = subprocess.run([sys.executable, "-c", REENTERED], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == [
        "function in run = [6.0, 6.0, 6.0]",
        "function in function = [[6.0, 6.0], [6.0, 6.0], [6.0, 6.0]]",
        "reduce in function = [33.0, 33.0]",
        "outer value in merge_fn raises WrongContextError",
    ]
