"""`NumpyDataset.shuffle` gives tf.data's order (optional dependency: skipped without TF).

The order comes from `jdist._src.input.tf_shuffle`, which reproduces TF's Philox stream, seeds and
buffer rule; here each pipeline is read from jdist and from ``tf.data`` over three epochs.
Distributed, larger pipelines take every way jdist places batches (read in place, blocks,
shuffled blocks, one replica's plain arrays) and must still give TF's elements and steps.
"""

import os
import random

import jax.numpy as jnp
import numpy as np
import pytest

import jdist
from jdist import errors
from jdist._src.input.numpy_dataset import NumpyDataset

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from _tf_skip import tf_or_skip  # noqa: E402

tf = tf_or_skip()

from _tf_reference import assert_matches  # noqa: E402
from _tf_reference import local_results  # noqa: E402
from _tf_reference import outcome  # noqa: E402
from _tf_reference import strategies  # noqa: E402


def pipeline(seed):
    """A random pipeline of NumpyDataset's verbs: ``build(dataset)`` applies it to either
    library's dataset of ``data``."""
    rnd = random.Random(seed)
    rows = rnd.randint(0, 40)
    data = rnd.choice([np.arange(rows), {"a": np.arange(rows), "b": np.arange(rows) * 10}])
    verbs = {
        "batch": lambda: ("batch", rnd.randint(1, 6), rnd.random() < 0.3),
        "shuffle": lambda: ("shuffle", rnd.choice([1, 3, 8, 100]),
                            rnd.choice([0, 5, 2**33 + 5, -3]), rnd.random() < 0.6),
        "repeat": lambda: ("repeat", rnd.choice([1, 2, 3])),
        "take": lambda: ("take", rnd.choice([-1, 0, 1, 3, 7])),
        "skip": lambda: ("skip", rnd.choice([-1, 0, 1, 3])),
        "shard": lambda: ("shard", 2, rnd.randint(0, 1)),
        "prefetch": lambda: ("prefetch", rnd.choice([0, 2])),
    }
    names = ["shuffle"] + [rnd.choice(list(verbs)) for _ in range(rnd.randint(0, 4))]
    rnd.shuffle(names)
    ops = [verbs[name]() for name in names]

    def build(ds):
        for name, *args in ops:
            ds = (ds.shuffle(args[0], seed=args[1], reshuffle_each_iteration=args[2])
                  if name == "shuffle" else
                  ds.batch(args[0], drop_remainder=args[1]) if name == "batch" else
                  getattr(ds, name)(*args))
        return ds
    return data, build


def epochs(iterate, count=3):
    """``count`` passes of ``iterate()``, each a list of elements (leaves as lists)."""
    return [[[np.asarray(leaf).tolist() for leaf in tf.nest.flatten(x)] for x in iterate()]
            for _ in range(count)]


@pytest.mark.parametrize("seed", range(60))
def test_shuffled_pipelines_give_tf_orders_every_epoch(seed):
    """Every epoch's order, repeats and tf.data's graph rewrites included (a repeat right after
    a shuffle is fused with it; others make one more input after their last epoch)."""
    data, build = pipeline(seed)
    tf_dataset = build(tf.data.Dataset.from_tensor_slices(data))
    assert epochs(build(NumpyDataset(data)).__iter__) == epochs(tf_dataset.as_numpy_iterator)


@pytest.mark.parametrize("n", [2, 3])
def test_distributed_shuffled_numpy_data_matches_tf(n):
    strategy, tf_strategy = strategies(n)
    if tf_strategy is None:
        pytest.skip("TensorFlow's devices were configured before this test.")
    x = np.arange(31, dtype=np.float32)
    ours = strategy.experimental_distribute_dataset(
        strategy.experimental_make_numpy_dataset(x).shuffle(10, seed=11).batch(4))
    theirs = tf_strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices(x).shuffle(10, seed=11).batch(4))

    def values(s, dist):
        return [[np.asarray(v).tolist() for v in s.experimental_local_results(e)] for e in dist]
    for _ in range(2):
        assert values(strategy, ours) == values(tf_strategy, theirs)


def test_a_repeat_of_zero_after_a_shuffle_raises_as_in_tf():
    with pytest.raises(tf.errors.InvalidArgumentError, match="count must be greater"):
        list(tf.data.Dataset.range(4).shuffle(4, seed=1).repeat(0))
    with pytest.raises(errors.InvalidArgumentError, match="count must be greater"):
        list(NumpyDataset(np.arange(4)).shuffle(4, seed=1).repeat(0))
    assert list(NumpyDataset(np.arange(4)).repeat(0)) == []


