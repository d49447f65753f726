"""SEMANTICS.md, run and values: what strategy.run passes in and hands back."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jdist
from jdist import errors
from jdist.testing import REPLICA_COUNTS, assert_local_results, mirrored, per_replica

Pair = collections.namedtuple("Pair", "first second")


def rid():
    return jdist.get_replica_context().replica_id_in_sync_group


@pytest.mark.parametrize("args", [1.0, {"x": 1.0}, np.ones(2, np.float32)])
def test_args_must_be_tuple_or_list(args):
    with pytest.raises(ValueError, match="tuple or list"):
        mirrored(2).run(lambda x: x, args=args)


@pytest.mark.parametrize("n", REPLICA_COUNTS)
def test_distributed_args_are_unpacked_and_plain_args_passed_to_every_replica(n):
    s = mirrored(n)
    comps = [np.full((3,), float(i), np.float32) for i in range(n)]
    v = per_replica(s, comps) if n > 1 else comps[0]
    out = s.run(lambda x, y, scale=1.0: x * y * scale, args=(v, np.arange(3, dtype=np.float32)),
                kwargs={"scale": 2.0})
    assert_local_results(s, out, [c * np.arange(3, dtype=np.float32) * 2 for c in comps])


@pytest.mark.parametrize("n", [1, 2, 4])
def test_function_without_arguments(n):
    s = mirrored(n)
    assert_local_results(s, s.run(rid), list(range(n)))


def test_output_keeps_the_nest():
    s = mirrored(2)
    out = s.run(lambda: {"a": [rid(), (rid() * 2, None)], "b": Pair(1.0, rid())})
    assert isinstance(out["b"], Pair) and out["a"][1][1] is None
    assert_local_results(s, out["a"][0], [0, 1])
    assert_local_results(s, out["b"].second, [0, 1])
    assert out["b"].first == 1.0  # A Python object every replica returned: itself (TF).


@pytest.mark.parametrize("n", [2, 3, 8])
def test_outputs_equal_on_every_replica_are_mirrored(n):
    s = mirrored(n)
    x = per_replica(s, [np.float32(i) for i in range(n)])
    params = jnp.float32(1.0)

    def step(params, x):
        ctx = jdist.get_replica_context()
        grad = jax.grad(lambda p: p * x)(params)
        mean = ctx.all_reduce("mean", grad)
        return {"grad": grad, "mean": mean, "new": params - 0.1 * mean, "const": jnp.ones(2),
                "gathered": ctx.all_gather(x[None], 0), "id": rid(), "mixed": mean + x}
    out = s.run(step, args=(params, x))
    kinds = {k: type(v).__name__ for k, v in out.items()}
    assert kinds == {"grad": "PerReplica", "mean": "Mirrored", "new": "Mirrored",
                     "const": "Mirrored", "gathered": "Mirrored", "id": "PerReplica",
                     "mixed": "PerReplica"}
    assert float(out["new"]) == pytest.approx(1 - 0.1 * (n - 1) / 2)


def test_control_flow_keeps_mirrored_only_when_every_replica_agrees():
    s = mirrored(4)

    def step(w):
        ctx = jdist.get_replica_context()
        scanned, _ = lax.scan(lambda c, _: (c + ctx.all_reduce("sum", c), None), w, None, length=3)
        drifting, _ = lax.scan(lambda c, _: (c + rid(), None), w, None, length=3)
        same_branch = lax.cond(w > 0, lambda: w * 2, lambda: w)
        own_branch = lax.cond(rid() > 1, lambda: w * 2, lambda: w)
        looped = lax.while_loop(lambda c: c < 10.0, lambda c: c + 1.0, w)
        own_loop = lax.while_loop(lambda c: c < rid(), lambda c: c + 1, 0)
        return scanned, drifting, same_branch, own_branch, looped, own_loop
    out = s.run(step, args=(jnp.float32(1.0),))
    assert [type(o).__name__ for o in out] == [
        "Mirrored", "PerReplica", "Mirrored", "PerReplica", "Mirrored", "PerReplica"]
    assert float(out[0]) == 5.0 ** 3  # c + all_sum(c) = 5c, three times.
    assert_local_results(s, out[3], [1.0, 1.0, 2.0, 2.0])
    assert_local_results(s, out[5], [0, 1, 2, 3])


@pytest.mark.parametrize("n", [2, 3, 4])
def test_gradients_are_per_replica_as_in_tf(n):
    """Each replica differentiates its own copy of mirrored parameters (TF semantics)."""
    s = mirrored(n)
    x = per_replica(s, [np.float32(i + 1) for i in range(n)])

    def step(w, x):
        g = jax.grad(lambda w: w * x)(w)
        return g, jdist.get_replica_context().all_reduce("mean", g)
    grads, mean = s.run(step, args=(jnp.float32(2.0), x))
    assert_local_results(s, grads, [i + 1 for i in range(n)])
    assert float(mean) == pytest.approx((n + 1) / 2)


def test_mirrored_output_feeds_the_next_step_without_copy():
    s = mirrored(4)
    w = s.run(lambda: jnp.ones(3))
    assert isinstance(w, jdist.Mirrored)
    w2 = s.run(lambda w: w * 2, args=(w,))
    assert isinstance(w2, jdist.Mirrored)
    np.testing.assert_array_equal(np.asarray(w2), [2., 2., 2.])


def test_program_compiles_once_per_signature():
    s = mirrored(2)
    traces = []

    def fn(x):
        traces.append(x.shape)
        return x + 1
    for _ in range(3):
        s.run(fn, args=(per_replica(s, [np.ones(3, np.float32)] * 2),))
    s.run(fn, args=(per_replica(s, [np.ones(4, np.float32)] * 2),))
    assert traces == [(3,), (4,)]


def test_static_python_arguments_are_compiled_in():
    s = mirrored(2)
    out = s.run(lambda x, mode: x * 2 if mode == "double" else x, args=(jnp.ones(2), "double"))
    np.testing.assert_array_equal(np.asarray(out), [2., 2.])
    with pytest.raises(errors.UnsupportedValueError, match="hashable"):
        s.run(lambda x: 0.0, args=([1, 2],)[0:0] + ({1: 2}.keys(),))


def test_exceptions_in_fn_reach_the_caller_with_their_type():
    class Boom(Exception):
        pass

    def fn():
        raise Boom("inside the replica function")
    with pytest.raises(Boom, match="inside the replica"):
        mirrored(2).run(fn)


def test_a_python_object_returned_by_every_replica_is_returned_as_it_is():
    assert mirrored(2).run(lambda: "text") == "text"  # TF's regroup of identical objects.
    with pytest.raises(errors.UnsupportedValueError, match="PerReplica"):
        mirrored(2).run(lambda: jdist.PerReplica([1.0, 2.0]))


def test_experimental_run_v2_is_run():
    s = mirrored(2)
    assert_local_results(s, s.experimental_run_v2(rid), [0, 1])


@pytest.mark.parametrize("n", [1, 2, 4])
def test_run_inside_jit_and_scan(n):
    s = mirrored(n)
    x = per_replica(s, [np.float32(i) for i in range(n)]) if n > 1 else np.float32(0)

    def step(w, x):
        return w + jdist.get_replica_context().all_reduce("sum", x)

    @jdist.function  # jax.jit behind the CPU dispatch guard (a plain jax.jit raises here).
    def train(w, x):
        return lax.scan(lambda w, _: (s.run(step, args=(w, x)), None), w, None, length=3)[0]
    w = train(s.run(lambda: jnp.float32(0.0)), x)
    assert float(w) == pytest.approx(3 * n * (n - 1) / 2)


def test_values_pass_through_tree_util():
    s = mirrored(2)
    out = s.run(lambda: {"a": jnp.ones(2) * rid(), "b": jnp.ones(2)})
    doubled = jax.tree_util.tree_map(lambda x: x * 2, out)
    assert isinstance(doubled["a"], jdist.PerReplica) and isinstance(doubled["b"], jdist.Mirrored)
    assert_local_results(s, doubled["a"], [[0., 0.], [2., 2.]])


# ------------------------------------------------------- what run returns (TF's regroup)
@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("uneven", [False, True])
def test_a_result_of_python_numbers_alone_is_mirrored(n, uneven):
    """A Python number given to run is the same value on every replica, as a Mirrored is: x * 2
    of it is a Mirrored 4 (TF: the Python int 4), in an exact uneven step too."""
    s = mirrored(n)
    batch = per_replica(s, [np.ones(r % 2 + 1 if uneven else 2, np.float32) for r in range(n)])
    out, rows = s.run(lambda x, b: (x * 2, b.shape[0]), args=(2, batch))
    assert rows == 2 or isinstance(rows, jdist.PerReplica)
    assert isinstance(out, jdist.Mirrored)
    assert_local_results(s, out, [4] * n)
    assert int(s.reduce("mean", out, axis=None)) == 4
    assert int(s.reduce("sum", out, axis=None)) == 4 * n  # Each replica's copy, as Mirrored.


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("uneven", [False, True])
@pytest.mark.parametrize("step", [
    lambda lr, step, g: lr * g,
    lambda lr, step, g: (lr / 3) * g,
    lambda lr, step, g: lr * 3 + 0 * g,
    lambda lr, step, g: (step / 10) * g,
    lambda lr, step, g: (jnp.float32(lr) / 3) * g,
    lambda lr, step, g: g * (step + 1) + lr])
def test_python_number_arguments_compute_as_jax_jit_traces_them(n, uneven, step):
    # Python numbers are traced as jax.jit traces them (weak-typed, float32 without x64): lr / 3
    # is float32's division, where TF's Python operators divide in float64 (docs/design.md).
    s = mirrored(n)
    g = per_replica(s, [np.full(r % 2 + 1 if uneven and n > 1 else 2, r + 1.0, np.float32)
                        for r in range(n)])
    want = [jax.jit(step)(0.1, 7, c) for c in s.experimental_local_results(g)]
    assert_local_results(s, s.run(step, args=(0.1, 7, g)), want, 0, 0)


@pytest.mark.parametrize("n", REPLICA_COUNTS)
@pytest.mark.parametrize("training", [True, False])
def test_a_python_bool_is_a_flag_the_step_branches_on(n, training):
    # TF hands run's Python bool over as it is, so `if training:` is Python's branch there.
    s = mirrored(n)
    x = per_replica(s, [np.arange(2, dtype=np.float32) + r for r in range(n)])
    out = s.run(lambda x, training: x * 2 if training else x - 1, args=(x, training))
    assert_local_results(s, out, [(np.arange(2) + r) * 2 if training else np.arange(2) + r - 1
                                  for r in range(n)])


@pytest.mark.parametrize("n", [2, 3, 8])
def test_an_op_on_a_python_number_is_the_same_on_every_replica(n):
    s = mirrored(n)
    for op in (jnp.sum, jnp.float32, lambda k: k * 2):
        out = s.run(op, args=(2.5,))
        assert isinstance(out, jdist.Mirrored)
        np.testing.assert_allclose(float(s.reduce("sum", out, axis=None)), op(2.5) * n,
                                   rtol=1e-6)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_python_objects_returned_by_the_step_pass_through(n):
    s = mirrored(n)
    assert s.run(lambda: ("tag", 3, None)) == ("tag", 3, None)

    def step(w):
        return jdist.get_replica_context().merge_call(lambda strategy, a, b: (a * 2, b),
                                                      args=(3,), kwargs={"b": "x"})
    assert s.run(step, args=(jnp.float32(1),)) == (6, "x")


@pytest.mark.parametrize("n", [2, 4])
def test_arrays_are_never_collapsed(n):
    s = mirrored(n)
    out = s.run(lambda: jdist.get_replica_context().all_reduce("sum", jnp.float32(1)))
    assert isinstance(out, jdist.Mirrored) and float(out) == n


def test_uneven_steps_regroup_python_numbers_per_replica():
    s = mirrored(4)
    v = per_replica(s, [np.ones(i % 2 + 1, np.float32) for i in range(4)])
    rows, tag = s.run(lambda x: (x.shape[0], "same"), args=(v,))
    assert tag == "same"
    assert_local_results(s, rows, [1, 2, 1, 2])


@pytest.mark.parametrize("n", [1, 2, 4])
def test_run_under_disable_jit_still_runs_one_compiled_program(n):
    # jax.disable_jit does not reach inside run: the replicas are one SPMD program either way.
    s = mirrored(n)
    w = jnp.float32(1)
    x = per_replica(s, [np.float32(r) for r in range(n)])
    with jax.disable_jit():
        total, y = s.run(lambda w, x: (w * 2 + jdist.get_replica_context().all_reduce("sum", x),
                                       x + 1), args=(w, x))
    assert float(np.asarray(total)) == 2 + sum(range(n))
    np.testing.assert_allclose([np.asarray(v) for v in s.experimental_local_results(y)],
                               [r + 1 for r in range(n)])
