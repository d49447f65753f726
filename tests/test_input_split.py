"""Distributed datasets split batches exactly as tf.distribute does (SEMANTICS.md, Datasets).

Every per-replica value is compared with NumPy slicing of the unpadded data, for 1, 2, 3, 4, 5
and 8 replicas, with NumPy datasets, lists and generators.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdist
from jdist import errors
from jdist.testing import mirrored


def tf_split(batch, n):
    """TF's rule, written out: consecutive chunks of ceil(B / n) rows."""
    size = batch.shape[0]
    rows = -(-size // n)
    return [batch[min(i * rows, size):min((i + 1) * rows, size)] for i in range(n)]


def local(s, value):
    return [np.asarray(v) for v in s.experimental_local_results(value)]


def assert_split(s, element, batch):
    got = local(s, element)
    want = tf_split(np.asarray(batch), s.num_replicas_in_sync)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(g, w)


# ------------------------------------------------------------------ the rule, literally
def test_semantics_examples_range8_batch4_on_3():
    s = mirrored(3)
    ds = s.experimental_distribute_dataset(s.experimental_make_numpy_dataset(np.arange(8)).batch(4))
    got = [[v.tolist() for v in local(s, b)] for b in ds]
    assert got == [[[0, 1], [2, 3], []], [[4, 5], [6, 7], []]]


def test_semantics_examples_range9_batch2_on_2():
    s = mirrored(2)
    ds = s.experimental_distribute_dataset(s.experimental_make_numpy_dataset(np.arange(9)).batch(2))
    got = [[v.tolist() for v in local(s, b)] for b in ds]
    assert got == [[[0], [1]], [[2], [3]], [[4], [5]], [[6], [7]], [[8], []]]


@pytest.mark.parametrize("size,batch", [(17, 6), (8, 4), (9, 2), (5, 8), (24, 8), (3, 1)])
def test_numpy_dataset_every_batch_split_by_tf_rule(s, size, batch):
    x = np.arange(size * 3, dtype=np.float32).reshape(size, 3)
    dist = s.experimental_distribute_dataset(s.experimental_make_numpy_dataset(x).batch(batch))
    elements = list(dist)
    assert len(elements) == -(-size // batch)  # Every batch, including the partial one.
    for i, element in enumerate(elements):
        assert_split(s, element, x[i * batch:(i + 1) * batch])


def test_list_of_dict_and_tuple_batches_split_leaf_by_leaf(s):
    rng = np.random.default_rng(0)
    batches = [{"x": rng.normal(size=(b, 2, 3)).astype(np.float32),
                "y": (np.arange(b, dtype=np.int32), rng.integers(0, 9, size=(b,)).astype(np.int32))}
               for b in (10, 10, 7, 1)]
    dist = s.experimental_distribute_dataset(batches)
    for element, batch in zip(dist, batches, strict=True):
        assert set(element) == {"x", "y"} and isinstance(element["y"], tuple)
        assert_split(s, element["x"], batch["x"])
        assert_split(s, element["y"][0], batch["y"][0])
        assert_split(s, element["y"][1], batch["y"][1])


def test_generator_function_and_generator_object(s):
    def gen():
        for b in (6, 6, 4):
            yield np.arange(b, dtype=np.int32) * 10

    for source in (gen, gen()):
        elements = list(s.experimental_distribute_dataset(source))
        assert len(elements) == 3
        for element, b in zip(elements, (6, 6, 4)):
            assert_split(s, element, np.arange(b, dtype=np.int32) * 10)


def test_jax_array_batches_are_accepted(s):
    batches = [jnp.arange(6.0), jnp.arange(3.0)]
    for element, batch in zip(s.experimental_distribute_dataset(batches), batches):
        assert_split(s, element, np.asarray(batch))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "uint8", "bool", "complex64"])
def test_batches_of_every_dtype_a_device_holds_are_split(s, dtype):
    """bfloat16 (an ml_dtypes dtype, as tf.data hands it over) was refused as not a number."""
    batches = [(np.arange(7) % 3).astype(jnp.dtype(dtype)), np.ones(2, jnp.dtype(dtype))]
    for element, batch in zip(s.experimental_distribute_dataset(batches), batches,
                              strict=True):
        assert_split(s, element, batch)


def test_unbatched_dataset_on_several_replicas_is_a_clear_error():
    s = mirrored(2)
    with pytest.raises(errors.InvalidArgumentError, match="unbatched"):
        s.experimental_distribute_dataset(s.experimental_make_numpy_dataset(np.arange(4)))
    it = iter(s.experimental_distribute_dataset([np.float32(1.0)]))
    with pytest.raises(errors.InvalidArgumentError, match="batch the dataset"):
        next(it)


def test_unbatched_dataset_on_one_replica_passes_elements_through():
    s = mirrored(1)
    rows = np.arange(3, dtype=np.float32)
    ds = s.experimental_distribute_dataset(s.experimental_make_numpy_dataset(rows))
    assert [float(x) for x in ds] == [0.0, 1.0, 2.0]


def test_leaves_with_different_batch_sizes_are_an_error():
    s = mirrored(2)
    it = iter(s.experimental_distribute_dataset([(np.float32([0] * 4), np.float32([0] * 3))]))
    with pytest.raises(errors.InvalidArgumentError, match="leading"):
        next(it)


def test_strings_are_an_error():
    s = mirrored(2)
    with pytest.raises(errors.InvalidArgumentError, match="dtype"):
        next(iter(s.experimental_distribute_dataset([np.array(["a", "b"])])))


