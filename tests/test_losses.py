"""``jdist.nn``: TF's loss scaling (``tf.nn.compute_average_loss``, ``scale_regularization_loss``).

The reference is NumPy, per replica, with TF's rules: losses times weights in float32, cast back,
summed, divided by ``global_batch_size`` or by this replica's rows times the replica count, 0
for a zero divisor. Values are multiples of 1/8, so every sum is exact in any order.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdist
from jdist import errors
from jdist.testing import REPLICA_COUNTS, assert_local_results, mirrored, \
    per_replica

WEIGHTS = {
    "none": None,
    "scalar": lambda rows, extra: np.float32(0.5),
    "per example": lambda rows, extra: (np.arange(rows) % 3 / 2).astype(np.float32),
    "per example, axis of 1": lambda rows, extra: (np.arange(rows) % 3 / 2).astype(
        np.float32)[:, None],
    "full": lambda rows, extra: (np.arange(rows * int(np.prod(extra))) % 4 / 4).astype(
        np.float32).reshape((rows,) + extra),
}


def losses(rows, extra=(), dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(-16, 16, size=(r,) + extra) / 8).astype(dtype) for r in rows]


def reference(loss, weight, divisor):
    """TF's compute_average_loss of one replica's losses, in NumPy."""
    if weight is not None:
        weight = np.asarray(weight, np.float32)
        if weight.ndim == loss.ndim + 1:
            weight = weight[..., 0]
        elif weight.ndim == loss.ndim - 1 and weight.ndim:
            weight = weight[..., None]
        loss = (loss.astype(np.float32) * weight).astype(loss.dtype)
    total = loss.astype(np.float32).sum()
    return np.float32(0) if divisor == 0 else np.float32(total / np.float32(divisor))


def run_loss(s, components, weights=None, **kwargs):
    def fn(x, w):
        return jdist.nn.compute_average_loss(x, sample_weight=w, **kwargs)
    w = None if weights is None else per_replica(s, weights)
    return s.run(fn, args=(per_replica(s, components), w))


@pytest.mark.parametrize("weights", list(WEIGHTS))
@pytest.mark.parametrize("extra", [(), (3,), (2, 2)])
@pytest.mark.parametrize("n", REPLICA_COUNTS)
def test_default_divisor_is_this_replicas_rows_times_the_replicas(n, extra, weights):
    """A partial batch of 2n - 1 rows: each replica divides by its own rows times n, as TF."""
    s = mirrored(n)
    rows = [2] * (n - 1) + [1]
    xs = losses(rows, extra)
    ws = None if WEIGHTS[weights] is None else [WEIGHTS[weights](r, extra) for r in rows]
    out = run_loss(s, xs, ws)
    want = [reference(x, None if ws is None else ws[i], rows[i] * n) for i, x in enumerate(xs)]
    assert_local_results(s, out, want, rtol=0, atol=0)


@pytest.mark.parametrize("global_batch_size", [1, 7, 64])
@pytest.mark.parametrize("n", REPLICA_COUNTS)
def test_a_given_global_batch_size_divides_every_replica(n, global_batch_size):
    s = mirrored(n)
    xs = losses([3] * n, (2,), seed=n)
    out = run_loss(s, xs, global_batch_size=global_batch_size)
    assert_local_results(s, out, [reference(x, None, global_batch_size) for x in xs], 0, 0)


@pytest.mark.parametrize("n", [2, 3, 8])
def test_global_batch_size_from_an_all_reduce_of_the_row_counts(n):
    """The exact global mean of a partial batch: the rows all-summed, a traced divisor."""
    s = mirrored(n)
    rows = [3, 0] + [1] * (n - 2)
    xs = losses(rows, seed=1)

    def fn(x):
        total_rows = jdist.get_replica_context().all_reduce("sum", x.shape[0])
        return jdist.nn.compute_average_loss(x, global_batch_size=total_rows)
    out = s.run(fn, args=(per_replica(s, xs),))
    assert_local_results(s, out, [reference(x, None, sum(rows)) for x in xs], 0, 0)
    assert float(s.reduce("sum", out, axis=None)) == pytest.approx(np.concatenate(xs).mean())


@pytest.mark.parametrize("dtype, result", [("bfloat16", "bfloat16"), ("float16", "float16"),
                                           ("int8", "float32"), ("uint8", "float32")])
def test_dtypes_are_tfs_division(dtype, result):
    s = mirrored(2)
    xs = [np.array([1, 2, 4], dtype=jnp.dtype(dtype)), np.array([3, 3], dtype=jnp.dtype(dtype))]
    out = run_loss(s, xs)
    got = s.experimental_local_results(out)
    assert [g.dtype for g in got] == [jnp.dtype(result)] * 2
    np.testing.assert_allclose(np.asarray(got, np.float32), [7 / 6, 6 / 4], rtol=1e-2)


def test_int32_losses_average_in_float64_as_in_tf():
    out = jdist.nn.compute_average_loss(jnp.array([1, 2, 4], jnp.int32))  # JAX's default float.
    assert out.dtype == jnp.float32 and float(out) == np.float32(7) / np.float32(3)
    with jax.enable_x64(True):
        out = jdist.nn.compute_average_loss(jnp.array([1, 2, 4], jnp.int32))
        assert out.dtype == jnp.float64 and float(out) == 7 / 3


def test_zero_divisor_gives_zero_and_a_zero_gradient():
    """TF's div_no_nan: an empty replica (0 rows) or global_batch_size=0 gives 0, not NaN."""
    grad = jax.grad(lambda w: jdist.nn.compute_average_loss(w * jnp.ones(3),
                                                            global_batch_size=0))(2.0)
    assert float(grad) == 0.0
    s = mirrored(2)
    out = run_loss(s, [np.ones((3,), np.float32), np.ones((0,), np.float32)])
    assert_local_results(s, out, [0.5, 0.0], 0, 0)


