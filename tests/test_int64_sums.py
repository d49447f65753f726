"""In-step integer all-reduces of int64 host numbers (`jdist._src.int64_sums`).

TF sums int64 numbers in int64; JAX without x64 holds them as int32. A step's SUM across replicas
of integers computed from them is TF's number where the analysis bounds it under 2**31, and
raises `X64RequiredError` at the call where it may wrap. Counts, indices and floats computed from
them are never bounded by them and never raise.
"""

import typing

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdist
from jdist import errors
from jdist.testing import mirrored

REPLICAS = (2, 3, 4, 8)


def all_reduce(value):
    return jdist.get_replica_context().all_reduce("sum", value)


# Step bodies on a batch `y` of int64 labels, with the NumPy (int64) number TF computes.
SUMS = {
    "sum": (lambda y: all_reduce(jnp.sum(y)), lambda ys: sum(np.sum(y) for y in ys)),
    "as is": (lambda y: all_reduce(y), lambda ys: sum(ys)),
    "times 3": (lambda y: all_reduce(jnp.sum(y * 3)), lambda ys: 3 * sum(np.sum(y) for y in ys)),
    "plus 1": (lambda y: all_reduce(jnp.sum(y + 1)), lambda ys: sum(np.sum(y + 1) for y in ys)),
    "in a jitted helper": (lambda y: all_reduce(jax.jit(jnp.sum)(y)),
                           lambda ys: sum(np.sum(y) for y in ys)),
    "reversed slice": (lambda y: all_reduce(y[::-1][:2]), lambda ys: sum(y[::-1][:2] for y in ys)),
    "masked": (lambda y: all_reduce(jnp.sum(jnp.where(y > 1001, y, 0))),
               lambda ys: sum(np.sum(np.where(y > 1001, y, 0)) for y in ys)),
    "times a mask": (lambda y: all_reduce(jnp.sum(y * (y > 1001).astype(jnp.int32))),
                     lambda ys: sum(np.sum(y * (y > 1001)) for y in ys)),
    "float from a jitted helper": (
        lambda y: jax.jit(lambda v: all_reduce(jnp.sum(v)).astype(jnp.float32))(y),
        lambda ys: np.float32(sum(np.sum(y) for y in ys))),
}


def per_replica(n, value):
    return jdist.PerReplica([np.full(4, value, np.int64) + i for i in range(n)])


def run(s, body, value):
    out = s.run(body, args=(value,))
    return np.asarray(s.experimental_local_results(out)[0])


@pytest.mark.parametrize("form", list(SUMS))
@pytest.mark.parametrize("n", REPLICAS)
def test_sums_that_fit_int32_give_tfs_numbers(n, form):
    s, value = mirrored(n), per_replica(n, 1000)
    body, want = SUMS[form]
    np.testing.assert_array_equal(run(s, body, value), want([np.asarray(v) for v in value.values]))


