"""One trace per step function and shapes: what run's program cache keys on, and what it does not."""

import functools
import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdist
from jdist.testing import REPLICA_COUNTS, count_compiles, mirrored, per_replica


def counting(traces):
    def step(w, x):
        traces.append(1)
        return w - jdist.get_replica_context().all_reduce("mean", jnp.sum(x)), jnp.sum(x)
    return step


@pytest.mark.parametrize("n", REPLICA_COUNTS)
def test_a_training_loop_traces_its_step_once(n):
    s = mirrored(n)
    traces = []
    step = counting(traces)
    x = per_replica(s, [np.full(2, i, np.float32) for i in range(n)])
    w = jnp.zeros(())  # Plain first; the Mirrored value the step returns afterwards.
    for _ in range(5):
        w, _ = s.run(step, args=(w, x))
    assert len(traces) == 1
    np.testing.assert_allclose(np.asarray(w), -5 * np.mean([2.0 * i for i in range(n)]))


@pytest.mark.parametrize("first", ["numpy", "jax", "mirrored"])
@pytest.mark.parametrize("n", [1, 3, 8])
def test_a_training_loop_compiles_once_whatever_its_first_parameters(n, first):
    s = mirrored(n)
    step = counting([])
    x = per_replica(s, [np.full(2, i + 1, np.float32) for i in range(n)])
    w = {"numpy": np.float32(0.5), "jax": jnp.float32(0.5),
         "mirrored": s.run(lambda: jnp.float32(0.5))}[first]
    with count_compiles() as compiles:
        for _ in range(4):
            w, _ = s.run(step, args=(w, x))
        jax.block_until_ready(w)
    assert len(compiles) == 1
    np.testing.assert_allclose(np.asarray(w), 0.5 - 4 * np.mean([2.0 * (i + 1) for i in range(n)]))


class Model:
    def __init__(self, scale):
        self.scale = scale
        self.traces = []

    def train_step(self, w):
        self.traces.append(1)
        return w * self.scale


def test_bound_methods_share_a_program_and_do_not_keep_the_owner_alive():
    s = mirrored(2)
    model = Model(3.0)
    outs = [float(s.run(model.train_step, args=(jnp.float32(i),))) for i in range(4)]
    assert outs == [0.0, 3.0, 6.0, 9.0] and len(model.traces) == 1
    owner = weakref.ref(model)
    del model
    gc.collect()
    assert owner() is None


def test_step_functions_called_in_turn_each_keep_their_program():
    s = mirrored(2)
    traces = []

    def add(w):
        traces.append("add")
        return w + 1

    def double(w):
        traces.append("double")
        return w * 2
    w = jnp.float32(1)
    for _ in range(3):
        w = s.run(double, args=(s.run(add, args=(w,)),))
    assert float(w) == 22.0 and sorted(traces) == ["add", "double"]


def test_a_new_step_function_never_gets_a_dead_ones_program():
    # Closures made one after another may reuse a dead one's memory address.
    s = mirrored(2)

    def make(k):
        return lambda w: w + k
    for k in range(4):
        assert float(s.run(make(k), args=(jnp.float32(10),))) == 10.0 + k
        gc.collect()


def test_partials_pass_their_arguments_to_the_step():
    s = mirrored(2)
    traces = []

    def step(scale, w):
        traces.append(1)
        return w * scale
    outs = [float(s.run(functools.partial(step, jnp.float32(k)), args=(jnp.float32(2),)))
            for k in (1, 2, 3)]
    assert outs == [2.0, 4.0, 6.0] and len(traces) == 1


def test_python_objects_and_strings_take_the_general_path():
    s = mirrored(2)
    out = s.run(lambda w, mode: w * (2 if mode == "double" else 3), args=(jnp.float32(1), "double"))
    assert float(out) == 2.0
    out = s.run(lambda w, mode: w * (2 if mode == "double" else 3), args=(jnp.float32(1), "x"))
    assert float(out) == 3.0
    jax.block_until_ready(out)


