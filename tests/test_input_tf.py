"""tf.data input (optional dependency): jdist splits tf.data datasets exactly as tf.distribute does.

Skipped when TensorFlow is not importable. When it is, jdist's per-replica values are compared with
what a real ``tf.distribute.MirroredStrategy`` over logical CPU devices gives for the same dataset.
"""

import os

import jax
import numpy as np
import pytest

import jdist
from jdist.testing import DATASET_REPLICA_COUNTS

COUNTS = DATASET_REPLICA_COUNTS


os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from _tf_skip import tf_or_skip  # noqa: E402

tf = tf_or_skip()

from _tf_reference import strategies  # noqa: E402


def tf_split(batch, n):
    size = batch.shape[0]
    rows = -(-size // n)
    return [batch[min(i * rows, size):min((i + 1) * rows, size)] for i in range(n)]


def tf_reference(tf_strategy, dataset, n, from_function=False):
    """Per element, per leaf, the list of replica values TF gives (NumPy slicing without TF)."""
    if tf_strategy is None:
        if from_function:
            pytest.skip("TensorFlow's devices were configured before this test.")
        return [[tf_split(np.asarray(leaf), n) for leaf in tf.nest.flatten(b)]
                for b in dataset.as_numpy_iterator()]
    out = []
    for element in (tf_strategy.distribute_datasets_from_function(dataset) if from_function
                    else tf_strategy.experimental_distribute_dataset(dataset)):
        leaves = tf.nest.flatten(element, expand_composites=False)
        out.append([[np.asarray(v) for v in tf_strategy.experimental_local_results(leaf)]
                    for leaf in leaves])
    return out


def jdist_values(strategy, dist):
    return [[[np.asarray(v) for v in strategy.experimental_local_results(leaf)]
             for leaf in jax.tree_util.tree_leaves(element, is_leaf=is_distributed)]
            for element in dist]


def is_distributed(x):
    return isinstance(x, jdist.DistributedValues)


def assert_same(got, want):
    assert len(got) == len(want)
    for g_el, w_el in zip(got, want):
        assert len(g_el) == len(w_el)
        for g_leaf, w_leaf in zip(g_el, w_el):
            assert [v.shape for v in g_leaf] == [v.shape for v in w_leaf]
            for g, w in zip(g_leaf, w_leaf):
                # The dtype JAX holds TF's in: tf.data's int64 as int32 without x64.
                assert g.dtype == jax.dtypes.canonicalize_dtype(w.dtype)
                np.testing.assert_array_equal(g, w)


DATASETS = {
    "range8_batch4": lambda: tf.data.Dataset.range(8).batch(4),
    "range9_batch2": lambda: tf.data.Dataset.range(9).batch(2),
    "dict_batch5": lambda: tf.data.Dataset.from_tensor_slices(
        {"x": np.arange(22.0, dtype=np.float32).reshape(11, 2),
         "y": np.arange(11, dtype=np.int32)}).batch(5),
    "tuple_drop": lambda: tf.data.Dataset.from_tensor_slices(
        (np.arange(13, dtype=np.float32), np.arange(13, dtype=np.int32))).batch(6, True),
    "narrow_dtypes_batch4": lambda: tf.data.Dataset.from_tensor_slices(  # Images, masks.
        {d: tf.cast(tf.range(7) % 3, d) for d in ("bfloat16", "float16", "uint8", "bool")}
    ).batch(4),
}


@pytest.mark.parametrize("n", COUNTS)
@pytest.mark.parametrize("name", sorted(DATASETS))
def test_experimental_distribute_dataset_matches_tf(n, name):
    strategy, tf_strategy = strategies(n)
    dist = strategy.experimental_distribute_dataset(DATASETS[name]())
    assert_same(jdist_values(strategy, dist), tf_reference(tf_strategy, DATASETS[name](), n))
    assert dist.cardinality == int(DATASETS[name]().cardinality())


@pytest.mark.parametrize("n", COUNTS)
def test_distribute_datasets_from_function_matches_tf(n):
    strategy, tf_strategy = strategies(n)
    contexts = []

    def dataset_fn(ctx):
        contexts.append((ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync))
        return tf.data.Dataset.range(3 * n + 1).batch(2)

    got = jdist_values(strategy, strategy.distribute_datasets_from_function(dataset_fn))
    assert contexts == [(1, 0, n)]
    assert_same(got, tf_reference(tf_strategy, dataset_fn, n, from_function=True))


def optional_values(strategy, dist):
    """Per element, per leaf, the replica values, read with ``get_next_as_optional``."""
    iterator, out = iter(dist), []
    while True:
        optional = iterator.get_next_as_optional()
        if not bool(optional.has_value()):
            return out
        leaves = tf.nest.flatten(optional.get_value())
        out.append([[np.asarray(v) for v in strategy.experimental_local_results(leaf)]
                    for leaf in leaves])


@pytest.mark.parametrize("n", COUNTS)
@pytest.mark.parametrize("drop_remainder", [False, True])
@pytest.mark.parametrize("rows", [None, 1, 3, 4])
@pytest.mark.parametrize("read", ["for", "get_next_as_optional"])
def test_the_last_round_of_replicas_matches_tf(n, drop_remainder, rows, read):
    """Per-replica batches whose count is not a multiple of the replicas: TF gives the replicas
    left over empty batches, unless the batches have a static shape (``drop_remainder=True``, or
    single examples: ``rows`` None), where ``for`` ends at the last whole round and
    ``get_next_as_optional`` still hands the rest over, with TF's dummies (empty batches, zeros
    for single examples)."""
    strategy, tf_strategy = strategies(n)
    if tf_strategy is None:
        pytest.skip("TensorFlow's devices were configured before this test.")

    def dataset_fn(ctx):
        examples = tf.data.Dataset.range(4 * n + 1).map(lambda v: (v, tf.fill([2], v)))
        return examples if rows is None else examples.batch(rows, drop_remainder=drop_remainder)

    dist = strategy.distribute_datasets_from_function(dataset_fn)
    if read == "for":
        want = tf_reference(tf_strategy, dataset_fn, n, from_function=True)
        assert_same(jdist_values(strategy, dist), want)
        assert dist.cardinality == int(
            tf_strategy.distribute_datasets_from_function(dataset_fn).cardinality)
    else:
        want = optional_values(tf_strategy, tf_strategy.distribute_datasets_from_function(
            dataset_fn))
        assert_same(optional_values(strategy, dist), want)


def test_reduce_and_gather_of_tf_batches():
    strategy, _ = strategies(3)
    x = np.random.default_rng(0).normal(size=(10, 3)).astype(np.float32)
    dist = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices(x).batch(4))
    for i, element in enumerate(dist):
        batch = x[4 * i:4 * i + 4]
        np.testing.assert_allclose(strategy.reduce("mean", element, axis=0), batch.mean(0),
                                   rtol=1e-5)
        np.testing.assert_array_equal(strategy.gather(element, 0), batch)


def test_unbatched_tf_dataset_is_a_clear_error():
    strategy, _ = strategies(2)
    with pytest.raises(ValueError, match="unbatched"):
        strategy.experimental_distribute_dataset(tf.data.Dataset.range(4))
