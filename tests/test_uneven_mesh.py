"""An exact uneven step runs each piece as one whole-mesh program for all traces (uneven_mesh).

Each device runs its replica's trace; the numbers are those of the pieces run one device at a
time (bit for bit) and of NumPy replica by replica.
"""

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdist
from jdist._src.uneven import mesh as uneven_mesh
from jdist.testing import assert_local_results, count_compiles, mirrored, per_replica


def training_step(w, x):
    """A replica's step: a loss on its rows, its gradient all-reduced, and per-replica outputs
    of every kind (a number of rows, a mean that is NaN on no rows, ragged rows, a flag)."""
    def loss(w):
        return jnp.sum(jnp.tanh(x @ w) ** 2) / 4.0
    value, grad = jax.value_and_grad(loss)(w)
    ctx = jdist.get_replica_context()
    grad = ctx.all_reduce("sum", grad)
    return w - 0.1 * grad, ctx.all_reduce("sum", value), x.shape[0], jnp.mean(x), x * 2, (
        jnp.any(x > 1.0))


def reference(w, xs):
    """`training_step` in NumPy, replica by replica."""
    grads = [x.T @ ((1 - np.tanh(x @ w) ** 2) * 2 * np.tanh(x @ w)) / 4.0 for x in xs]
    losses = [np.sum(np.tanh(x @ w) ** 2) / 4.0 for x in xs]
    return (w - 0.1 * sum(grads), sum(losses), [len(x) for x in xs],
            [x.mean() if len(x) else np.nan for x in xs], [x * 2 for x in xs],
            [bool(np.any(x > 1.0)) for x in xs])


def mixed_step(w, x):
    """Cuts and outputs of other kinds: an all-gather (a merge_call), an all-reduce of an empty
    array (no program), and a value typed differently per trace (a sum where a replica has
    rows, a weakly typed zero where it has none), returned and all-reduced."""
    ctx = jdist.get_replica_context()
    gathered = ctx.all_gather(x, axis=0)
    empty = ctx.all_reduce("sum", x[:0])
    total = ctx.all_reduce("sum", jnp.sum(x @ w))
    first = jnp.sum(x[0]) if x.shape[0] else jnp.asarray(0.0)
    return gathered, empty, total, first, ctx.all_reduce("sum", first)


def mixed_reference(w, xs):
    """`mixed_step` in NumPy, replica by replica."""
    first = [x[0].sum() if len(x) else 0.0 for x in xs]
    return (np.concatenate(xs), np.zeros((0, 3), np.float32), sum(np.sum(x @ w) for x in xs),
            first, sum(first))


def run_step(s, w, xs, whole_mesh, monkeypatch, fn=training_step):
    """``fn`` on the rows ``xs`` (one array per replica) through a plan of its own, its pieces
    run as whole-mesh programs or one device at a time."""
    with monkeypatch.context() as patch:
        if not whole_mesh:
            patch.setattr(uneven_mesh, "serves", lambda *args: False)
        step = lambda w, x: fn(w, x)  # noqa: E731  (a plan of its own)
        return s.run(step, args=(w, per_replica(s, xs)))


def assert_same_outputs(s, outputs):
    """Two runs' outputs are the same values of the same types, bit for bit."""
    for mesh_leaf, device_leaf in zip(*(jax.tree.leaves(o) for o in outputs)):
        assert type(mesh_leaf) is type(device_leaf)
        for a, b in zip(s.experimental_local_results(mesh_leaf),
                        s.experimental_local_results(device_leaf)):
            assert type(a) is type(b)  # A Python number where every replica returned it.
            if isinstance(a, jax.Array):
                assert (a.dtype, a.weak_type) == (b.dtype, b.weak_type)
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("sizes", [[2, 1, 1], [2, 2, 1, 1], [2, 1, 0, 2], [3, 3, 2, 2, 2, 0, 0, 0]],
                         ids=lambda sizes: "-".join(map(str, sizes)))
def test_a_training_step_on_rows_of_two_and_three_sizes(sizes, monkeypatch):
    s, rng = mirrored(len(sizes)), np.random.default_rng(len(sizes))
    xs = [rng.normal(size=(k, 3)).astype(np.float32) for k in sizes]
    w = rng.normal(size=(3, 2)).astype(np.float32)
    new_w, loss, rows, mean, doubled, flag = run_step(s, w, xs, True, monkeypatch)
    want = reference(w, xs)
    np.testing.assert_allclose(np.asarray(new_w), want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(loss), want[1], rtol=1e-5)
    assert_local_results(s, rows, want[2])
    assert_local_results(s, mean, want[3])
    assert_local_results(s, doubled, want[4])
    assert_local_results(s, flag, want[5])


@hypothesis.settings(max_examples=12, deadline=None)
@hypothesis.given(st.sampled_from([3, 4, 8]).flatmap(
    lambda n: st.lists(st.integers(0, 3), min_size=n, max_size=n)), st.integers(0, 2 ** 31 - 1),
    st.sampled_from([training_step, mixed_step]))
def test_whole_mesh_pieces_compute_what_one_device_at_a_time_does(sizes, seed, fn):
    monkeypatch = pytest.MonkeyPatch()
    s, rng = mirrored(len(sizes)), np.random.default_rng(seed)
    xs = [rng.normal(size=(k, 3)).astype(np.float32) for k in sizes]
    w = rng.normal(size=(3, 2)).astype(np.float32)
    assert_same_outputs(s, [run_step(s, w, xs, whole_mesh, monkeypatch, fn)
                            for whole_mesh in (True, False)])


@pytest.mark.parametrize("sizes", [[2, 1, 1], [2, 2, 0, 0], [3, 3, 2, 2, 2, 0, 0, 0]],
                         ids=lambda sizes: "-".join(map(str, sizes)))
def test_merge_calls_empty_collectives_and_outputs_typed_per_trace(sizes, monkeypatch):
    s, rng = mirrored(len(sizes)), np.random.default_rng(len(sizes))
    xs = [rng.normal(size=(k, 3)).astype(np.float32) for k in sizes]
    w = rng.normal(size=(3, 2)).astype(np.float32)
    outputs = [run_step(s, w, xs, whole_mesh, monkeypatch, mixed_step)
               for whole_mesh in (True, False)]
    assert_same_outputs(s, outputs)
    gathered, empty, total, first, first_sum = outputs[0]
    want = mixed_reference(w, xs)
    assert_local_results(s, gathered, [want[0]] * len(sizes))
    assert_local_results(s, empty, [want[1]] * len(sizes))
    np.testing.assert_allclose(s.experimental_local_results(total), [want[2]] * len(sizes),
                               rtol=1e-5)
    np.testing.assert_allclose(s.experimental_local_results(first), want[3], rtol=1e-6)
    np.testing.assert_allclose(s.experimental_local_results(first_sum), [want[4]] * len(sizes),
                               rtol=1e-5)


def test_pieces_compile_once_for_every_trace_together(monkeypatch):
    """8 replicas with rows of two sizes: a whole-mesh program per piece (2, before and after
    the all-reduce) and the all-reduce's; one device at a time, a program per piece and
    device."""
    s, rng = mirrored(8), np.random.default_rng(0)
    xs = [rng.normal(size=(k, 3)).astype(np.float32) for k in [2, 2, 2, 2, 1, 1, 1, 1]]
    w = np.ones((3, 2), np.float32)
    counts = {}
    for whole_mesh in (True, False):
        with count_compiles() as compiles:
            run_step(s, w, xs, whole_mesh, monkeypatch)
        counts[whole_mesh] = len(compiles)
    assert counts[True] < counts[False] / 3, counts