@pytest.mark.parametrize("form", list(SUMS))
@pytest.mark.parametrize("n", REPLICAS)
def test_sums_that_may_wrap_raise_at_the_call(n, form):
    # Every form's bound reaches 2**31 here: 2**31 // n spread over each replica's 4 numbers.
    s, value = mirrored(n), per_replica(n, 2**31 // n)
    with pytest.raises(errors.X64RequiredError, match="int64.*jax_enable_x64"):
        s.run(SUMS[form][0], args=(value,))


@pytest.mark.parametrize("n", REPLICAS)
def test_the_check_reads_every_calls_numbers(n):
    # One program: small labels give TF's number, large ones raise, small ones again compute.
    s, body = mirrored(n), SUMS["sum"][0]
    for value, raises in ((1000, False), (2**31 // n, True), (7, False)):
        values = per_replica(n, value)
        if raises:
            with pytest.raises(errors.X64RequiredError):
                s.run(body, args=(values,))
        else:
            assert run(s, body, values) == sum(np.sum(v) for v in values.values)


class State(typing.NamedTuple):  # As an optax optimizer's state holds its step count.
    count: object
    labels: object


@pytest.mark.parametrize("n", (2, 4))
def test_numbers_inside_namedtuples_are_read_by_path_every_call(n):
    # The checked leaf sits in a namedtuple among float leaves: read by its path each call.
    s = mirrored(n)
    body = lambda w, state: (w * 2, all_reduce(jnp.sum(state[1].labels)))  # noqa: E731
    floats = jdist.PerReplica([np.ones(3, np.float32)] * n)
    for value, raises in ((1000, False), (2**31 // n, True), (7, False)):
        state = (floats, State(jnp.int32(0), per_replica(n, value)))
        if raises:
            with pytest.raises(errors.X64RequiredError):
                s.run(body, args=(floats, state))
            continue
        _, total = s.run(body, args=(floats, state))
        assert np.asarray(s.experimental_local_results(total)[0]) == sum(
            np.sum(v) for v in state[1].labels.values)


@pytest.mark.parametrize("step,want", [
    (lambda y: all_reduce(jnp.sum(y == 2**30)), lambda ys: sum(np.sum(y == 2**30) for y in ys)),
    (lambda y: all_reduce(jnp.zeros(5, jnp.int32).at[y % 5].add(1)),
     lambda ys: sum(np.bincount(y % 5, minlength=5) for y in ys)),
    (lambda y: all_reduce(jnp.argmax(y)), lambda ys: sum(np.argmax(y) for y in ys)),
    (lambda y: all_reduce(jnp.sum(y.astype(jnp.float32))),
     lambda ys: sum(np.sum(y.astype(np.float32)) for y in ys)),
], ids=["count", "confusion row", "argmax", "float"])
@pytest.mark.parametrize("n", REPLICAS)
def test_counts_indices_and_floats_from_large_int64_numbers_need_no_check(n, step, want):
    s = mirrored(n)
    value = jdist.PerReplica([np.array([2**30, 3, 2**30 - i, 7], np.int64) for i in range(n)])
    np.testing.assert_allclose(run(s, step, value), want([np.asarray(v) for v in value.values]))


@pytest.mark.parametrize("n", REPLICAS)
def test_int32_numbers_wrap_as_tfs_int32_sums_do(n):
    s = mirrored(n)
    value = jdist.PerReplica([np.full(2, 2**30, np.int32)] * n)
    want = np.sum(np.full((n, 2), 2**30, np.int32), axis=0, dtype=np.int32)
    np.testing.assert_array_equal(run(s, SUMS["as is"][0], value), want)


@pytest.mark.parametrize("n", REPLICAS)
def test_a_product_of_int64_numbers_raises_unless_they_are_all_zero(n):
    s, square = mirrored(n), lambda y: all_reduce(jnp.sum(y * y))
    with pytest.raises(errors.X64RequiredError):
        s.run(square, args=(per_replica(n, 1) ,))
    zeros = jdist.PerReplica([np.zeros(4, np.int64)] * n)
    assert run(s, square, zeros) == 0


@pytest.mark.parametrize("source", ["host array", "dataset batch"])
@pytest.mark.parametrize("n", (2, 4))
def test_host_arrays_and_dataset_batches_are_checked_too(n, source):
    s, body = mirrored(n), SUMS["sum"][0]
    rows = np.full(4 * n + 1, 2**31 // (4 * n), np.int64)  # Full batches of 4n, then 1 row.
    if source == "host array":
        with pytest.raises(errors.X64RequiredError):  # A replicated array counts n times.
            s.run(body, args=(rows[:4],))
        return
    dataset = s.experimental_make_numpy_dataset(rows).batch(4 * n)
    full, partial = s.experimental_distribute_dataset(dataset)
    with pytest.raises(errors.X64RequiredError):
        s.run(body, args=(full,))
    assert run(s, body, partial) == rows[-1]  # The exact partial step: one row, no wrap.


@pytest.mark.parametrize("n", (2, 4))
def test_a_jdist_function_checks_its_runs_on_each_calls_numbers(n):
    # TF's idiom: @tf.function def train_step(batch): strategy.run(step, (batch,)).
    s, body = mirrored(n), SUMS["sum"][0]
    train_step = jdist.function(lambda batch: s.run(body, args=(batch,)))
    for value, raises in ((1000, False), (2**31 // n, True), (7, False)):
        values = per_replica(n, value)
        if raises:
            with pytest.raises(errors.X64RequiredError, match="jdist.function"):
                train_step(values)
        else:
            got = s.experimental_local_results(train_step(values))[0]
            assert got == sum(np.sum(v) for v in values.values)
    rows = np.full(8 * n, 2**31 // (4 * n), np.int64)
    batch, = s.experimental_distribute_dataset(s.experimental_make_numpy_dataset(rows).batch(8 * n))
    with pytest.raises(errors.X64RequiredError):  # A blocked dataset element.
        train_step(batch)


# Integer operations a step applies to int64 labels, in JAX and in NumPy's int64 (TF's numbers).
OPERATIONS = {
    "sum": (lambda y: jnp.sum(y, keepdims=True), lambda y: np.sum(y, keepdims=True)),
    "neg": (jnp.negative, np.negative), "abs": (jnp.abs, np.abs),
    "plus 5": (lambda y: y + 5, lambda y: y + 5), "times 3": (lambda y: y * 3, lambda y: y * 3),
    "reversed": (lambda y: y[::-1], lambda y: y[::-1]), "doubled": (lambda y: y + y,) * 2,
    "relu": (lambda y: jnp.maximum(y, 0), lambda y: np.maximum(y, 0)),
    "tiled": (lambda y: jnp.tile(y, 2), lambda y: np.tile(y, 2)),
    "cumsum": (jnp.cumsum, np.cumsum), "square": (lambda y: y * y,) * 2,
    "masked": (lambda y: jnp.where(y > 3, y, 0), lambda y: np.where(y > 3, y, 0)),
    "floor div 3": (lambda y: y // 3, lambda y: y // 3),
    "taken": (lambda y: y[jnp.array([0, 0, -1])], lambda y: y[np.array([0, 0, -1])]),
    "tripled in a loop": (lambda y: jax.lax.fori_loop(0, 2, lambda i, c: c + y, y),
                          lambda y: 3 * y),
    "minus constants": (lambda y: y - jnp.asarray(_constants(y.shape), jnp.int32),
                        lambda y: y - _constants(y.shape)),
}


def random_rows(n, scale, seed):
    """One row of 4 int64 numbers in (-scale, scale) per replica."""
    return [np.random.default_rng(seed + i).integers(-scale, scale, 4, dtype=np.int64)
            for i in range(n)]


def composed(ops):
    """``compute(y, which)``: the `OPERATIONS` ``ops`` in turn, JAX's (0) or NumPy's (1)."""
    def compute(y, which):
        for op in ops:
            y = OPERATIONS[op][which](y)
        return y
    return compute


def _constants(shape):  # A constant array the step closes over (not a literal).
    return (np.arange(int(np.prod(shape))) * 2**27 - 2**28).reshape(shape)


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(n=st.sampled_from([2, 3, 4]),
                  ops=st.lists(st.sampled_from(sorted(OPERATIONS)), min_size=1, max_size=4),
                  scale=st.sampled_from([1, 1000, 2**20, 2**28, 2**30]), seed=st.integers(0, 99),
                  across=st.booleans())
def test_property_an_in_step_sum_is_tfs_int64_number_or_raises(n, ops, scale, seed, across):
    # Soundness: whatever the operations, a number that does not raise is NumPy's int64 one,
    # all-reduced across replicas or returned by each.
    rows, compute, s = random_rows(n, scale, seed), composed(ops), mirrored(n)
    try:
        got = s.experimental_local_results(s.run(
            lambda y: all_reduce(compute(y, 0)) if across else compute(y, 0),
            args=(jdist.PerReplica(rows),)))
    except errors.X64RequiredError:
        return
    want = [sum(compute(r, 1) for r in rows)] * n if across else [compute(r, 1) for r in rows]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("dtype,ops,raises", [
    (np.int64, None, True), (np.int32, None, False),
    (np.int64, jdist.ReductionToOneDevice, False)])  # It concatenates, as TF's does.
@pytest.mark.parametrize("numbers", ["counts", "doubled", "zeros"])
@pytest.mark.parametrize("n", (2, 3))
def test_an_in_step_all_gather_along_a_negative_axis_raises_where_tf_gathers_int64(
        n, numbers, dtype, ops, raises):
    # TF gathers int64 with its collective ops, which raise on a negative axis ('Requires
    # start <= limit'); int32 and an explicit ReductionToOneDevice concatenate.
    s = jdist.MirroredStrategy(jax.local_devices()[:n], cross_device_ops=ops and ops())
    rows = [np.arange(6, dtype=dtype).reshape(2, 3) * (numbers != "zeros") + i for i in range(n)]
    factor = 2 if numbers == "doubled" else 1

    def step(x, axis):
        return jdist.get_replica_context().all_gather(x * factor, axis=axis)
    value = jdist.PerReplica(rows)
    want = np.concatenate([r * factor for r in rows], axis=1)
    np.testing.assert_array_equal(run(s, lambda x: step(x, 1), value), want)
    if raises:
        with pytest.raises(errors.InvalidArgumentError, match="negative axis"):
            s.run(lambda x: step(x, -1), args=(value,))
    else:
        np.testing.assert_array_equal(run(s, lambda x: step(x, -1), value), want)


@pytest.mark.parametrize("dtype", [np.int64, np.int32])
@pytest.mark.parametrize("n", REPLICAS)
def test_an_all_gather_of_rows_of_different_counts_is_tfs_and_raises_where_tf_does(n, dtype):
    # Values of different shapes make an exact uneven step, whose all_gather is a merge: it
    # gathers the numbers without adding any (ids near 2**30 are fine), and along a negative
    # axis int64 raises as TF's collective ops do, as the even step's gather does.
    rows = [(np.arange(2 * (i % 3 + 1)).reshape(-1, 2) + 2**30 - 10).astype(dtype)
            for i in range(n)]
    value, s = jdist.PerReplica(rows), mirrored(n)

    def step(x, axis):
        return jdist.get_replica_context().all_gather(x, axis=axis)
    np.testing.assert_array_equal(run(s, lambda x: step(x, 0), value), np.concatenate(rows))
    if dtype == np.int64:
        with pytest.raises(errors.InvalidArgumentError, match="negative axis"):
            s.run(lambda x: step(x, -2), args=(value,))
    else:
        np.testing.assert_array_equal(run(s, lambda x: step(x, -2), value), np.concatenate(rows))


MERGES = {  # merge_fn over the replicas' labels, with the NumPy (int64) number TF computes.
    "reduce SUM": (lambda st, y: st.reduce("sum", y, axis=0), lambda ys: np.sum(np.concatenate(ys))),
    "stacked": (lambda st, y: jnp.stack([jnp.sum(c) for c in y.values]),
                lambda ys: np.array([np.sum(y) for y in ys])),
    "largest": (lambda st, y: jnp.max(jnp.stack([jnp.max(c) for c in y.values])),
                lambda ys: max(np.max(y) for y in ys)),
}


@pytest.mark.parametrize("merge", sorted(MERGES))
@pytest.mark.parametrize("scale", (1, 2**29))
@pytest.mark.parametrize("n", REPLICAS)
def test_a_merge_in_an_uneven_step_is_tfs_number_or_raises(n, scale, merge):
    # An uneven step's merge_call runs merge_fn over every replica's values of their own
    # shapes; its integers are bounded through merge_fn's program (before: an unknown
    # operation, so labels of 0 and 1 raised X64RequiredError).
    rows = [np.arange(i % 3 + 1, dtype=np.int64) * scale for i in range(n)]
    merge_fn, want = MERGES[merge]
    s = mirrored(n)
    step = lambda y: jdist.get_replica_context().merge_call(merge_fn, args=(y,))  # noqa: E731
    try:
        got = run(s, step, jdist.PerReplica(rows))
    except errors.X64RequiredError:  # Loud where a bound may reach 2**31; never for small ones.
        assert scale > 1 and merge != "largest"
        return
    assert np.max(np.abs(want(rows))) < 2**31  # Where TF's int64 number leaves int32: raised.
    np.testing.assert_array_equal(got, want(rows))


# Integers a step computes from int64 labels and returns, without summing them across replicas.
def looped(y, times, dynamic=False):
    stop = jnp.asarray(times) if dynamic else times  # A traced bound makes a while loop.
    return jax.lax.fori_loop(0, stop, lambda i, c: c + jnp.sum(y), jnp.zeros((), y.dtype))


IN_STEP = {
    "sum": (jnp.sum, np.sum),
    "times 4": (lambda y: y * 4, lambda y: y * 4),
    "doubled": (lambda y: y + y,) * 2,
    "cumsum": (jnp.cumsum, np.cumsum),
    "summed in a 3-step loop": (lambda y: looped(y, 3), lambda y: 3 * np.sum(y)),
    "summed in a while loop": (lambda y: looped(y, 3, dynamic=True), lambda y: 3 * np.sum(y)),
    "summed in a branch": (lambda y: jax.lax.cond(y[0] > 0, jnp.sum, jnp.max, y),
                           lambda y: np.sum(y) if y[0] > 0 else np.max(y)),
}


@pytest.mark.parametrize("form", list(IN_STEP))
@pytest.mark.parametrize("n", (1, 2, 4))
def test_integers_a_step_returns_are_tfs_numbers_or_raise(n, form):
    # TF computes them in int64: jdist gives NumPy's int64 numbers, or raises at the call where
    # int32's could differ. A while loop's count is unknown: its growing sum always raises.
    step, want = IN_STEP[form]
    s = mirrored(n)
    small = per_replica(n, 1000)
    if "while" in form:
        with pytest.raises(errors.X64RequiredError, match="integers are computed"):
            s.run(step, args=(small,))
        return
    got = s.experimental_local_results(s.run(step, args=(small,)))
    for g, v in zip(got, small.values):
        np.testing.assert_array_equal(g, want(np.asarray(v)))
    with pytest.raises(errors.X64RequiredError, match="integers are computed"):
        s.run(step, args=(per_replica(n, 2**30),))


@pytest.mark.parametrize("step,want", [
    (lambda y: y, lambda y: y), (lambda y: y + 1, lambda y: y + 1),
    (lambda y: y % 7, lambda y: y % 7), (lambda y: y // 2, lambda y: y // 2),
    (lambda y: jnp.maximum(y, 0)[::-1], lambda y: np.maximum(y, 0)[::-1]),
    (lambda y: jnp.where(y > 2**29, y, -y), lambda y: np.where(y > 2**29, y, -y)),
    (lambda y: y - jnp.array([1, 2, 3, 4]), lambda y: y - np.array([1, 2, 3, 4])),
], ids=["as is", "plus 1", "mod 7", "halved", "relu reversed", "where", "minus a constant"])
@pytest.mark.parametrize("n", (2, 8))
def test_large_numbers_computed_one_by_one_need_no_x64(n, step, want):
    # Ids near 2**30 add up far beyond 2**31, but each number the step computes stays in int32.
    s, value = mirrored(n), per_replica(n, 2**30)
    got = s.experimental_local_results(s.run(step, args=(value,)))
    for g, v in zip(got, value.values):
        np.testing.assert_array_equal(g, want(np.asarray(v)))


@pytest.mark.parametrize("how", ["rows", "replicas", "copies"])
@pytest.mark.parametrize("n", (2, 3, 8))
def test_a_steps_int64_outputs_are_checked_where_strategy_reduce_sums_them(n, how):
    # `run` records what its outputs may add up to: reduce gives TF's int64 sum or raises.
    s = mirrored(n)

    def reduced(labels):
        if how == "copies":  # A Mirrored: reduce adds its n copies.
            total = s.run(lambda y: all_reduce(jnp.sum(y)), args=(labels,))
            return s.reduce("sum", total, axis=None)
        rows = s.run(lambda y: y, args=(labels,))  # A PerReplica.
        return s.reduce("sum", rows, axis=0 if how == "rows" else None)
    small = per_replica(n, 2**20)
    want = sum(np.sum(v) for v in small.values) * (n if how == "copies" else 1)
    assert int(np.sum(reduced(small))) == want
    copies = n if how == "copies" else 1  # What the step computes fits; the reduce's sum not.
    with pytest.raises(errors.X64RequiredError, match="int64"):
        reduced(per_replica(n, 2**31 // (4 * n * copies) + 1))


@pytest.mark.parametrize("n", (2, 4))
def test_a_mirrored_of_int64_host_numbers_is_tfs_int64(n):
    s, value = mirrored(n), jdist.Mirrored(np.full(3, 2**30, np.int64))
    for step in (jnp.sum, lambda y: all_reduce(y)):  # 3 * 2**30; n copies of 2**30.
        with pytest.raises(errors.X64RequiredError):
            s.run(step, args=(value,))
    small = jdist.Mirrored(np.arange(3, dtype=np.int64))
    assert run(s, lambda y: all_reduce(jnp.sum(y)), small) == n * 3


@pytest.mark.parametrize("times", (1, 3, 16, 17, 100))
@pytest.mark.parametrize("scale", (1, 2**20, 2**26))
def test_a_loops_integer_carry_is_tfs_number_or_raises(scale, times):
    # A carry is followed iteration by iteration (up to 16): a short loop's sum is bounded by
    # its count; a longer loop whose carry still grows is unbounded, so it raises: never wrong.
    s, value = mirrored(2), per_replica(2, scale)
    try:
        got = s.experimental_local_results(s.run(lambda y: looped(y, times), args=(value,)))
    except errors.X64RequiredError:
        assert times > 16 or times * np.sum(np.asarray(value.values[-1])) >= 2**31
        return
    assert [int(g) for g in got] == [times * int(np.sum(v)) for v in value.values]


@pytest.mark.parametrize("n", REPLICAS)
def test_a_constant_is_summed_once_per_replica(n):
    # Every replica's 2**28 stands in for a label: 8 replicas' sum is 2**31 (TF's int64).
    s, value = mirrored(n), per_replica(n, 7)
    step = lambda y: all_reduce(jnp.where(y > 100, y, 2**28))  # noqa: E731
    if n * 2**28 >= 2**31:
        with pytest.raises(errors.X64RequiredError):
            s.run(step, args=(value,))
    else:
        np.testing.assert_array_equal(run(s, step, value), np.full(4, n * 2**28))


@pytest.mark.parametrize("source", ["dataset", "values from a function", "numpy dataset"])
def test_one_replicas_plain_int64_values_are_checked_too(source):
    # One replica gets plain arrays from datasets, as in TF (values from a function: a
    # PerReplica of one, as TF's): they remember their int64 numbers all the same.
    s = mirrored(1)

    def made(rows):
        if source == "values from a function":
            return s.experimental_distribute_values_from_function(lambda ctx: rows)
        batches = (s.experimental_make_numpy_dataset(rows).batch(4) if source == "numpy dataset"
                   else [rows])  # An iterable of global batches.
        return next(iter(s.experimental_distribute_dataset(batches)))
    small, large = made(np.full(4, 1000, np.int64)), made(np.full(4, 2**29, np.int64))
    assert isinstance(large, jdist.PerReplica if source == "values from a function"
                      else jax.Array)
    assert int(s.run(jnp.sum, args=(small,))) == 4000
    with pytest.raises(errors.X64RequiredError):
        s.run(jnp.sum, args=(large,))
    doubled = s.run(lambda y: y * 2, args=(large,))  # 2**30: each fits.
    np.testing.assert_array_equal(doubled, np.full(4, 2**30))
    with pytest.raises(errors.X64RequiredError):
        s.reduce("sum", doubled, axis=0)


@pytest.mark.parametrize("n", (2, 4))
def test_ids_with_the_replica_id_or_split_need_no_x64(n):
    # Large ids offset by the replica id, or split in halves, are each in int32's range.
    s, value = mirrored(n), per_replica(n, 2**30)
    got = s.experimental_local_results(s.run(
        lambda y: (y + jdist.get_replica_context().replica_id_in_sync_group,
                   jnp.split(y, 2)[1]), args=(value,)))
    for r, ((plus, half), v) in enumerate(zip(got, value.values)):
        np.testing.assert_array_equal(plus, np.asarray(v) + r)
        np.testing.assert_array_equal(half, np.asarray(v)[2:])


def in_function(s, how):
    """TF's `@tf.function def step(batch)` idioms over int64 labels, as `jdist.function`s."""
    if how == "reduce inside":
        return jdist.function(lambda b: s.reduce("sum", s.run(jnp.sum, args=(b,)), axis=None))
    if how == "reduce of its output":
        rows = jdist.function(lambda b: s.run(lambda y: y, args=(b,)))
        return lambda b: s.reduce("sum", rows(b), axis=0)
    if how == "reduce its rows inside":
        return jdist.function(lambda b: s.reduce("sum", s.run(lambda y: y, args=(b,)), axis=0))
    return jdist.function(lambda b: s.run(  # Two steps: the second sums the first's numbers.
        lambda z: all_reduce(jnp.sum(z)), args=(s.run(lambda y: y * 2, args=(b,)),)))


@pytest.mark.parametrize("how", ["reduce inside", "reduce its rows inside",
                                 "reduce of its output", "two steps"])
@pytest.mark.parametrize("n", (2, 4))
def test_a_jdist_functions_reduces_outputs_and_later_steps_are_checked(n, how):
    s = mirrored(n)
    step = in_function(s, how)
    for value in (1000, 7, 2**31 // (8 * n) + 1):  # The last one's sum reaches 2**31.
        labels = per_replica(n, value)
        want = sum(np.sum(v) for v in labels.values) * (2 if how == "two steps" else 1)
        if want < 2**31:
            assert int(np.sum(s.experimental_local_results(step(labels))[0])) == want
        else:
            with pytest.raises(errors.X64RequiredError):
                step(labels)


@pytest.mark.parametrize("how", ["reduce inside", "reduce its rows inside", "reduce of its output",
                                 "two steps"])
def test_a_jdist_function_on_one_replica_is_checked_too(how):
    # One replica's step outputs are plain arrays, traced inside the function.
    s = mirrored(1)
    step = in_function(s, how)
    for value, fits in ((1000, True), (2**29, False)):  # 4 labels of 2**29 (twice: 2**31).
        batch = next(iter(s.experimental_distribute_dataset([np.full(4, value, np.int64)])))
        if fits:
            want = 4 * value * (2 if how == "two steps" else 1)
            assert int(np.sum(s.experimental_local_results(step(batch))[0])) == want
        else:
            with pytest.raises(errors.X64RequiredError):
                step(batch)


@pytest.mark.parametrize("n", (2, 4))
def test_an_exact_partial_steps_outputs_are_checked_where_reduce_sums_them(n):
    # The last batch's 3 rows: each fits int32, their sum (TF's int64) does not.
    s = mirrored(n)
    rows = np.concatenate([np.full(4 * n, 7, np.int64), np.full(3, 2**30, np.int64)])
    full, partial = s.experimental_distribute_dataset(
        s.experimental_make_numpy_dataset(rows).batch(4 * n))
    step = lambda y: y - jnp.array([1])  # noqa: E731  (a constant the step closes over)
    assert int(s.reduce("sum", s.run(step, args=(full,)), axis=0)) == 4 * n * 6
    out = s.run(step, args=(partial,))
    assert sorted(int(x) for v in s.experimental_local_results(out) for x in np.ravel(v)) == \
        [2**30 - 1] * 3
    with pytest.raises(errors.X64RequiredError):
        s.reduce("sum", out, axis=0)


REBUILT = {  # Pytree functions that hand a value's arrays back as they are.
    "tree_map identity": lambda v: jax.tree.map(lambda a: a, v),
    "jnp.asarray": lambda v: jax.tree.map(jnp.asarray, v),
    "inside a dict": lambda v: jax.tree.map(lambda a: a, {"y": v})["y"],
    "device_put": jax.device_put,
    "block_until_ready": jax.block_until_ready,
}
SOURCES = {  # A PerReplica on the devices, a dataset element (blocked), a Mirrored, one held
    # on the host, and a step's output: each made from (or computed from) int64 host numbers.
    "values from a function": lambda s, rows: s.experimental_distribute_values_from_function(
        lambda ctx: rows[ctx.replica_id_in_sync_group]),
    "numpy dataset": lambda s, rows: next(iter(s.experimental_distribute_dataset(
        s.experimental_make_numpy_dataset(np.concatenate(rows)).batch(4 * len(rows))))),
    "mirrored": lambda s, rows: jdist.Mirrored(rows[0]),
    "host PerReplica": lambda s, rows: jdist.PerReplica(rows),
    "step output": lambda s, rows: s.run(lambda y: y + 0, args=(jdist.PerReplica(rows),)),
}


@pytest.mark.parametrize("rebuild", list(REBUILT))
@pytest.mark.parametrize("source", list(SOURCES))
@pytest.mark.parametrize("n", (2, 8))
def test_a_value_rebuilt_from_its_own_arrays_keeps_its_int64_numbers(n, source, rebuild):
    # A step's all-reduce of the rebuilt value gives TF's int64 sum where it fits int32 and
    # raises where it would wrap, as it does for the value itself.
    s = mirrored(n)
    summed = lambda v: run(s, all_reduce, v)  # noqa: E731

    def reduced(scale):
        rows = [np.full(4, scale, np.int64) + i for i in range(n)]
        value = SOURCES[source](s, rows)
        copies = n if source == "mirrored" else 1
        want = np.sum(rows[:1] if copies > 1 else rows, axis=0) * copies
        return REBUILT[rebuild](value), want
    small, want = reduced(2**20)
    np.testing.assert_array_equal(summed(small), want)
    large, _ = reduced(2**31 // n)
    try:
        summed(large)
    except errors.X64RequiredError:
        return
    # Not followed: JAX made new arrays from host-held ones (see docs/design.md, section 9).
    assert source == "host PerReplica" and rebuild in ("jnp.asarray", "device_put")


OUTSIDE_RUN = {  # What a jdist.function computes itself from its int64 argument, and NumPy's.
    "sum": (jnp.sum, np.sum),
    "doubled": (lambda y: y * 2, lambda y: y * 2),
    "cumsum in a jitted helper": (jax.jit(jnp.cumsum), np.cumsum),
    "a PerReplica's numbers added": (lambda v: jnp.sum(v.stacked), np.sum),
}


@pytest.mark.parametrize("form", list(OUTSIDE_RUN))
@pytest.mark.parametrize("n", (1, 2, 4))
def test_integers_a_jdist_function_computes_itself_are_tfs_or_raise(n, form):
    # TF's tf.function computes them in int64; jdist's gives that number or raises.
    traces, (fn, reference) = [], OUTSIDE_RUN[form]
    f = jdist.function(lambda y: traces.append(1) or fn(y))
    made = ((lambda rows: jdist.PerReplica(list(rows))) if "PerReplica" in form
            else (lambda rows: np.concatenate(rows)))
    for scale in (2**20, 2**29):
        rows = [np.full(3, scale, np.int64) + i for i in range(n)]
        want = reference(np.stack(rows) if "PerReplica" in form else np.concatenate(rows))
        if np.max(np.abs(want)) >= 2**31:
            with pytest.raises(errors.X64RequiredError, match="jdist.function"):
                f(made(rows))
        else:
            np.testing.assert_array_equal(f(made(rows)), want)
    assert len(traces) == 1  # Read from the program JAX traced: not traced again.
    wrapped = f(made([np.full(3, 2**29, np.int32)] * n))  # int32: TF's int32 wraps too.
    np.testing.assert_array_equal(wrapped, reference(
        np.stack([np.full(3, 2**29, np.int32)] * n) if "PerReplica" in form
        else np.full(3 * n, 2**29, np.int32)).astype(np.int32))  # NumPy's sum is int64.


def test_a_jdist_functions_own_integer_outputs_are_checked_where_reduce_sums_them():
    s = mirrored(2)
    doubled = jdist.function(lambda y: y * 2)(np.full(4, 2**29, np.int64))  # 2**30 each: fits.
    np.testing.assert_array_equal(doubled, np.full(4, 2**30))
    with pytest.raises(errors.X64RequiredError):
        s.reduce("sum", doubled, axis=0)  # TF's int64 sum is 2**32.


@pytest.mark.parametrize("jit_kwargs, call", [
    ({"static_argnums": 0}, lambda f, y: f(3, y)),
    ({"static_argnums": -2}, lambda f, y: f(3, y)),
    ({"static_argnames": "k"}, lambda f, y: f(3, y)),  # A name given by position.
    ({"static_argnames": "k"}, lambda f, y: f(y=y, k=3)),
    ({"donate_argnums": 1, "static_argnums": 0}, lambda f, y: f(3, y)),
])
@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")  # A sum's output.
def test_a_jdist_functions_static_and_donated_arguments_keep_its_checks(jit_kwargs, call):
    f = jdist.function(lambda k, y: jnp.sum(y) * k, **jit_kwargs)
    assert int(call(f, np.arange(4, dtype=np.int64))) == 18
    with pytest.raises(errors.X64RequiredError, match="jdist.function"):
        call(f, np.full(4, 2**28, np.int64))  # 3 * 2**30 in TF.


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(n=st.sampled_from([1, 2, 3, 4]),
                  ops=st.lists(st.sampled_from(sorted(OPERATIONS)), min_size=1, max_size=4),
                  scale=st.sampled_from([1, 1000, 2**20, 2**28, 2**30]), seed=st.integers(0, 99))
def test_property_what_a_jdist_function_computes_itself_is_tfs_int64_number_or_raises(
        n, ops, scale, seed):
    # Soundness outside run: a number that does not raise is NumPy's int64 one, and so is
    # strategy.reduce's sum of it (a plain value: once per replica).
    y, compute, s = np.concatenate(random_rows(n, scale, seed)), composed(ops), mirrored(n)
    try:
        got = jdist.function(lambda v: compute(v, 0))(y)
        np.testing.assert_array_equal(got, compute(y, 1))
        assert int(s.reduce("sum", got, axis=0)) == n * np.sum(compute(y, 1))
    except errors.X64RequiredError:
        pass


@pytest.mark.parametrize("where", ["step", "function"])
def test_a_python_number_argument_counts_by_its_own_magnitude(where):
    # TF takes a Python number as a constant of the trace; jdist bounds it by its value on
    # each call, so ids plus an offset compute, and a sum that may wrap still raises.
    s = mirrored(2)
    if where == "step":
        compute = lambda y, k: s.experimental_local_results(  # noqa: E731
            s.run(lambda v, k: all_reduce(v + k), args=(jdist.PerReplica([y, y]), k)))[0]
    else:
        compute = jdist.function(lambda y, k: y + k)
    y = np.full(4, 2**29, np.int64)
    factor = 2 if where == "step" else 1
    np.testing.assert_array_equal(compute(y, 3), np.full(4, factor * (2**29 + 3)))
    with pytest.raises(errors.X64RequiredError):
        compute(y, 2**31 - 1)


def test_a_jdist_function_on_a_partial_batch_keeps_the_checks_its_full_batches_found():
    # A partial batch's call runs as Python (eager): what the function computes itself there
    # is checked as its full batches' programs found it, on this call's numbers.
    s = mirrored(2)
    f = jdist.function(lambda b, y: (s.run(lambda v: v * 2, args=(b,)), jnp.sum(y)))
    ones = lambda *rows: jdist.PerReplica([np.ones(r, np.float32) for r in rows])  # noqa: E731
    full, partial = ones(2, 2), ones(2, 1)
    assert int(f(full, np.full(4, 2**20, np.int64))[1]) == 2**22
    assert int(f(partial, np.full(4, 2**20, np.int64))[1]) == 2**22
    with pytest.raises(errors.X64RequiredError, match="jdist.function"):
        f(partial, np.full(4, 2**30, np.int64))  # TF's 2**32.
