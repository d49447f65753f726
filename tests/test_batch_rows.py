"""Padded mode: which outputs of a step are rows of its padded partial batch (and keep its lengths)."""

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jdist._src import batch_rows
from jdist.testing import mirrored, padded_per_replica, per_replica

ROWS = 4  # Per-replica padded batch size; the weight below has as many inputs, on purpose.


def partial_batch(s):
    """Replica 0 has 3 real rows of 4, replica 1 has 1: a partial last batch."""
    rng = np.random.default_rng(0)
    return padded_per_replica(s, [rng.normal(size=(3, ROWS)).astype(np.float32),
                                  rng.normal(size=(1, ROWS)).astype(np.float32)])


def test_per_example_outputs_inherit_the_lengths_and_a_weight_gradient_does_not():
    s = mirrored(2)
    x = partial_batch(s)
    w = jnp.ones((ROWS, 3), jnp.float32)  # Leading size == ROWS, like the batch.

    def step(w, x):
        logits = jax.nn.log_softmax(x @ w)
        losses = -logits[:, 0]
        grad_w = jax.grad(lambda w: jnp.sum(x @ w))(w)  # x^T @ 1: summed over the rows.
        return {"losses": losses, "predictions": jnp.argmax(logits, axis=-1),
                "scaled": jnp.transpose(jnp.transpose(x) * 2.0), "grad_w": grad_w}
    out = s.run(step, args=(w, x))
    assert out["losses"].lengths == out["predictions"].lengths == out["scaled"].lengths == (3, 1)
    assert out["grad_w"].lengths is None
    np.testing.assert_allclose(s.gather(out["scaled"], 0),
                               2 * np.concatenate([c for c in x.values]), rtol=1e-6)
    # Every row of the per-replica gradients is real: gather keeps all of them.
    assert s.gather(out["grad_w"], 0).shape == (2 * ROWS, 3)


def test_other_per_replica_inputs_of_the_same_size_are_not_batch_rows():
    s = mirrored(2)
    x = partial_batch(s)
    other = per_replica(s, [np.ones(ROWS, np.float32)] * 2)
    out = s.run(lambda x, other: other * 2.0, args=(x, other))
    assert out.lengths is None


def _flip_in_a_while_loop(x):
    return lax.while_loop(lambda c: c[0] < 1, lambda c: (c[0] + 1, jnp.flip(c[1], 0)), (0, x))[1]


@pytest.mark.parametrize("reorder", [
    lambda x: jnp.flip(x, 0), lambda x: jnp.roll(x, 1, 0), lambda x: x[jnp.array([1, 0, 3, 2])],
    lambda x: lax.cond(True, lambda v: jnp.flip(v, 0), lambda v: v, x),
    lambda x: lax.fori_loop(0, 1, lambda i, v: jnp.flip(v, 0), x),  # A scan.
    _flip_in_a_while_loop])
def test_outputs_whose_rows_move_keep_every_padded_row(reorder):
    """Reversed, rolled or indexed rows put padding among the real rows: such an output keeps
    no lengths (gather returns every padded row, as the step computed them), where the
    leading-size rule cut real rows and kept padding."""
    s = mirrored(2)
    x = partial_batch(s)
    out = s.run(reorder, args=(x,))
    assert out.lengths is None
    blocks = np.asarray(x.stacked)  # Each replica's rows, padding included.
    np.testing.assert_array_equal(s.gather(out, 0),
                                  np.concatenate([reorder(jnp.asarray(b)) for b in blocks]))


def _conv(x, k):
    return lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _max_pool(x, window=(1, 2, 2, 1)):
    return lax.reduce_window(x, -jnp.inf, lax.max, window, window, "VALID")


def _conv_loss(k, x):
    return jnp.sum(_max_pool(_conv(x, k)) ** 2)


