"""`NumpyDataset.shuffle` gives tf.data's order (optional dependency: skipped without TF).

The order comes from `jdist._src.tf_shuffle`, which reproduces TF's Philox stream, seeds and
buffer rule; here each pipeline is read from jdist and from ``tf.data`` over three epochs.
"""

import os
import random

import numpy as np
import pytest

from jdist import errors
from jdist._src.numpy_dataset import NumpyDataset

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
tf = pytest.importorskip("tensorflow")

from _tf_reference import strategies  # noqa: E402


def pipeline(seed):
    """A random shuffled pipeline: ``build(dataset)`` applies it to either library's dataset."""
    rnd = random.Random(seed)
    rows, buffer = rnd.randint(0, 60), rnd.choice([1, 2, 5, 10, 64, 1000])
    op_seed = rnd.choice([0, 1, 7, 12345, 2**33 + 5, -3])
    reshuffle, batch_first = rnd.random() < 0.6, rnd.random() < 0.3
    repeat, size = rnd.choice([None, 2]), rnd.randint(1, 5)

    def build(ds):
        ds = ds.batch(size) if batch_first else ds
        ds = ds.shuffle(buffer, seed=op_seed, reshuffle_each_iteration=reshuffle)
        ds = ds.repeat(repeat) if repeat else ds
        return ds if batch_first else ds.batch(size)
    return np.arange(rows), build


def epochs(iterate, count=3):
    """``count`` passes of ``iterate()``, each a list of elements (as lists)."""
    return [[np.asarray(x).tolist() for x in iterate()] for _ in range(count)]


@pytest.mark.parametrize("seed", range(40))
def test_shuffled_pipelines_give_tf_orders_every_epoch(seed):
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


def test_a_global_seed_counts_as_in_tf_and_an_unseeded_shuffle_under_it_raises():
    tf.random.set_seed(4)
    try:
        want = list(tf.data.Dataset.range(20).shuffle(20, seed=2).as_numpy_iterator())
        assert list(NumpyDataset(np.arange(20)).shuffle(20, seed=2)) == want
        with pytest.raises(errors.InvalidArgumentError, match="seed=s"):
            NumpyDataset(np.arange(20)).shuffle(20)
    finally:
        tf.random.set_seed(None)
