"""How distributed datasets and iterators end, replay and describe themselves; options and the
TF1 names (SEMANTICS.md, Datasets)."""

import itertools
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st
import pytest

import jdist
from jdist._src import host_values
from jdist import errors
from jdist._src.input import tf_shuffle
from jdist._src.input.numpy_dataset import NumpyDataset
from jdist.testing import mirrored


def gathered(s, element):
    return np.asarray(s.gather(element, 0))


def dataset(s, size=10, batch=4, **options):
    opts = jdist.InputOptions(**options) if options else None
    ds = s.experimental_make_numpy_dataset(np.arange(size, dtype=np.float32)).batch(batch)
    return s.experimental_distribute_dataset(ds, opts)


# ------------------------------------------------------------------------ ending
def test_for_loop_yields_every_batch_and_next_raises_stop_iteration(s):
    dist = dataset(s)
    assert [gathered(s, b).tolist() for b in dist] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    it = iter(dist)
    for _ in range(3):
        next(it)
    for _ in range(2):  # And again: still the end.
        with pytest.raises(StopIteration):
            next(it)


def test_get_next_raises_out_of_range_error(s):
    it = iter(dataset(s))
    assert gathered(s, it.get_next()).tolist() == [0, 1, 2, 3]
    it.get_next()
    it.get_next()
    with pytest.raises(errors.OutOfRangeError):
        it.get_next()
    with pytest.raises(errors.OutOfRangeError):
        it.get_next()


def test_get_next_as_optional_is_empty_forever_after_the_end(s):
    it = iter(dataset(s))
    values = []
    while True:
        opt = it.get_next_as_optional()
        if not opt.has_value():
            break
        values.append(gathered(s, opt.get_value()).tolist())
    assert values == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    for _ in range(3):
        opt = it.get_next_as_optional()
        assert opt.has_value() is False
        with pytest.raises(errors.InvalidArgumentError):
            opt.get_value()
    assert isinstance(opt, jdist.Optional)
    assert opt.element_spec == it.element_spec


def test_iterating_again_replays_the_data(s):
    dist = dataset(s, size=7, batch=3)
    first = [gathered(s, b).tolist() for b in dist]
    second = [gathered(s, b).tolist() for b in dist]
    assert first == second == [[0, 1, 2], [3, 4, 5], [6]]
    a, b = iter(dist), iter(dist)  # Two live iterators are independent.
    assert gathered(s, next(a)).tolist() == gathered(s, next(b)).tolist() == [0, 1, 2]


def test_a_one_shot_generator_is_read_once():
    s = mirrored(2)
    dist = s.experimental_distribute_dataset(np.arange(2 * k, 2 * k + 2) for k in range(3))
    assert len(list(dist)) == 3
    with pytest.raises(errors.InvalidArgumentError, match="one-shot"):
        iter(dist)


def test_a_zero_argument_function_is_re_iterable():
    s = mirrored(2)
    dist = s.experimental_distribute_dataset(
        lambda: (np.arange(2 * k, 2 * k + 2) for k in range(3)))
    assert [gathered(s, b).tolist() for b in dist] == [[0, 1], [2, 3], [4, 5]]
    assert len(list(dist)) == 3


def _sum_steps(s, w, xs):
    for x in xs:
        w = s.run(lambda w, x: w + jdist.get_replica_context().all_reduce("sum", x.sum()),
                  args=(w, x))
    return w


@pytest.mark.parametrize("compile_with", ["jdist.function", "jax.jit"])
@pytest.mark.parametrize("fetch", ["next", "get_next", "get_next_as_optional"])
def test_next_while_tracing_is_a_value_error(s, fetch, compile_with):
    """TF's ``next(iterator)`` inside a ``tf.function`` fetches a new batch per call; a trace
    would compile the batch in as a constant and reuse it on every call, so it raises."""
    it = iter(dataset(s))
    take = {"next": next, "get_next": lambda it: it.get_next(),
            "get_next_as_optional": lambda it: it.get_next_as_optional()}[fetch]
    compiled = (jdist.function if compile_with == "jdist.function" else jax.jit)(
        lambda w: (take(it), w)[1])
    with pytest.raises(ValueError, match="every call would reuse"):
        compiled(jnp.float32(0))
    assert gathered(s, next(it)).tolist() == [0, 1, 2, 3]  # The iterator is untouched.


