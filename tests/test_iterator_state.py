"""Iterator positions in checkpoints (issue 48): a run stopped mid-epoch and resumed from its
checkpoint, on the same or another replica count, sees the same examples in the same order and
ends with the parameters of the run that never stopped."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdist
from jdist import errors
from jdist.checkpoint import iterator_from_state
from jdist.checkpoint import iterator_state
from jdist.testing import mirrored

pytest.importorskip("orbax.checkpoint")

ROWS, BATCH, EPOCHS, STOP = 200, 24, 2, 13  # 9 batches an epoch (the last of 8 rows).


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 8)).astype(np.float32)
    return x, (x.sum(axis=1) > 0).astype(np.int32), np.arange(ROWS, dtype=np.int32)


def dataset(strategy, seed=3):
    return strategy.experimental_distribute_dataset(strategy.experimental_make_numpy_dataset(
        data()).shuffle(ROWS, seed=seed).batch(BATCH))


def init_params():
    rng = np.random.default_rng(1)
    return {"w0": rng.normal(size=(8, 16)).astype(np.float32) / 3, "b0": np.zeros(16, np.float32),
            "w1": rng.normal(size=(16, 2)).astype(np.float32) / 4, "b1": np.zeros(2, np.float32)}


def step(params, x, y, ids):
    """SGD on the global batch's mean loss (summed over replicas, divided by its rows)."""
    ctx = jdist.get_replica_context()
    rows = ctx.all_reduce("sum", x.shape[0])

    def loss(p):
        logits = jnp.tanh(x @ p["w0"] + p["b0"]) @ p["w1"] + p["b1"]
        return -jnp.sum(jax.nn.log_softmax(logits)[jnp.arange(x.shape[0]), y]) / rows
    grads = ctx.all_reduce("sum", jax.grad(loss)(params))
    return jax.tree_util.tree_map(lambda p, g: p - 0.5 * g, params, grads), ids


def train(strategy, params, batches, seen, steps):
    """Runs up to ``steps`` steps from ``batches``; records each global batch's example ids."""
    for _, (x, y, ids) in zip(range(steps), batches):
        params, ids = strategy.run(step, args=(params, x, y, ids))
        seen.append(np.asarray(strategy.gather(ids, axis=0)).tolist())
    return params


def uninterrupted(n):
    strategy, seen = mirrored(n), []
    params, dist = jdist.mirror(init_params(), strategy), dataset(strategy)
    for _ in range(EPOCHS):
        params = train(strategy, params, iter(dist), seen, ROWS)
    return jdist.to_host(params), seen