def test_a_conv_kernels_gradient_keeps_no_lengths_and_the_activations_do():
    """3 rows per replica and a 3 x 3 kernel: the kernel's gradient (through a max pool) has
    the batch's leading size, which the leading-size rule took for rows (gather cut it to the
    real-row count)."""
    s = mirrored(2)
    rng = np.random.default_rng(0)
    real = [rng.normal(size=(k, 5, 5, 2)).astype(np.float32) for k in (3, 1)]
    kernel = jnp.asarray(rng.normal(size=(3, 3, 2, 4)).astype(np.float32))
    step = lambda k, x: (_max_pool(_conv(x, k)), jax.grad(_conv_loss)(k, x))  # noqa: E731
    activations, gradient = s.run(step, args=(kernel, padded_per_replica(s, real)))
    assert activations.lengths == (3, 1) and gradient.lengths is None
    np.testing.assert_allclose(s.gather(activations, 0),
                               _max_pool(_conv(np.concatenate(real), kernel)), rtol=1e-5, atol=1e-5)
    for got, rows in zip(s.experimental_local_results(gradient), real):
        np.testing.assert_allclose(got, jax.grad(_conv_loss)(kernel, rows), rtol=1e-5)


def test_a_scan_over_the_rows_falls_back_to_the_leading_size():
    s = mirrored(2)
    x = partial_batch(s)
    out = s.run(lambda x: lax.scan(lambda c, row: (c, row * 2.0), 0.0, x)[1], args=(x,))
    assert out.lengths == (3, 1)


def test_control_flow_is_followed_into_its_branches_and_loops():
    """A weight-shaped output of a loop (leading size ROWS, like the batch) keeps no lengths;
    per-example outputs of a cond, a while loop and a scan along another axis keep them."""
    s = mirrored(2)
    x = partial_batch(s)

    def step(x):
        weight = lax.scan(lambda h, _: (jnp.tanh(h + x.T @ x), None), jnp.zeros((ROWS, ROWS)),
                          None, length=2)[0]
        scaled = lax.cond(True, lambda v: v * 2.0, lambda v: v + 1.0, x)
        doubled = lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, c[1] * 2.0), (0, x))[1]
        columns = lax.scan(lambda c, column: (c, column * 2.0), 0.0, x.T)[1].T
        return weight, scaled, doubled, columns
    weight, *per_example = s.run(step, args=(x,))
    assert weight.lengths is None
    real = np.concatenate(x.values)
    for out, expected in zip(per_example, [real * 2, real * 4, real * 2]):
        assert out.lengths == (3, 1)
        np.testing.assert_allclose(s.gather(out, 0), expected, rtol=1e-6)


def _sum_and_product(a, b):
    return a[0] + b[0], a[1] * b[1]