def test_the_cache_keeps_neither_the_step_nor_what_it_closes_over_alive():
    s = mirrored(2)

    class Held:
        pass

    def make(held):
        def step(w):
            return w + (0 if held is None else 1)
        return step
    held = Held()
    fn = make(held)
    assert float(s.run(fn, args=(jnp.float32(1),))) == 2.0
    fn_ref, held_ref = weakref.ref(fn), weakref.ref(held)
    del fn, held
    gc.collect()
    assert fn_ref() is None and held_ref() is None


@pytest.mark.parametrize("n", [1, 3, 8])
def test_host_arrays_passed_every_step_compile_once_and_reach_every_replica(n):
    # The direct program takes placed values only; a numpy array and an unplaced jax array on
    # every step are placed for it, without a compile per step.
    s = mirrored(n)
    x = per_replica(s, [np.full(2, i + 1, np.float32) for i in range(n)])

    def step(w, x, scale, shift):
        return w + jdist.get_replica_context().all_reduce("sum", jnp.sum(x)) * scale + shift, x

    w, expected = jnp.float32(0), 0.0
    with count_compiles() as compiles:
        for i in range(5):
            w, _ = s.run(step, args=(w, x, np.float32(i), jnp.float32(2 * i)))
            expected += sum(2.0 * (r + 1) for r in range(n)) * i + 2 * i
        jax.block_until_ready(w)
    assert len(compiles) == 1
    np.testing.assert_allclose(np.asarray(w), expected)


@pytest.mark.parametrize("n", [2, 4])
def test_values_held_off_the_replicas_devices_are_moved_there(n):
    s = mirrored(n)
    elsewhere = jax.devices()[-1]
    w = jdist.Mirrored([np.float32(1.5)] * n)  # Host value, on the default device.
    x = jdist.PerReplica([np.full(2, r, np.float32) for r in range(n)])  # Host stack.
    b = jax.device_put(np.float32(3), elsewhere)  # Committed to a device outside the mesh.
    for _ in range(2):
        out = s.run(lambda w, x, b: w * jnp.sum(x) + b, args=(w, x, b))
        np.testing.assert_allclose([np.asarray(v) for v in s.experimental_local_results(out)],
                                   [1.5 * 2 * r + 3 for r in range(n)])


@pytest.mark.parametrize("n", [1, 3, 8])
def test_a_loop_makes_its_arguments_canonical_once_then_takes_the_direct_program(n, monkeypatch):
    # Steady state: the Mirrored parameters run returned go straight to jax.jit's C++ dispatch;
    # only the first, plain parameters are placed and wrapped in Python.
    from jdist._src.run.spmd import ReplicatedRunner
    calls = []
    canonical = ReplicatedRunner._canonical
    monkeypatch.setattr(ReplicatedRunner, "_canonical",
                        lambda self, *a: calls.append(1) or canonical(self, *a))
    s = mirrored(n)

    def step(w, x):
        mean = jdist.get_replica_context().all_reduce("mean", jnp.sum(x))
        return jax.tree_util.tree_map(lambda p: p - mean, w), mean
    x = per_replica(s, [np.full(2, i + 1, np.float32) for i in range(n)])
    if n == 1:  # One replica's batch is a plain array; a host one is placed on every step.
        x = jax.device_put(x, jax.sharding.NamedSharding(s.extended.mesh, jax.sharding.PartitionSpec()))
    w = {"a": np.float32(1), "b": jnp.zeros((3,))}
    for _ in range(6):
        w, _ = s.run(step, args=(w, x))
    assert len(calls) == 1
    np.testing.assert_allclose(np.asarray(w["a"]), 1 - 6 * np.mean([2.0 * (i + 1) for i in range(n)]))