def test_batches_fetched_outside_and_passed_in(s):
    """What to do instead: pass the batches in (new ones per call)."""
    n = s.num_replicas_in_sync
    dist = dataset(s, size=8 * n, batch=2 * n)  # Even batches: a trace takes one shape.
    it = iter(dist)
    steps = jdist.function(lambda w, xs: _sum_steps(s, w, xs))
    sums = [float(jdist.to_host(steps(jnp.float32(0), [next(it) for _ in range(2)])))
            for _ in range(2)]
    assert sums == [sum(range(4 * n)), sum(range(4 * n, 8 * n))]


@pytest.mark.parametrize("compile_with", ["jdist.function", "jax.jit"])
def test_a_dataset_iterated_while_tracing_is_a_value_error(compile_with):
    """TF's traced ``for x in dataset`` reads the dataset anew per call; a trace would compile
    one epoch in and reuse it (a reshuffled dataset's next epoch silently replaced)."""
    s = mirrored(2)
    data = s.experimental_make_numpy_dataset(np.arange(16, dtype=np.float32))
    dist = s.experimental_distribute_dataset(data.shuffle(16, seed=1).batch(4))
    compiled = (jdist.function if compile_with == "jdist.function" else jax.jit)(
        lambda w: _sum_steps(s, w, dist))
    with pytest.raises(ValueError, match="every call would reuse this epoch"):
        compiled(jnp.float32(0))
    assert len(list(dist)) == 4  # Nothing was opened.


def test_next_inside_the_replica_function_is_a_value_error(s):
    it = iter(dataset(s))

    def step(x):
        next(it)
        return x

    with pytest.raises(ValueError, match="replica function"):
        s.run(step, args=(jnp.float32(1.0),))

    def step_get_next(x):
        it.get_next()
        return x

    with pytest.raises(ValueError, match="replica function"):
        s.run(step_get_next, args=(jnp.float32(1.0),))
    assert gathered(s, next(it)).tolist() == [0, 1, 2, 3]  # The iterator is untouched.