def test_a_traced_negative_global_batch_size_is_nan():
    """TF raises at run time; a traced value is known only on the devices, so jdist's result
    is NaN (a concrete negative one raises at the call, below)."""
    out = jax.jit(lambda b: jdist.nn.compute_average_loss(jnp.ones(2), global_batch_size=b))(-4)
    assert np.isnan(out)


def test_python_values_convert_as_tf_converts_them():
    out = jdist.nn.compute_average_loss([1.0, 2.0], sample_weight=[2, 1])
    assert out.dtype == jnp.float32 and float(out) == 2.0
    assert float(jdist.nn.scale_regularization_loss([1.0, 2.0])) == 3.0
    with pytest.raises(errors.X64RequiredError):  # int64 in TF; JAX would wrap it.
        jdist.nn.compute_average_loss([2**40, 1])


@pytest.mark.parametrize("kwargs, error, match", [
    ({"per_example_loss": 1.0}, errors.InvalidArgumentError, "rank 1"),
    ({"global_batch_size": 4.0}, errors.InvalidArgumentError, "integer"),
    ({"global_batch_size": True}, errors.InvalidArgumentError, "integer"),
    ({"global_batch_size": np.array([4])}, errors.InvalidArgumentError, "scalar"),
    ({"global_batch_size": -4}, errors.InvalidArgumentError, "non-negative"),
    ({"sample_weight": np.ones((2, 3), np.float32)}, errors.ShapeMismatchError, "size 1"),
    ({"sample_weight": np.ones(3, np.float32)}, errors.ShapeMismatchError, "broadcast"),
])
def test_bad_arguments_raise_typed_errors(kwargs, error, match):
    kwargs = {"per_example_loss": jnp.ones(2), **kwargs}
    with pytest.raises(error, match=match):
        jdist.nn.compute_average_loss(**kwargs)


def test_cross_replica_context_raises_without_a_global_batch_size():
    s = mirrored(2)
    with s.scope():
        with pytest.raises(errors.WrongContextError, match="compute_average_loss"):
            jdist.nn.compute_average_loss(jnp.ones(2))
        assert float(jdist.nn.compute_average_loss(jnp.ones(2), global_batch_size=4)) == 0.5
        with pytest.raises(errors.WrongContextError, match="scale_regularization_loss"):
            jdist.nn.scale_regularization_loss(1.0)


def test_a_per_replica_value_is_refused_outside_the_replica_function():
    s = mirrored(2)
    with pytest.raises(errors.UnsupportedValueError, match="inside the replica function"):
        jdist.nn.compute_average_loss(per_replica(s, [np.ones(2, np.float32)] * 2),
                                      global_batch_size=4)


@pytest.mark.parametrize("n", REPLICA_COUNTS)
def test_scale_regularization_loss_divides_the_sum_by_the_replicas(n):
    s = mirrored(n)
    out = s.run(lambda: jdist.nn.scale_regularization_loss(jnp.array([1.0, 2.0, 3.0])))
    assert_local_results(s, out, [np.float32(6.0) / np.float32(n)] * n, 0, 0)
    assert float(s.reduce("sum", out, axis=None)) == pytest.approx(6.0)


@pytest.mark.parametrize("n", REPLICA_COUNTS)
@pytest.mark.parametrize("losses", [[1.5, 2.0], [1.5, "python 2.0"], [0.25]])
def test_scale_regularization_loss_of_a_list_of_tensors_as_tfs_model_losses(n, losses):
    """``tf.nn.scale_regularization_loss(model.losses)``: a list of scalar tensors (a Python
    number among them takes their dtype), packed and summed, over the replica count."""
    def terms():
        return [2.0 if v == "python 2.0" else jnp.float32(v) * jnp.float32(1.0) for v in losses]
    s = mirrored(n)
    out = s.run(lambda: jdist.nn.scale_regularization_loss(terms()))
    total = np.float32(sum(2.0 if v == "python 2.0" else v for v in losses))
    assert_local_results(s, out, [total / np.float32(n)] * n, 1e-6, 0)


def test_a_list_of_losses_of_different_dtypes_or_shapes_raises_as_tf_does():
    s = mirrored(2)
    with pytest.raises(errors.InvalidArgumentError, match="mixes dtypes"):
        s.run(lambda: jdist.nn.scale_regularization_loss([jnp.float32(1), jnp.int32(1)]))
    with pytest.raises(errors.ShapeMismatchError, match="one shape"):
        s.run(lambda: jdist.nn.scale_regularization_loss([jnp.float32(1), jnp.ones(2)]))