@pytest.mark.parametrize("n", [1, 3, 8])
def test_a_host_batch_given_every_step_is_placed_without_looking_at_each_parameter(
        n, monkeypatch):
    # A NumPy batch is not on the mesh: every step places it, but only the first looks at each
    # argument (`_canonical`); the next ones place what the first placed. A parameter that
    # then comes off the mesh is found by the direct program, and the call looks again.
    from jdist._src.run.spmd import ReplicatedRunner
    calls = []
    canonical = ReplicatedRunner._canonical
    monkeypatch.setattr(ReplicatedRunner, "_canonical",
                        lambda self, *a: calls.append(1) or canonical(self, *a))
    s = mirrored(n)
    w = s.run(lambda: {f"p{i}": jnp.full((2,), float(i)) for i in range(20)})

    def step(w, x):
        return jax.tree_util.tree_map(lambda p: p + jnp.sum(x), w)
    for k in range(6):
        batch = np.full((4,), k, np.float32)  # The same batch on every replica.
        out = s.run(step, args=(w, batch))
        for local in s.experimental_local_results(out["p3"]):
            np.testing.assert_array_equal(local, [3 + 4 * k] * 2)
    assert len(calls) == 1
    w = dict(w, p0=np.zeros(2, np.float32))  # A host parameter where an array was.
    out = s.run(step, args=(w, np.ones(4, np.float32)))
    np.testing.assert_array_equal(s.experimental_local_results(out["p0"])[0], [4.0, 4.0])
    assert len(calls) == 2


@pytest.mark.parametrize("n", [1, 2, 8])
def test_calls_that_change_what_is_on_the_host_compute_each_its_own_numbers(n):
    # Each call after the first may be placed as the one before it was: whatever moved
    # between host and mesh, or whichever tree the call has, its numbers are its own.
    s = mirrored(n)
    placed = s.run(lambda: {"a": jnp.ones(2), "b": jnp.full((2,), 2.0)})

    def step(w, batch, scale=1.0):
        return jax.tree_util.tree_map(lambda p: p * scale + jnp.sum(batch["x"]), w)
    host = {"a": np.ones(2, np.float32), "b": np.full(2, 2.0, np.float32)}
    calls = [(placed, "host", {}), (placed, "host", {}), (host, "host", {}),
             (placed, "placed", {}), (placed, "host", {"scale": np.float32(3.0)}),
             (placed, "host", {}), (host, "placed", {}), (placed, "host", {})]
    for k, (w, where, kwargs) in enumerate(calls):
        x = np.full(3, k, np.float32)
        batch = {"x": x if where == "host" else s.run(lambda v=x: jnp.asarray(v))}
        out = s.run(step, args=(w, batch), kwargs=kwargs)
        scale = float(kwargs.get("scale", 1.0))
        for key, base in (("a", 1.0), ("b", 2.0)):
            for local in s.experimental_local_results(out[key]):
                np.testing.assert_array_equal(local, [base * scale + 3 * k] * 2)


@pytest.mark.parametrize("extra", [float, str], ids=["number", "string"])
def test_a_step_given_python_objects_stops_trying_the_direct_program(extra, monkeypatch):
    # Python numbers and constants take the general path; after two misses run goes there at
    # once: 6 steps launch 6 programs, plus the 2 direct attempts that were refused.
    from jdist._src.dispatch import DispatchGuard
    launches = []
    launch = DispatchGuard.launch
    monkeypatch.setattr(DispatchGuard, "launch",
                        lambda self, *a: launches.append(1) or launch(self, *a))
    s = mirrored(2)

    def step(w, k):
        return w + (float(k) if isinstance(k, str) else k)
    w = s.run(lambda: jnp.float32(0))
    launches.clear()
    for i in range(6):
        w = s.run(step, args=(w, extra(i)))
    assert float(w) == 15.0 and len(launches) == 6 + 2


def test_a_step_back_on_canonical_arguments_takes_the_direct_program_again(monkeypatch):
    from jdist._src.run.spmd import ReplicatedRunner
    calls = []
    canonical = ReplicatedRunner._canonical
    monkeypatch.setattr(ReplicatedRunner, "_canonical",
                        lambda self, *a: calls.append(1) or canonical(self, *a))
    s = mirrored(2)

    def step(w, x):
        return w + jnp.sum(x)
    w = s.run(lambda: jnp.float32(0))
    for _ in range(3):  # A host array on every step: looked at once, then placed as before.
        w = s.run(step, args=(w, np.ones(2, np.float32)))
    placed = s.run(lambda: jnp.ones(2))
    for _ in range(3):  # Canonical again: one check finds it so, then the direct program.
        w = s.run(step, args=(w, placed))
    assert float(w) == 12.0 and len(calls) == 1 + 1