def test_a_global_seed_counts_as_in_tf_and_an_unseeded_shuffle_under_it_raises():
    tf.random.set_seed(4)
    try:
        want = list(tf.data.Dataset.range(20).shuffle(20, seed=2).as_numpy_iterator())
        assert list(NumpyDataset(np.arange(20)).shuffle(20, seed=2)) == want
        with pytest.raises(errors.InvalidArgumentError, match="seed=s"):
            NumpyDataset(np.arange(20)).shuffle(20)
    finally:
        tf.random.set_seed(None)


@pytest.mark.parametrize("make", ["from_tensor_slices", "experimental_make_numpy_dataset"])
def test_writes_to_the_input_after_the_dataset_is_made_change_nothing_as_in_tf(make):
    def read(dataset):
        return [np.asarray(b).tolist() for b in dataset.batch(3)]

    def made(module_dataset, strategy):
        x = np.arange(12, dtype=np.float32).reshape(6, 2)
        dataset = (module_dataset.from_tensor_slices(x) if make == "from_tensor_slices"
                   else strategy.experimental_make_numpy_dataset(x))
        x *= -1
        return read(dataset)
    tf_strategy = tf.compat.v1.distribute.MirroredStrategy(["/cpu:0"])
    got = made(NumpyDataset, jdist.get_strategy())
    assert got == made(tf.data.Dataset, tf_strategy)
    assert got[0] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]


def larger_pipeline(seed):
    """``(replicas, data, build)``: a batched pipeline of 100-700 rows of float features and
    integer labels, large enough for the paths small data never takes (batches read in place,
    blocks, shuffled blocks); ``build(dataset)`` applies it to either library's dataset."""
    rnd = random.Random(seed)
    n, rows, width = rnd.choice([1, 2, 3, 4, 8]), rnd.randint(100, 700), rnd.choice([1, 4, 16])
    data = {"x": np.arange(rows * width, dtype=np.float32).reshape(rows, width) / 7,
            "y": np.arange(rows, dtype=rnd.choice([np.int32, np.int64])) % 5}
    ops = [op for op, chance in ((("shuffle", rnd.choice([4, 64, 1000]), 7), 0.5),
                                 (("repeat", 2), 0.3), (("take", rnd.choice([100, 300])), 0.2))
           if rnd.random() < chance]
    rnd.shuffle(ops)
    batch = rnd.choice([16 * n, 64 * n, 4 * n, 64, n + 1, 5 * n + 3])  # 16 * n: read in place
    drop = rnd.random() < 0.3

    def build(ds):
        for name, *args in ops:
            ds = ds.shuffle(args[0], seed=args[1]) if name == "shuffle" else getattr(
                ds, name)(*args)
        return ds.batch(batch, drop_remainder=drop)
    return n, data, build


def _sum_step(batch):
    return jdist.get_replica_context().all_reduce(
        "sum", jnp.sum(batch["x"]) + jnp.sum(batch["y"].astype(jnp.float32)))


def _tf_sum_step(batch):
    return tf.distribute.get_replica_context().all_reduce(
        "sum", tf.reduce_sum(batch["x"]) + tf.reduce_sum(tf.cast(batch["y"], tf.float32)))


@pytest.mark.parametrize("seed", range(12))
def test_distributed_larger_pipelines_and_steps_on_them_match_tf(seed):
    """Every element's local values over two epochs, and a step's all-reduced sum on it."""
    n, data, build = larger_pipeline(seed)
    strategy, tf_strategy = strategies(n)
    if tf_strategy is None:
        pytest.skip("TensorFlow's devices were configured before this test.")
    ours = strategy.experimental_distribute_dataset(
        build(strategy.experimental_make_numpy_dataset(data)))
    theirs = tf_strategy.experimental_distribute_dataset(
        build(tf.data.Dataset.from_tensor_slices(data)))
    for _ in range(2):
        elements = list(zip(ours, theirs, strict=True))
        for got, want in elements:
            for key in ("x", "y"):
                assert_matches(local_results(strategy, got[key]),
                               local_results(tf_strategy, want[key]))
        got, want = elements[seed % len(elements)] if elements else (None, None)
        if got is not None:
            assert_matches(outcome(strategy, lambda: strategy.run(_sum_step, args=(got,))),
                           outcome(tf_strategy, lambda: tf_strategy.run(
                               _tf_sum_step, args=(want,))), rtol=1e-5)