# --------------------------------------------------------- element_spec, cardinality
def test_element_spec_is_one_replicas_full_batch(s):
    n = s.num_replicas_in_sync
    x = {"a": np.zeros((10, 3), np.float32), "b": np.zeros((10,), np.int32)}
    dist = s.experimental_distribute_dataset(s.experimental_make_numpy_dataset(x).batch(6))
    rows = -(-6 // n)
    want = {"a": jax.ShapeDtypeStruct((rows, 3), jnp.float32),
            "b": jax.ShapeDtypeStruct((rows,), jnp.int32)}
    assert dist.element_spec == want
    it = iter(dist)
    assert it.element_spec == want
    for element in it:  # A partial batch's replicas hold at most a full batch's rows.
        for key in x:
            for value in s.experimental_local_results(element[key]):
                assert value.shape[0] <= rows and value.shape[1:] == want[key].shape[1:]


def test_element_spec_of_generators_is_read_from_the_first_batch():
    s = mirrored(4)
    dist = s.experimental_distribute_dataset(lambda: iter([np.zeros((7, 2), np.float32)]))
    assert dist.element_spec == jax.ShapeDtypeStruct((2, 2), jnp.float32)
    host_values._warn_narrowed.cache_clear()  # It warns once per process.
    with pytest.warns(errors.X64CastWarning):  # float64, held as float32 as jax.jit holds it.
        spec = s.experimental_distribute_dataset(lambda: iter([np.zeros((7, 2))])).element_spec
    assert spec == jax.ShapeDtypeStruct((2, 2), jnp.float32)
    one_shot = s.experimental_distribute_dataset(iter([np.zeros((8,), np.int32)]))
    assert one_shot.element_spec == jax.ShapeDtypeStruct((2,), jnp.int32)
    assert [gathered(s, b).shape for b in one_shot] == [(8,)]  # Peeking lost nothing.


def test_cardinality():
    s = mirrored(2)
    ds = s.experimental_make_numpy_dataset(np.arange(10))
    assert s.experimental_distribute_dataset(ds.batch(4)).cardinality == 3
    assert s.experimental_distribute_dataset(ds.batch(4, drop_remainder=True)).cardinality == 2
    assert s.experimental_distribute_dataset(ds.batch(4).repeat()).cardinality == (
        jdist.DistributedDataset.INFINITE_CARDINALITY)
    assert s.experimental_distribute_dataset([np.zeros(2, np.float32)] * 5).cardinality == 5
    gen = s.experimental_distribute_dataset(lambda: iter([np.zeros(2, np.float32)]))
    assert gen.cardinality == jdist.DistributedDataset.UNKNOWN_CARDINALITY
    dealt = s.distribute_datasets_from_function(lambda ctx: ds.batch(2))
    assert dealt.cardinality == 5  # TF's: the per-replica batches, not the 3 steps.


@pytest.mark.parametrize("drop_remainder, steps", [(False, 3), (True, 2)])
def test_batches_that_drop_their_remainder_end_at_the_last_whole_round(drop_remainder, steps):
    # TF: 15 rows in batches of 2 over three replicas. Batches of a static shape end where a
    # replica would lack one; others give the replicas left over empty batches.
    s = mirrored(3)
    ds = s.experimental_make_numpy_dataset(np.arange(15, dtype=np.float32)).batch(2, drop_remainder)
    dealt = s.distribute_datasets_from_function(lambda ctx: ds)
    sizes = [[np.asarray(v).shape[0] for v in s.experimental_local_results(b)] for b in dealt]
    assert sizes == [[2, 2, 2], [2, 2, 2], [2, 1, 0]][:steps]
    assert dealt.cardinality == len(ds)  # TF's: the dataset's batches.


def optional_rounds(s, dist):
    """Each element's per-replica values as lists, read with ``get_next_as_optional``."""
    it, rounds = iter(dist), []
    while (opt := it.get_next_as_optional()).has_value():
        rounds.append(jax.tree_util.tree_map(
            lambda v: [np.asarray(x).tolist() for x in s.experimental_local_results(v)],
            opt.get_value(), is_leaf=lambda v: isinstance(v, jdist.DistributedValues)))
    return rounds


def test_get_next_as_optional_hands_over_the_rounds_next_ends_before():
    # TF's get_next_as_optional goes on while any replica has data, filling the others with
    # dummies: empty batches, and zeros for single examples; next() ends at the last whole round.
    s = mirrored(3)
    batches = s.experimental_make_numpy_dataset(np.arange(15, dtype=np.float32)).batch(
        2, drop_remainder=True)
    dealt = s.distribute_datasets_from_function(lambda ctx: batches)
    assert len(list(dealt)) == 2
    assert optional_rounds(s, dealt)[2] == [[12.0, 13.0], [], []]
    examples = s.distribute_datasets_from_function(
        lambda ctx: s.experimental_make_numpy_dataset((np.arange(4), np.ones((4, 2), np.int32))))
    assert [r[0] for r in optional_rounds(s, examples)] == [[0, 1, 2], [3, 0, 0]]
    assert optional_rounds(s, examples)[1][1] == [[1, 1], [], []]
    assert len(list(examples)) == 1


def test_per_replica_datasets_of_different_lengths_end_as_in_tf():
    s = mirrored(2)
    options = jdist.InputOptions(experimental_fetch_to_device=False,
                                 experimental_replication_mode="PER_REPLICA")

    def dataset_fn(ctx):  # Replica 0 has 2 batches, replica 1 has 4.
        return s.experimental_make_numpy_dataset(
            np.arange(4 + 4 * ctx.input_pipeline_id)).batch(2, drop_remainder=True)
    dealt = s.distribute_datasets_from_function(dataset_fn, options)
    assert [[np.asarray(v).tolist() for v in s.experimental_local_results(b)]
            for b in dealt] == [[[0, 1], [0, 1]], [[2, 3], [2, 3]]]
    assert optional_rounds(s, dealt)[2:] == [[[], [4, 5]], [[], [6, 7]]]


def test_get_next_as_optional_is_empty_where_the_first_dataset_is():
    # TF (input_lib): on one worker, get_next_as_optional is empty at once when the cardinality,
    # the first dataset's, is 0, even where other replicas' datasets have batches; for does not.
    s = mirrored(2)
    options = jdist.InputOptions(experimental_fetch_to_device=False,
                                 experimental_replication_mode="PER_REPLICA")
    dealt = s.distribute_datasets_from_function(  # Replica 0 has no data, replica 1 two batches.
        lambda ctx: s.experimental_make_numpy_dataset(np.arange(4 * ctx.input_pipeline_id))
        .batch(2), options)
    assert dealt.cardinality == 0
    assert [[np.asarray(v).tolist() for v in s.experimental_local_results(b)] for b in dealt] == [
        [[], [0, 1]], [[], [2, 3]]]
    assert optional_rounds(s, dealt) == []


def test_reduce_folds_one_pass():
    s = mirrored(2)
    dist = s.experimental_distribute_dataset(
        s.experimental_make_numpy_dataset(np.arange(5, dtype=np.float32)).batch(2))
    total = dist.reduce(0.0, lambda acc, b: acc + float(s.reduce("sum", b, axis=0)))
    assert total == 10.0


# ------------------------------------------------------------------------ options
def test_input_options_defaults_and_validation():
    o = jdist.InputOptions()
    assert o.experimental_fetch_to_device is True
    assert o.experimental_replication_mode is jdist.InputReplicationMode.PER_WORKER
    assert o.experimental_place_dataset_on_device is False
    assert o.experimental_per_replica_buffer_size == 1  # TF's default: a thread.
    assert jdist.InputOptions(experimental_per_replica_buffer_size=None) == o
    assert jdist.InputOptions(experimental_replication_mode="per_replica") == jdist.InputOptions(
        experimental_replication_mode=jdist.InputReplicationMode.PER_REPLICA)
    with pytest.raises(ValueError):
        jdist.InputOptions(experimental_per_replica_buffer_size=-1)
    with pytest.raises(ValueError):
        jdist.InputOptions(experimental_replication_mode="sideways")
    s = mirrored(2)
    per_replica = jdist.InputOptions(experimental_replication_mode="PER_REPLICA")
    with pytest.raises(errors.InvalidArgumentError, match="distribute_datasets_from_function"):
        s.experimental_distribute_dataset([np.zeros(2, np.float32)], per_replica)
    with pytest.raises(ValueError, match="PER_REPLICA"):
        s.distribute_datasets_from_function(
            lambda ctx: [np.zeros(1, np.float32)],
            jdist.InputOptions(experimental_place_dataset_on_device=True))
    with pytest.raises(ValueError, match="experimental_fetch_to_device"):
        s.distribute_datasets_from_function(
            lambda ctx: [np.zeros(1, np.float32)],
            jdist.InputOptions(experimental_place_dataset_on_device=True,
                               experimental_replication_mode="PER_REPLICA"))
    with pytest.raises(TypeError):
        s.experimental_distribute_dataset([np.zeros(2, np.float32)], options={"buffer": 2})


@pytest.mark.parametrize("n", (1, 3))
def test_fetch_to_device_false_keeps_batches_on_the_host(n):
    s = mirrored(n)
    dist = dataset(s, size=5, batch=3, experimental_fetch_to_device=False)
    elements = list(dist)
    assert all(isinstance(c, np.ndarray) for c in s.experimental_local_results(elements[1]))
    doubled = [s.run(lambda x: x * 2, args=(e,)) for e in elements]
    assert [gathered(s, d).tolist() for d in doubled] == [[0, 2, 4], [6, 8]]


def test_buffer_size_zero_feeds_without_a_thread():
    s = mirrored(2)
    it = iter(dataset(s, experimental_per_replica_buffer_size=0))
    assert not hasattr(it._feed, "thread")
    assert [gathered(s, b).tolist() for b in it] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_invalid_inputs():
    s = mirrored(2)
    with pytest.raises(ValueError, match="experimental_make_numpy_dataset"):
        s.experimental_distribute_dataset(np.arange(4))
    with pytest.raises(ValueError, match="dict"):
        s.experimental_distribute_dataset({"x": np.arange(4)})
    with pytest.raises(TypeError):
        s.experimental_distribute_dataset(3)
    with pytest.raises(TypeError):
        s.distribute_datasets_from_function([np.zeros(2, np.float32)])


# ------------------------------------------------------------------ default strategy
def test_default_strategy_yields_the_global_batches():
    s = jdist.get_strategy()
    dist = s.experimental_distribute_dataset([np.float32([0, 1, 2]), np.float32([0, 1])])
    assert [np.asarray(b).tolist() for b in dist] == [[0.0, 1.0, 2.0], [0.0, 1.0]]
    assert float(s.reduce("sum", next(iter(dist)), axis=0)) == 3.0
    dealt = s.distribute_datasets_from_function(
        lambda ctx: [np.full(2, ctx.num_replicas_in_sync)] * 2)
    assert [np.asarray(b).tolist() for b in dealt] == [[1, 1], [1, 1]]


# --------------------------------------------------------------------- NumpyDataset
def test_numpy_dataset_verbs():
    ds = NumpyDataset({"x": np.arange(10), "y": np.arange(10) * 2})
    assert ds.cardinality() == 10
    batches = list(ds.batch(4))
    assert [b["x"].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert all((b["y"] == 2 * b["x"]).all() for b in batches)
    assert [b.tolist() for b in NumpyDataset(np.arange(5)).batch(2, drop_remainder=True)] == [
        [0, 1], [2, 3]]
    assert [int(x) for x in NumpyDataset(np.arange(5)).skip(1).take(3)] == [1, 2, 3]
    assert [int(x) for x in NumpyDataset(np.arange(7)).shard(3, 1)] == [1, 4]
    assert NumpyDataset(np.arange(7)).shard(3, 1).cardinality() == 2
    assert [int(x) for x in NumpyDataset(np.arange(3)).repeat(2)] == [0, 1, 2, 0, 1, 2]
    assert NumpyDataset(np.arange(3)).repeat().take(7).cardinality() == 7
    nested = NumpyDataset(np.arange(8)).batch(2).batch(2)
    assert nested.element_spec.shape == (2, 2) and next(iter(nested)).tolist() == [[0, 1], [2, 3]]
    with pytest.raises(ValueError):
        NumpyDataset({"x": np.arange(3), "y": np.arange(4)})
    with pytest.raises(ValueError):
        NumpyDataset(np.arange(3)).batch(0)


@pytest.mark.parametrize("drop", [False, True])
@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("size", [0, 1, 5, 8, 13])
def test_batches_of_the_rows_in_order_are_the_consecutive_chunks(size, batch, drop):
    # Batching the rows directly takes the path without per-row work; so does what follows it.
    chunks = [list(range(i, min(i + batch, size))) for i in range(0, size, batch)]
    if drop:
        chunks = [c for c in chunks if len(c) == batch]
    ds = NumpyDataset(np.arange(size) * 10).batch(batch, drop_remainder=drop)
    assert [b.tolist() for b in ds] == [[10 * r for r in c] for c in chunks]
    assert ds.cardinality() == len(chunks)
    assert [b.tolist() for b in ds.repeat(2).take(len(chunks) + 1)] == (
        [[10 * r for r in c] for c in (chunks + chunks)[:len(chunks) + 1]])
    if drop or size % batch == 0:  # Batches of one shape batch again.
        assert [b.tolist() for b in ds.batch(2)] == [
            [[10 * r for r in c] for c in chunks[i:i + 2]] for i in range(0, len(chunks), 2)]


@pytest.mark.parametrize("make", [
    lambda x: NumpyDataset(x).batch(4),
    lambda x: NumpyDataset(x).shuffle(8, seed=1).batch(4),
    lambda x: NumpyDataset(x).repeat(2).batch(3),
    lambda x: NumpyDataset(x).shard(2, 1).batch(2),
])
def test_numpy_dataset_batches_are_read_only_rows_of_the_data(make):
    x = np.arange(30).reshape(10, 3)
    want = [np.stack([x[int(i)] for i in b]) for b in make(np.arange(10))]
    got = list(make(x))
    assert [g.tolist() for g in got] == [w.tolist() for w in want]
    with pytest.raises(ValueError, match="read-only"):
        got[0][0, 0] = -1  # A batch may be a view of the data: writing it would change the data.
    assert x[0, 0] == 0 and x.flags.writeable


@pytest.mark.parametrize("n", [1, 2, 8])
@pytest.mark.parametrize("pipeline", [
    lambda d: d.batch(4), lambda d: d.shuffle(16, 2, reshuffle_each_iteration=False).batch(4),
    lambda d: d])
def test_numpy_dataset_reads_the_data_as_it_was_made(n, pipeline):
    # TF's from_tensor_slices copies its input: writing the arrays afterwards changes nothing.
    s = mirrored(n)
    x = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
    y = np.arange(16)
    want = [np.asarray(b).tolist() for b in pipeline(NumpyDataset(x.copy()))]
    dataset = pipeline(s.experimental_make_numpy_dataset({"x": x, "y": y}))
    x[:] = -1
    y[:] = -1
    assert [b["x"].tolist() for b in dataset] == want
    if n > 1 and dataset.batch_rows:
        got = [np.asarray(s.gather(e["x"], 0)).tolist()
               for e in s.experimental_distribute_dataset(dataset)]
        assert got == want


@pytest.mark.parametrize("make", [
    lambda s, x: s.experimental_distribute_dataset(s.experimental_make_numpy_dataset(x).batch(4)),
    lambda s, x: s.distribute_datasets_from_function(
        lambda ctx: s.experimental_make_numpy_dataset(x).batch(4)),
])
def test_one_replica_batches_are_placed_where_run_takes_them(make):
    s = mirrored(1)
    x = np.arange(24, dtype=np.float32).reshape(8, 3)
    programs = s.extended._programs
    for k, element in enumerate(make(s, x)):
        assert element.sharding == programs.replicated_sharding
        assert programs.place_replicated(element) is element  # `run` takes it as it is.
        np.testing.assert_array_equal(np.asarray(s.run(lambda b: b * 2, args=(element,))),
                                      x[4 * k:4 * k + 4] * 2)


def test_numpy_dataset_shuffles_differently_each_iteration():
    ds = NumpyDataset(np.arange(50)).shuffle(50, seed=3)
    a, b = [int(x) for x in ds], [int(x) for x in ds]
    assert sorted(a) == sorted(b) == list(range(50)) and a != b
    again = NumpyDataset(np.arange(50)).shuffle(50, seed=3)
    assert [int(x) for x in again] == a  # A seed makes the sequence of orders reproducible.
    fixed = NumpyDataset(np.arange(50)).shuffle(50, seed=3, reshuffle_each_iteration=False)
    assert [int(x) for x in fixed] == [int(x) for x in fixed]
    small = [int(x) for x in NumpyDataset(np.arange(50)).shuffle(4, seed=0)]
    assert sorted(small) == list(range(50))
    assert all(x <= i + 4 for i, x in enumerate(small))  # A small buffer shuffles locally.
    epochs = [int(x) for x in NumpyDataset(np.arange(5)).shuffle(5, seed=1).repeat(2)]
    assert sorted(epochs[:5]) == sorted(epochs[5:]) == list(range(5))


@pytest.mark.parametrize("counter, key, want", [  # Random123's known-answer vectors.
    ((0, 0, 0, 0), (0, 0), "6627e8d5 e169c58d bc57ac4c 9b00dbd8"),
    ((0xffffffff,) * 4, (0xffffffff,) * 2, "408f276d 41c83b0e a20bc7c6 6d5451fd"),
    ((0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344), (0xa4093822, 0x299f31d0),
     "d16cfe09 94fdcceb 5001e420 24126ea1")])
def test_shuffle_draws_from_philox4x32_10_as_tf_does(counter, key, want):
    c0, c1, c2, c3 = counter
    block = tf_shuffle.philox_blocks(key[1] << 32 | key[0], c3 << 32 | c2, c1 << 32 | c0, 1)
    assert " ".join(f"{int(v):08x}" for v in block) == want


def test_shuffle_order_follows_tf_buffer_rule():
    # A buffer of 1 is the identity; a buffer of b never moves an element more than b - 1 ahead.
    assert [int(x) for x in NumpyDataset(np.arange(9)).shuffle(1, seed=4)] == list(range(9))
    order = [int(x) for x in NumpyDataset(np.arange(40)).shuffle(3, seed=4)]
    assert sorted(order) == list(range(40)) and all(x <= i + 2 for i, x in enumerate(order))
    huge = NumpyDataset(np.arange(10)).shuffle(2**40, seed=4)  # The buffer holds what comes.
    assert sorted(int(x) for x in huge) == list(range(10))


def tf_ring_buffer_shuffle(items, buffer_size, seeds):
    """tf.data's shuffle, written out one output at a time: fill the ring buffer, output the
    item ``sample % count`` places after the oldest, move the oldest into its place."""
    sample, buffer, items = tf_shuffle.Samples(*seeds), [], iter(items)
    start = end = 0
    while True:
        for item in items if end - start < buffer_size else ():
            if end < buffer_size:
                buffer.append(item)
            else:
                buffer[end % buffer_size] = item
            end += 1
            if end - start == buffer_size:
                break
        if end == start:
            return
        index = (start + sample() % (end - start)) % buffer_size
        yield buffer[index]
        buffer[index] = buffer[start % buffer_size]
        start += 1


@pytest.mark.parametrize("size", [0, 1, 5, 1023, 1024, 1025, 3000])
@pytest.mark.parametrize("buffer_size", [1, 2, 7, 1000, 1024, 1025, 2**40])
@pytest.mark.parametrize("kind", ["ints", "objects"])
def test_shuffle_order_is_the_ring_buffer_rule_output_by_output(size, buffer_size, kind):
    # The order is computed a chunk at a time and the drain at once (`tf_shuffle.shuffled`).
    items = list(range(size)) if kind == "ints" else [("row", i) for i in range(size)]
    for seeds in [(1, 2), (87654321, 5), (0, 2**31 - 1)]:
        want = list(tf_ring_buffer_shuffle(items, buffer_size, seeds))
        assert list(tf_shuffle.shuffled(lambda: iter(items), buffer_size, seeds)) == want
        assert sorted(want, key=str) == sorted(items, key=str)


@settings(max_examples=300, deadline=None)
@given(size=st.integers(1, 12), oldest=st.integers(0, 11), data=st.data())
def test_a_full_rings_steps_at_once_are_its_steps_one_by_one(size, oldest, data):
    # Row indices go through a chunk of full-buffer steps as arrays (`_full_ring_steps`).
    offsets = data.draw(st.lists(st.integers(0, size - 1), min_size=1, max_size=40))
    oldest %= size
    ring, incoming = list(range(100, 100 + size)), list(range(1000, 1000 + len(offsets)))
    want = tf_shuffle._ring_steps(ring, oldest, offsets, incoming)
    at_once = np.arange(100, 100 + size)
    got = tf_shuffle._full_ring_steps(at_once, oldest, np.array(offsets), np.array(incoming))
    assert got.tolist() == want and at_once.tolist() == ring


@pytest.mark.parametrize("buffer_size", [1000, 50000])
def test_a_long_shuffle_of_rows_is_the_ring_buffer_rule(buffer_size):
    # 150 000 rows: chunks of full-buffer steps grow to their largest (2**16) and drain.
    seeds = (87654321, 9)
    want = list(tf_ring_buffer_shuffle(range(150_000), buffer_size, seeds))
    rows = lambda: tf_shuffle.Rows(range(150_000))  # noqa: E731  (read as arrays)
    assert list(tf_shuffle.shuffled(rows, buffer_size, seeds)) == want


@pytest.mark.parametrize("rows,times", [(3000, 2), (3000, 3), (3000, None), (0, None), (1, 5)])
def test_a_shuffle_of_repeated_rows_is_the_ring_buffer_rule(rows, times):
    # repeat() before shuffle: the rows reach the shuffle as arrays (`tf_shuffle.Rows`); an
    # endless repeat's outputs are those of a long finite one until that one drains.
    seeds, buffer_size = (87654321, 4), 1000
    items = list(range(rows)) * (times or 4)
    want = list(tf_ring_buffer_shuffle(items, buffer_size, seeds))
    count = len(want) if times else max(0, len(items) - buffer_size)
    got = tf_shuffle.shuffled(lambda: tf_shuffle.Rows(range(rows), times), buffer_size, seeds)
    assert list(itertools.islice(got, count)) == want[:count]
    assert list(tf_shuffle.Rows(range(rows), times or 4)) == items


@pytest.mark.parametrize("size", [0, 5, 1025, 3000])
@pytest.mark.parametrize("buffer_size", [1, 7, 1000, 2**40])
@pytest.mark.parametrize("batch,drop", [(1, False), (3, True), (256, False), (256, True)])
def test_batches_of_a_shuffle_hold_its_order_in_consecutive_runs(size, buffer_size, batch, drop):
    # A batch right after a shuffle cuts its runs of row indices as arrays (`_Batch`).
    order = list(tf_ring_buffer_shuffle(range(size), buffer_size, tf_shuffle.op_seeds(3)))
    cut = len(order) - len(order) % batch if drop else len(order)
    want = [order[i:i + batch] for i in range(0, cut, batch)]
    x = np.arange(size) * 10
    dataset = NumpyDataset(x).shuffle(buffer_size, 3, reshuffle_each_iteration=False)
    assert [b.tolist() for b in dataset.batch(batch, drop)] == [[10 * i for i in w] for w in want]


CUTS = {"take": (lambda d: d.take(1500), slice(1500)),
        "skip": (lambda d: d.skip(700), slice(700, None)),
        "shard": (lambda d: d.shard(3, 2), slice(2, None, 3)),
        "shard, then take": (lambda d: d.shard(4, 1).take(300), slice(1, 1201, 4))}


@pytest.mark.parametrize("cut", CUTS)
@pytest.mark.parametrize("buffer_size", [1, 100, 5000])
def test_a_shuffle_after_a_take_skip_or_shard_is_the_ring_buffer_rule(cut, buffer_size):
    # The rows they leave reach the shuffle as arrays (`tf_shuffle.Rows.sliced`).
    verb, rows = CUTS[cut]
    want = list(tf_ring_buffer_shuffle(range(3000)[rows], buffer_size, tf_shuffle.op_seeds(8)))
    x = np.arange(3000) * 10
    shuffled = verb(NumpyDataset(x)).shuffle(buffer_size, 8, reshuffle_each_iteration=False)
    assert [int(v) for v in shuffled] == [10 * i for i in want]
    assert isinstance(verb(NumpyDataset(x))._indices()(), tf_shuffle.Rows)


@pytest.mark.parametrize("cut", CUTS)
@pytest.mark.parametrize("batch,drop", [(1, False), (7, False), (7, True), (4096, False)])
def test_batches_after_a_take_skip_or_shard_are_its_rows_in_order(cut, batch, drop):
    verb, rows = CUTS[cut]
    kept = list(range(3000)[rows])
    stop = len(kept) - len(kept) % batch if drop else len(kept)
    want = [[10 * i for i in kept[i:i + batch]] for i in range(0, stop, batch)]
    got = verb(NumpyDataset(np.arange(3000) * 10)).batch(batch, drop)
    assert [b.tolist() for b in got] == want


def test_a_take_of_repeated_rows_keeps_every_epochs_rows():
    # Rows read twice are no one range: the take counts them as they come.
    dataset = NumpyDataset(np.arange(5)).repeat(2).take(7).shuffle(3, 1, False)
    want = list(tf_ring_buffer_shuffle([0, 1, 2, 3, 4, 0, 1], 3, tf_shuffle.op_seeds(1)))
    assert [int(v) for v in dataset] == want


@pytest.mark.parametrize("seed", [5.5, "3", [1]])
def test_a_shuffle_seed_that_is_not_an_int_is_refused(seed):
    with pytest.raises(errors.InvalidArgumentError, match="seed must be an int"):
        NumpyDataset(np.arange(4)).shuffle(4, seed=seed)


def test_element_spec_does_not_consume_a_shuffle_order():
    s = mirrored(2)
    make = lambda: s.experimental_make_numpy_dataset(np.arange(12)).shuffle(12, seed=5).batch(4)
    dist = s.experimental_distribute_dataset(make())
    assert dist.element_spec == jax.ShapeDtypeStruct((2,), jnp.int32)
    first_epoch = np.concatenate([gathered(s, b) for b in dist])
    assert first_epoch.tolist() == np.concatenate(list(make())).tolist()


def test_importing_jdist_does_not_import_tensorflow():
    code = ("import sys, numpy as np, jdist; s = jdist.get_strategy(); "
            "list(s.experimental_distribute_dataset([np.zeros(2, np.float32)])); "
            "assert 'tensorflow' not in sys.modules, 'tensorflow was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_next_under_an_eager_grad_fetches_a_new_batch_per_call():
    """Only staging traces (jit, jdist.function, scan) replay a program; an eager jax.grad runs
    its function on every call, so next(iterator) there is a new batch each time."""
    s = jdist.OneDeviceStrategy("cpu:0")
    it = iter(dataset(s, size=8, batch=4))
    grads = [float(jax.grad(lambda w: jnp.sum(w * jnp.asarray(next(it))))(1.0)) for _ in range(2)]
    assert grads == [0 + 1 + 2 + 3, 4 + 5 + 6 + 7]