def interrupted_and_resumed(n, m, directory, seed=3, stop=STOP):
    """Stops after ``stop`` steps on ``n`` replicas (saving), resumes on ``m`` from the checkpoint.
    The restored iterator is read to its end (empty when ``stop`` ended an epoch) before the
    next epoch's is made, as the stopped run read it: its shuffle draws the epoch's seeds."""
    strategy, seen = mirrored(n), []
    params, dist = jdist.mirror(init_params(), strategy), dataset(strategy, seed)
    with jdist.checkpoint.CheckpointManager(directory, strategy) as manager:
        for epoch in range(EPOCHS):
            it = iter(dist)
            params = train(strategy, params, it, seen, stop - epoch * 9)
            if len(seen) == stop:
                assert manager.save(stop, params, iterator=it)
                break
    strategy = mirrored(m)
    dist = dataset(strategy, seed)  # A new process's: its shuffle has made no iterator yet.
    with jdist.checkpoint.CheckpointManager(directory, strategy) as manager:
        params, it = manager.restore(jdist.mirror(init_params(), strategy), iterator=dist)
        params = train(strategy, params, it, seen, ROWS)  # The rest of the stopped epoch.
        for _ in range((stop - 1) // 9 + 1, EPOCHS):
            params = train(strategy, params, iter(dist), seen, ROWS)
    return jdist.to_host(params), seen


REFERENCE = {}


def reference(n):
    if n not in REFERENCE:
        REFERENCE[n] = uninterrupted(n)
    return REFERENCE[n]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_resumed_on_the_same_replica_count_is_bit_identical(n, tmp_path):
    params, seen = reference(n)
    assert len(seen) == EPOCHS * 9 and sorted(sum(seen[:9], [])) == list(range(ROWS))
    resumed, resumed_seen = interrupted_and_resumed(n, n, tmp_path)
    assert resumed_seen == seen
    for key in params:
        np.testing.assert_array_equal(resumed[key], params[key])


@pytest.mark.parametrize("n,m,stop", [(8, 3, STOP), (3, 2, STOP), (2, 4, STOP), (4, 1, STOP),
                                      (1, 8, STOP), (2, 3, 9)])
def test_resumed_on_another_replica_count_matches(n, m, stop, tmp_path):
    """Mid-epoch, and at the end of the first epoch (stop 9)."""
    params, seen = reference(n)
    resumed, resumed_seen = interrupted_and_resumed(n, m, tmp_path, stop=stop)
    assert resumed_seen == seen
    for key in params:
        np.testing.assert_allclose(resumed[key], params[key], rtol=0, atol=1e-6)


def test_an_unseeded_shuffle_resumes_with_its_saved_seeds(tmp_path):
    """``shuffle(seed=None)`` draws new seeds per process: the position carries them."""
    _, seen = interrupted_and_resumed(2, 2, tmp_path, seed=None)
    epoch = sorted(sum(seen[:9], []))
    assert epoch == list(range(ROWS)) and sorted(sum(seen[9:], [])) == epoch
    again = dataset(mirrored(2), seed=None)
    it = iter(again)
    _ = [next(it) for _ in range(STOP - 9)]
    # The resumed epoch's remaining ids are not those of an unrelated fresh shuffle.
    assert seen[STOP:] != [np.asarray(mirrored(2).gather(b[2], axis=0)).tolist() for b in it]


def test_a_python_iterable_cannot_be_positioned(tmp_path):
    strategy = mirrored(2)
    batches = [np.arange(4.0, dtype=np.float32)] * 3
    it = iter(strategy.experimental_distribute_dataset(batches))
    next(it)
    with jdist.checkpoint.CheckpointManager(tmp_path, strategy) as manager:
        with pytest.raises(errors.InvalidArgumentError, match="experimental_make_numpy_dataset"):
            manager.save(1, {"w": np.zeros(2, np.float32)}, iterator=it)
        with pytest.raises(errors.InvalidArgumentError, match="tf.data checkpoints its position"):
            manager.save(1, {"w": np.zeros(2, np.float32)}, iterator=iter(batches))
        assert manager.all_steps() == []


def test_restore_checks_the_pipeline_and_that_a_position_was_saved(tmp_path):
    strategy = mirrored(2)
    it = iter(dataset(strategy))
    next(it)
    saved = iterator_state(it)
    assert saved["batches"] == 1 and saved["seeds"] == [[87654321, 3, 0]]
    other = strategy.experimental_distribute_dataset(
        strategy.experimental_make_numpy_dataset(data()).shuffle(ROWS, seed=3).batch(BATCH + 1))
    with pytest.raises(errors.InvalidArgumentError, match="made as the saved one"):
        iterator_from_state(other, saved)
    with jdist.checkpoint.CheckpointManager(tmp_path, strategy) as manager:
        manager.save(1, {"w": np.zeros(2, np.float32)})
        manager.wait_until_finished()
        with pytest.raises(errors.InvalidArgumentError, match="holds no iterator position"):
            manager.restore({"w": np.zeros(2, np.float32)}, iterator=dataset(strategy))


def test_get_next_steps_counts_only_the_batches_it_hands_out():
    strategy = mirrored(2)
    it = iter(dataset(strategy))
    xs = it.get_next_steps(20)  # Ends before the partial batch, which it hands back.
    assert xs[0].values[0].shape[0] == 8 and iterator_state(it)["batches"] == 8
    resumed = iterator_from_state(dataset(strategy), iterator_state(it))
    np.testing.assert_array_equal(strategy.gather(next(resumed)[2], axis=0),
                                  strategy.gather(next(it)[2], axis=0))