@pytest.mark.parametrize("fn, expected", [
    (lambda x: x * 2 + 1, [0]),
    (lambda x: x.T, [1]),
    (lambda x: x.reshape(x.shape[0], 2, -1), [0]),
    (lambda x: x.reshape(-1), [batch_rows.UNKNOWN]),
    (lambda x: jnp.sum(x, axis=1), [0]),
    (lambda x: jnp.sum(x, axis=0), [batch_rows.NOT_ROWS]),
    (lambda x: x @ jnp.ones((6, 2)), [0]),
    (lambda x: x.T @ x, [batch_rows.NOT_ROWS]),
    (lambda x: x[None], [1]),
    (lambda x: x[1:], [batch_rows.MOVED]),
    (lambda x: jnp.cumsum(x, axis=1), [0]),
    (lambda x: jnp.cumsum(x, axis=0), [0]),  # Each real row sees real rows only.
    (lambda x: lax.cumsum(x, axis=0, reverse=True), [batch_rows.MOVED]),
    (lambda x: jnp.flip(x, axis=0), [batch_rows.MOVED]),
    (lambda x: jnp.flip(x, axis=1), [0]),
    (lambda x: jnp.sort(x, axis=0), [batch_rows.MOVED]),
    (lambda x: jnp.sort(x, axis=1), [0]),
    (lambda x: jnp.roll(x, 1, axis=0), [batch_rows.MOVED]),
    (lambda x: x[jnp.array([1, 0, 2, 3, 4])], [batch_rows.MOVED]),
    (lambda x: x.at[0].set(1.0), [batch_rows.MOVED]),
    (lambda x: jnp.take_along_axis(x, jnp.zeros((5, 1), int), 1), [batch_rows.UNKNOWN]),
    (lambda x: lax.dynamic_slice_in_dim(x, 2, 3, axis=1), [0]),
    (lambda x: lax.dynamic_slice_in_dim(x, 2, 3, axis=0), [batch_rows.MOVED]),
    (lambda x: jnp.flip(x, 0) + x, [batch_rows.MOVED]),  # Final: what uses moved rows.
    (lambda x: jnp.concatenate([x, x], axis=1), [0]),
    (lambda x: jnp.zeros((5, 6)), [batch_rows.NOT_ROWS]),
    (lambda x: lax.cond(True, lambda v: v * 2, lambda v: jnp.ones_like(v), x), [0]),
    (lambda x: lax.cond(True, lambda v: v.T, lambda v: v.T * 2, x), [1]),
    (lambda x: lax.cond(True, lambda v: jnp.flip(v, 0), lambda v: v, x), [batch_rows.MOVED]),
    (lambda x: lax.cond(True, lambda v: v[:, :5], lambda v: v.T[:5].T, x), [0]),
    (lambda x: lax.cond(True, lambda v: v[:, :5], lambda v: v[:, :5].T, x[:, :5]),
     [batch_rows.UNKNOWN]),  # Rows on axis 0 in one branch and 1 in the other.
    (lambda x: lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] + x),
                              (0, jnp.zeros((5, 6))))[1], [0]),  # Rows join the zeros.
    (lambda x: lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] + x.T @ x),
                              (0, jnp.zeros((6, 6))))[1], [batch_rows.NOT_ROWS]),
    (lambda x: lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[2], c[1]),
                              (0, x, x[:, ::-1]))[1:], [0, 0]),  # Swapped carries.
    (lambda x: lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[2], c[1]),
                              (0, x[:5, :5], x[:5, :5].T))[1:],
     [batch_rows.UNKNOWN, batch_rows.UNKNOWN]),
    (lambda x: lax.scan(lambda c, _: (c * 2, None), x, None, length=3)[0], [0]),
    (lambda x: lax.scan(lambda c, column: (c, column * 2), 0.0, x.T)[1], [1]),
    (lambda x: lax.scan(lambda c, row: (c + row, row * 2), jnp.zeros(6), x),
     [batch_rows.UNKNOWN, batch_rows.UNKNOWN]),  # Along the rows: one row per iteration.
    (lambda x: lax.scan(lambda c, _: (jnp.flip(c, 0), c), x, None, length=2),
     [batch_rows.MOVED, batch_rows.MOVED]),
    # lax.reduce and reduce_window with computations of their own (not calls on the operands).
    (lambda x: lax.reduce((x, x), (0.0, 1.0), _sum_and_product, (0,)),
     [batch_rows.NOT_ROWS, batch_rows.NOT_ROWS]),
    (lambda x: lax.reduce((x, x), (0.0, 1.0), _sum_and_product, (1,)), [0, 0]),
    (lambda x: lax.reduce_window((x, x), (0.0, 1.0), _sum_and_product, (2, 1), (1, 1), "VALID"),
     [batch_rows.MOVED, batch_rows.MOVED]),
    (lambda x: lax.reduce_window((x, x), (0.0, 1.0), _sum_and_product, (1, 2), (1, 1), "VALID"),
     [0, 0]),
])
def test_row_axis_rules(fn, expected):
    jaxpr = jax.make_jaxpr(fn)(jnp.ones((5, 6))).jaxpr
    assert batch_rows.row_axes(jaxpr, [0]) == expected


_KERNEL = jnp.ones((3, 3, 2, 4))