# ------------------------------------------------------------- the padded representation
def test_reduce_and_gather_of_partial_batches_equal_numpy(s):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(23, 2)).astype(np.float32)
    dist = s.experimental_distribute_dataset(s.experimental_make_numpy_dataset(x).batch(10))
    for i, element in enumerate(dist):
        batch = x[i * 10:(i + 1) * 10]
        np.testing.assert_allclose(s.reduce("sum", element, axis=0), batch.sum(0), rtol=1e-5)
        np.testing.assert_allclose(s.reduce("mean", element, axis=0), batch.mean(0), rtol=1e-5)
        np.testing.assert_allclose(s.reduce("mean", element, axis=(0, 1)), batch.mean(), rtol=1e-5)
        np.testing.assert_array_equal(s.gather(element, 0), batch)


def test_uneven_mean_is_tf_mean():
    s = mirrored(2)
    element = next(iter(s.experimental_distribute_dataset([np.array([5.0, 6.0, 7.0], np.float32)])))
    assert [v.tolist() for v in local(s, element)] == [[5.0, 6.0], [7.0]]
    assert float(s.reduce("mean", element, axis=0)) == 6.0
    assert s.gather(element, 0).tolist() == [5.0, 6.0, 7.0]


# --------------------------------------------------------- distribute_datasets_from_function
def test_datasets_from_function_deals_per_replica_batches_in_order(s):
    n = s.num_replicas_in_sync
    contexts = []

    def dataset_fn(ctx):
        contexts.append(ctx)
        per_replica = ctx.get_per_replica_batch_size(2 * n)
        return s.experimental_make_numpy_dataset(np.arange(7 * n + 1)).batch(per_replica)

    dist = s.distribute_datasets_from_function(dataset_fn)
    assert [(c.num_input_pipelines, c.input_pipeline_id, c.num_replicas_in_sync)
            for c in contexts] == [(1, 0, n)]
    batches = [np.arange(7 * n + 1)[i:i + 2] for i in range(0, 7 * n + 1, 2)]
    elements = list(dist)
    assert len(elements) == -(-len(batches) // n)
    for k, element in enumerate(elements):
        got = local(s, element)
        for r in range(n):
            want = batches[k * n + r] if k * n + r < len(batches) else np.zeros(0, np.int32)
            np.testing.assert_array_equal(got[r], want)
            assert got[r].shape == want.shape


def test_datasets_from_function_per_replica_mode(s):
    n = s.num_replicas_in_sync
    contexts = []

    def dataset_fn(ctx):
        contexts.append(ctx)
        rid = ctx.input_pipeline_id
        # Replica r reads r + 1 batches.
        return [np.full((2,), 10 * rid + k, np.int32) for k in range(rid + 1)]

    options = jdist.InputOptions(
        experimental_replication_mode=jdist.InputReplicationMode.PER_REPLICA)
    elements = list(s.distribute_datasets_from_function(dataset_fn, options))
    assert [(c.num_input_pipelines, c.input_pipeline_id) for c in contexts] == [
        (n, i) for i in range(n)]
    assert len(elements) == n
    for k, element in enumerate(elements):
        for r, value in enumerate(local(s, element)):
            want = [10 * r + k] * 2 if k <= r else []
            assert value.tolist() == want


# TF: unbatched (rank-0) elements give one element per replica per step, and the data ends where
# a step would lack one: 5 scalars over 2 replicas give [0, 1], [2, 3] (4 is never seen).
@pytest.mark.parametrize("n, size", [(1, 3), (2, 5), (3, 5), (4, 8), (8, 7)])
@pytest.mark.parametrize("mode", ["PER_WORKER", "PER_REPLICA"])
@pytest.mark.parametrize("make", ["numpy", "list"])
def test_datasets_from_function_unbatched_elements_one_per_replica(n, size, mode, make):
    s = mirrored(n)

    def dataset_fn(ctx):
        rows = np.arange(size, dtype=np.int32)
        if mode == "PER_REPLICA":  # Replica r reads rows r, r + n, ...
            rows = rows[ctx.input_pipeline_id::n]
        return (s.experimental_make_numpy_dataset(rows) if make == "numpy"
                else [np.int32(v) for v in rows])

    options = jdist.InputOptions(experimental_replication_mode=mode)
    dist = s.distribute_datasets_from_function(dataset_fn, options)
    want = np.arange(size // n * n).reshape(-1, n)
    got = [np.stack(local(s, element)) for element in dist]
    np.testing.assert_array_equal(np.array(got).reshape(-1, n), want)
    first = size if mode == "PER_WORKER" else len(range(0, size, n))  # Replica 0's dataset.
    assert dist.cardinality == first  # TF's: the first dataset's elements, not the steps.
    assert dist.element_spec == jax.ShapeDtypeStruct((), np.int32)
    outs = [s.run(lambda x: x * 10, args=(element,)) for element in dist]
    np.testing.assert_array_equal(np.array([np.stack(local(s, o)) for o in outs]).reshape(-1, n),
                                  want * 10)


def test_input_context():
    ctx = jdist.InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=4)
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (2, 1, 4)
    assert ctx.get_per_replica_batch_size(8) == 2
    with pytest.raises(ValueError, match="not divisible"):
        ctx.get_per_replica_batch_size(10)
    default = jdist.InputContext()
    assert (default.num_input_pipelines, default.input_pipeline_id,
            default.num_replicas_in_sync) == (1, 0, 1)

