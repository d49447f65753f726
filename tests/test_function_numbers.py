"""jdist.function's Python-number arguments are the numbers themselves, as in tf.function:
arithmetic on them is Python's, strategy.run inside gets them as run's own Python numbers, and
each new value is a new program (arrays share one)."""

import warnings

import jax.numpy as jnp
import numpy as np
import pytest

import jdist
from jdist import errors
from jdist.testing import REPLICA_COUNTS, count_compiles, mirrored, per_replica

# Numbers whose float64 quotient by 3, rounded once to float32 (TF), differs from float32's
# quotient of float32(x) (a traced jax.jit argument).
DOUBLE_ROUNDED = [x for x in np.linspace(0.01, 1, 400).tolist()
                  if np.float32(x / 3) != np.float32(x) / np.float32(3)][:3]


def ctx():
    return jdist.get_replica_context()


@pytest.mark.parametrize("n", REPLICA_COUNTS)
@pytest.mark.parametrize("lr", DOUBLE_ROUNDED)
def test_arithmetic_on_a_python_number_is_pythons(n, lr):
    s = mirrored(n)
    step = jdist.function(lambda lr, g: s.run(lambda q, g: q * g, args=(lr / 3, g)))
    g = per_replica(s, [np.float32(r + 1) for r in range(n)])
    got = [np.asarray(v) for v in s.experimental_local_results(step(lr, g))]
    np.testing.assert_array_equal(got, [np.float32(lr / 3) * np.float32(r + 1) for r in range(n)])
    assert np.float32(lr / 3) != np.float32(lr) / np.float32(3)  # What a traced lr would give.


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("number", [0.1, 3])
def test_run_inside_gets_the_number_as_runs_own_python_number(n, number):
    # tf.function: all_reduce sums the replicas' copies of the number (a tensor argument is
    # one value instead); merge_call's merge_fn gets the number itself, whose SUM raises.
    s = mirrored(n)
    total = jdist.function(lambda x: s.run(lambda x: ctx().all_reduce("sum", x), args=(x,)))
    np.testing.assert_allclose(np.asarray(total(number)), np.float32(number) * n, rtol=1e-6)
    mean = jdist.function(lambda x: s.run(lambda x: ctx().merge_call(
        lambda st, v: st.reduce("mean", v, axis=None), args=(x,)), args=(x,)))
    assert float(mean(number)) == np.float32(number)
    added = jdist.function(lambda x: s.run(lambda x: ctx().merge_call(
        lambda st, v: st.reduce("sum", v, axis=None), args=(x,)), args=(x,)))
    with pytest.raises(errors.InvalidArgumentError, match="non-DistributedValues"):
        added(number)


def test_each_new_number_is_a_program_and_arrays_share_one():
    s = mirrored(2)
    step = jdist.function(lambda w, lr: s.run(lambda w, lr: w - lr * w, args=(w, lr)))
    w = jnp.float32(2.0)
    step(w, 0.5), step(w, jnp.float32(0.5))
    with count_compiles() as compiles:
        assert float(step(w, 0.5)) == 1.0  # Seen: its program.
        assert float(step(w, jnp.float32(0.25))) == 1.5  # Arrays: one program for any value.
        assert float(step(w, jnp.float32(0.75))) == 0.5
    assert len(compiles) == 0
    with count_compiles() as compiles:
        assert float(step(w, 0.25)) == 1.5
    assert len(compiles) == 1


def test_many_numbers_warn_once_as_tf_warns_of_retracing():
    step = jdist.function(lambda x, k: x * k)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in range(7):
            assert float(step(jnp.float32(2), k)) == 2 * k
    retraced = [w for w in caught if issubclass(w.category, errors.RetracingWarning)]
    assert len(retraced) == 1 and "jnp.float32" in str(retraced[0].message)
    assert retraced[0].filename == __file__  # It points at the call.


@pytest.mark.filterwarnings("ignore::jdist.errors.RetracingWarning")
def test_numbers_are_told_apart_exactly():
    # -0.0 == 0.0 and True == 1 in Python, but they compute differently; NaN != NaN, but it is
    # one number: its second call reuses its program.
    step = jdist.function(lambda k: jnp.float32(np.copysign(1.0, k)) if type(k) is float
                          else jnp.int32(10 if type(k) is bool else 20))
    assert [float(step(k)) for k in (0.0, -0.0, True, 1)] == [1, -1, 10, 20]
    assert float(step(float("nan"))) == 1
    with count_compiles() as compiles:
        assert float(step(float("nan"))) == 1
    assert len(compiles) == 0


def test_python_control_flow_on_a_number_works_as_in_tf_function():
    step = jdist.function(lambda x, training: x * 2 if training else x)
    assert float(step(jnp.float32(3), True)) == 6 and float(step(jnp.float32(3), False)) == 3


def test_static_arguments_stay_jax_jits():
    step = jdist.function(lambda x, k: x * k[0], static_argnums=1)
    assert float(step(jnp.float32(2), (3, 4))) == 6 and float(step(jnp.float32(2), (5,))) == 10


def test_a_lowered_program_takes_the_numbers_it_was_lowered_for():
    step = jdist.function(lambda x, k: x * k)
    compiled = step.lower(jnp.float32(2), 3).compile()
    assert float(compiled(jnp.float32(5), 3)) == 15
    with pytest.raises(errors.InvalidArgumentError, match="lowered for the Python numbers"):
        compiled(jnp.float32(5), 4)