@pytest.mark.parametrize("fn, expected", [
    (lambda x: _conv(x, _KERNEL), [0]),
    (lambda x: jax.grad(_conv_loss)(_KERNEL, x), [batch_rows.NOT_ROWS]),  # The kernel's.
    (lambda x: jax.grad(_conv_loss, argnums=1)(_KERNEL, x), [0]),  # The input's.
    (lambda x: _conv(x.transpose(1, 0, 2, 3), _KERNEL), [batch_rows.UNKNOWN]),  # A window.
    (lambda x: lax.conv_general_dilated(x, jnp.ones((3, 3, 1, 4)), (1, 1), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                        feature_group_count=2), [0]),
    (lambda x: _max_pool(x), [0]),
    (lambda x: lax.reduce_window(x, 0.0, lax.add, (1, 2, 2, 1), (1, 1, 1, 1), "SAME") / 4, [0]),
    (lambda x: _max_pool(x, (2, 1, 1, 1)), [batch_rows.MOVED]),  # Pooled across the rows.
    (lambda x: jax.grad(lambda x: jnp.sum(_max_pool(x) ** 2))(x), [0]),
    (lambda x: jax.grad(lambda k: _conv_loss(k, x))(_KERNEL), [batch_rows.NOT_ROWS]),
    (lambda x: jax.random.normal(jax.random.key(0), x.shape), [batch_rows.NOT_ROWS]),
    (lambda x: jnp.linalg.inv(jnp.sum(x, axis=(1, 2)).T @ jnp.sum(x, axis=(1, 2))),
     [batch_rows.NOT_ROWS]),  # Unmodelled ops on what holds no rows.
])
def test_row_axis_rules_of_images(fn, expected):
    jaxpr = jax.make_jaxpr(fn)(jnp.ones((5, 4, 4, 2))).jaxpr
    assert batch_rows.row_axes(jaxpr, [0]) == expected


_ROW_OPS = [  # On (rows, 3) arrays: rows kept in place, combined causally, or moved.
    lambda x: x * 2.0 + 1.0, lambda x: jnp.flip(x, 0), lambda x: jnp.flip(x, 1),
    lambda x: jnp.roll(x, 1, 0), lambda x: jnp.cumsum(x, 0),
    lambda x: lax.cumsum(x, 0, reverse=True), lambda x: jnp.sort(x, 0),
    lambda x: x @ jnp.arange(9.0).reshape(3, 3) / 9]


def _cond(pred, f, g):
    return lambda x: lax.cond(pred, f, g, x)


def _fori_loop(n, f):  # A scan.
    return lambda x: lax.fori_loop(0, n, lambda i, v: f(v), x)


def _while_loop(n, f):
    return lambda x: lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, f(c[1])), (0, x))[1]


def _added(f, g):
    return lambda x: f(x) + g(x)


_STEPS = st.recursive(st.sampled_from(_ROW_OPS), lambda inner: st.one_of(
    st.builds(_cond, st.booleans(), inner, inner), st.builds(_fori_loop, st.integers(0, 2), inner),
    st.builds(_while_loop, st.integers(0, 2), inner), st.builds(_added, inner, inner)),
    max_leaves=4)


@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.given(step=_STEPS, data=st.data())
def test_property_an_output_with_the_lengths_starts_with_the_real_rows_step(step, data):
    """An output that inherits the lengths holds first, on each replica, exactly what the step
    computes on that replica's real rows alone: no padding moved in among them."""
    n = data.draw(st.sampled_from([2, 3, 4]))
    partial = data.draw(st.lists(st.integers(0, ROWS - 1), min_size=n - 1, max_size=n - 1))
    full = data.draw(st.integers(0, n - 1))  # One replica's rows fix the padded size.
    lengths = partial[:full] + [ROWS] + partial[full:]
    rng = np.random.default_rng(lengths)
    real = [rng.normal(size=(k, 3)).astype(np.float32) for k in lengths]
    s = mirrored(n)
    out = s.run(step, args=(padded_per_replica(s, real),))
    if out.lengths is None:
        return  # Rows moved: every padded row is returned as computed.
    assert out.lengths == tuple(lengths)
    for block, rows in zip(np.asarray(out.stacked), real):
        np.testing.assert_allclose(block[:len(rows)], step(jnp.asarray(rows)), rtol=1e-5,
                                   atol=1e-6)
