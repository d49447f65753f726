"""Differential tests: jdist computes the numbers that TF's own ``tf.distribute.MirroredStrategy``
computes.

For 1, 2, 3, 4 and 8 replicas, every test runs the same computation in TensorFlow's own
MirroredStrategy over logical CPU devices (`_tf_reference`) and in ``jdist.testing.mirrored(n)``,
both fed from the same tf.data dataset through their ``experimental_distribute_dataset`` (or from
the same value function), and asserts that jdist's results equal TF's bit for bit, floats included
(the training loop, whose arithmetic is the user's ``jnp`` code, to rtol 1e-5), shapes and dtypes
too. TF runs eagerly, except the training step and ``gather``, which run in a tf.function as TF
users write them. Every expected value is TF's; nothing is hard-coded. Where TF raises, jdist must
raise too. Dtypes are JAX's (docs/migration.md): with ``jax_enable_x64`` jdist gives TF's 64-bit
numbers bit for bit (int64 batches, the float64 MEAN of int32 values); without it, TF's numbers
held in JAX's 32-bit dtypes (`_tf_reference.held_as_jax`: a MEAN of int32 values is float32, int64
batches int32). Cases whose int64 numbers leave int32's range run under x64 only.

  a. ``strategy.reduce`` SUM / MEAN with ``axis=None`` and ``axis=0`` of per-replica batches,
     partial last batches included (trailing replicas get fewer rows or none);
  b. ``strategy.gather(axis=0)`` of the same batches;
  c. inside ``strategy.run``: ``all_reduce``, ``all_gather`` of uneven sizes, ``merge_call``,
     values built from ``replica_id_in_sync_group``;
  d. a custom training loop: linear regression, SGD, ``tf.nn.compute_average_loss``, 2 epochs;
  e. ``experimental_distribute_values_from_function`` with a different shape per replica;
  f. ``ReductionToOneDevice``, ``NcclAllReduce`` and ``HierarchicalCopyAllReduce`` called
     directly: ``reduce`` / ``batch_reduce`` to a value's devices and to one device, a plain
     tensor (TF's one-value shortcut), ``broadcast``.

Skipped when TensorFlow is not importable; ``.venv-tf`` has it (``pip install -e ".[test,tf]"``).
"""

import functools
import os
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdist
from jdist import errors
from jdist.testing import REPLICA_COUNTS

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from _tf_skip import tf_or_skip  # noqa: E402

tf = tf_or_skip()

from _tf_reference import assert_matches  # noqa: E402
from _tf_reference import both_reducing_to_one_device  # noqa: E402
from _tf_reference import local_results  # noqa: E402
from _tf_reference import outcome  # noqa: E402
from _tf_reference import reduction_to_one_device  # noqa: E402
from _tf_reference import strategies  # noqa: E402

COUNTS = REPLICA_COUNTS  # 1, 2, 3, 4, 8

# ---------------------------------------------------------------------------------------------
# Comparing the two libraries' results.

def both(n):
    """jdist's and TF's MirroredStrategy over ``n`` devices."""
    strategy, tf_strategy = strategies(n)
    if tf_strategy is None:
        pytest.skip("TensorFlow was initialised before its logical CPU devices were configured.")
    return strategy, tf_strategy


def steady(dataset):
    """``dataset`` without tf.data's autotuning (the same elements): with it, the first element of
    a TF distributed iterator over 8 logical CPU devices on a 2-core machine takes 0.6 s, 1.2, 2.5,
    5 or 10 s (a backoff); without it, 0.6 s mostly. jdist ignores the option."""
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


# ---------------------------------------------------------------------------------------------
# a, b. reduce and gather of distributed tf.data batches.

# (dataset size, global batch), concatenated: global batches of 4, 2, 3 and 1 rows. On 2, 3, 4
# and 8 replicas, one is even at most: trailing replicas get fewer rows or none.
SIZES = [(6, 4), (3, 8), (1, 1)]
# TF reduces int32 through ReductionToOneDevice, float32 and int64 with collective ops.
DTYPES = ["float32", "int32", "int64"]


def rows():
    """Each ``range(size).batch(batch)`` of `SIZES`, one after another, as rows (i, 2i + 1, 3i + 2)
    in each of `DTYPES` (a dict by dtype); the floats are divided by 7, plus 0.1 (`steady`)."""
    def as_dtypes(i):
        r = tf.stack([i, 2 * i + 1, 3 * i + 2])
        return {"float32": tf.cast(r, tf.float32) / 7 + 0.1, "int32": tf.cast(r, tf.int32),
                "int64": r}
    parts = [tf.data.Dataset.range(size).map(as_dtypes).batch(batch) for size, batch in SIZES]
    return steady(functools.reduce(tf.data.Dataset.concatenate, parts))


@functools.lru_cache(maxsize=None)
def distributed_rows(n):
    """The distributed batches of `rows`, as pairs (jdist's, TF's), and TF's element spec."""
    strategy, tf_strategy = both(n)
    tf_dataset = tf_strategy.experimental_distribute_dataset(rows())
    return list(zip(strategy.experimental_distribute_dataset(rows()), tf_dataset,
                    strict=True)), tf_dataset.element_spec


def batches(n, dtype):
    """The distributed batches of `rows` of ``dtype``, as pairs (jdist's, TF's)."""
    return [(element[dtype], tf_element[dtype]) for element, tf_element in distributed_rows(n)[0]]


@functools.lru_cache(maxsize=None)
def tf_gather(n, dtype):
    """TF's ``gather(axis=0)`` of `rows` of ``dtype``, in a tf.function traced once (eagerly,
    TF traces one for every call)."""
    _, tf_strategy = both(n)
    return tf.function(lambda value: tf_strategy.gather(value, axis=0),
                       input_signature=[distributed_rows(n)[1][dtype]])


@pytest.mark.parametrize("axis", [None, 0])
@pytest.mark.parametrize("op", ["SUM", "MEAN"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", COUNTS)
def test_reduce(n, dtype, op, axis):
    strategy, tf_strategy = both(n)
    for element, tf_element in batches(n, dtype):
        assert_matches(outcome(strategy, lambda: strategy.reduce(op, element, axis=axis)),
                       outcome(tf_strategy, lambda: tf_strategy.reduce(op, tf_element, axis=axis)))


@pytest.mark.parametrize("dtype", ["float32", "int32"])  # int64: TF's float32 path (and slow).
@pytest.mark.parametrize("n", COUNTS)
def test_gather(n, dtype):
    strategy, tf_strategy = both(n)
    for element, tf_element in batches(n, dtype):
        assert_matches(outcome(strategy, lambda: strategy.gather(element, axis=0)),
                       outcome(tf_strategy, lambda: tf_gather(n, dtype)(tf_element)))


def gather_along(how, strategy, value, axis, get_replica_context):
    """``strategy.gather`` (``how`` "gather") or the replica context's ``all_gather`` of ``value``
    along ``axis``."""
    if how == "gather":
        return strategy.gather(value, axis=axis)
    return strategy.run(lambda x: get_replica_context().all_gather(x, axis), args=(value,))


@pytest.mark.parametrize("ops", [None, "ReductionToOneDevice"])
@pytest.mark.parametrize("axis", [-1, -2, 1])
@pytest.mark.parametrize("dtype", ["float32", "int32", "float16", "int64", "int64 x64"])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_gather_along_a_negative_axis(n, dtype, axis, ops):
    # TF's default ops on several devices gather all but int32 values with CollectiveAllReduce,
    # which raises on a negative axis; ReductionToOneDevice concatenates along it. int64 host
    # numbers take the path of the dtype JAX holds them in: without x64 int32's (TF's path for
    # those numbers as int32), with x64 int64's.
    dtype, x64 = dtype.split()[0], dtype.endswith("x64")
    strategy, tf_strategy = both(n) if ops is None else both_reducing_to_one_device(n)
    rows = [np.arange(6, dtype=dtype).reshape(2, 3) + 10 * i for i in range(n)]
    with jax.enable_x64(x64):
        held = [r.astype(jax.dtypes.canonicalize_dtype(r.dtype)) for r in rows]
        value = strategy.experimental_distribute_values_from_function(
            lambda ctx: rows[ctx.replica_id_in_sync_group])
        tf_value = tf_strategy.experimental_distribute_values_from_function(
            lambda ctx: tf.constant(held[ctx.replica_id_in_sync_group]))
        for how in ["gather", "all_gather"]:
            assert_matches(
                outcome(strategy, lambda: gather_along(how, strategy, value, axis,
                                                       jdist.get_replica_context)),
                outcome(tf_strategy, lambda: gather_along(how, tf_strategy, tf_value, axis,
                                                          tf.distribute.get_replica_context)))


@pytest.mark.parametrize("x64", [False, True])
def test_int64_batches_are_held_in_jaxs_dtype(x64):
    """tf.data's int64 batches, reduced and gathered: TF's int64 numbers with x64, int32 (the
    same numbers) without."""
    strategy, tf_strategy = both(2)
    with jax.enable_x64(x64):
        for compute in (lambda s, x: x, lambda s, x: s.reduce("SUM", x, axis=0),
                        lambda s, x: s.gather(x, axis=0)):
            element, tf_element = (next(iter(s.experimental_distribute_dataset(rows())))["int64"]
                                   for s in (strategy, tf_strategy))
            assert_matches(outcome(strategy, lambda: compute(strategy, element)),
                           outcome(tf_strategy, lambda: compute(tf_strategy, tf_element)))


@pytest.mark.parametrize("x64", [False, True])
def test_int64_beyond_int32_is_tfs_with_x64_and_an_error_without(x64):
    """Hashed ids above 2**31: with x64 TF's numbers; JAX without it would wrap them, so jdist
    raises X64RequiredError instead of giving other numbers."""
    strategy, tf_strategy = both(2)
    ids = steady(tf.data.Dataset.from_tensor_slices(
        np.array([2**40 + 5, 3, 2**33, 7], np.int64)).batch(4))

    def results(s):
        batch = next(iter(s.experimental_distribute_dataset(ids)))
        return [*local_results(s, batch), *local_results(s, s.reduce("SUM", batch, axis=0)),
                *local_results(s, s.gather(batch, axis=0))]
    with jax.enable_x64(x64):
        if not x64:
            with pytest.raises(errors.X64RequiredError, match="x64"):
                results(strategy)
            return
        assert_matches(results(strategy), results(tf_strategy))


# int64 numbers whose sums leave int32's range (the larger scale) are TF's with x64 only: JAX's
# int32 sums wrap without it.
INT64_SCALES = [(1000, False), (1000, True), ("large", True)]


@pytest.mark.parametrize("form", ["sum", "as is", "count"])
@pytest.mark.parametrize("scale, x64", INT64_SCALES)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_in_step_sums_of_int64_numbers_are_tfs(n, scale, x64, form):
    # TF sums int64 in int64; jdist sums them in the dtype JAX holds them in.
    strategy, tf_strategy = both(n)
    scale = 2**30 if scale == "large" else scale
    rows = [np.array([scale, 3, scale - i, 7], np.int64) for i in range(n)]
    jax_form = {"sum": jnp.sum, "as is": lambda y: y,
                "count": lambda y: jnp.sum(y == 3, dtype=jnp.int32)}[form]  # TF's int32.
    tf_form = {"sum": tf.reduce_sum, "as is": lambda y: y,
               "count": lambda y: tf.reduce_sum(tf.cast(tf.equal(y, 3), tf.int32))}[form]

    def summed(s, context, compute):
        value = s.experimental_distribute_values_from_function(
            lambda ctx: rows[ctx.replica_id_in_sync_group])
        return s.run(lambda y: context().all_reduce("sum", compute(y)), args=(value,))
    want = outcome(tf_strategy, lambda: summed(tf_strategy, tf.distribute.get_replica_context,
                                               tf_form))
    with jax.enable_x64(x64):
        got = outcome(strategy, lambda: summed(strategy, jdist.get_replica_context, jax_form))
        assert_matches(got, want)


def tf_loop_sum(y):  # The Python loop TF runs eagerly; jdist's step loops in the program.
    total = tf.zeros([], y.dtype)
    for _ in range(3):
        total += tf.reduce_sum(y)
    return total


# Integers a step computes from int64 labels, and how each library reduces the step's outputs.
COMPUTED = {
    "sum": (jnp.sum, tf.reduce_sum, None),
    "times 4": (lambda y: y * 4, lambda y: y * 4, None),
    "summed 3 times in a loop": (
        lambda y: jax.lax.fori_loop(0, 3, lambda i, c: c + jnp.sum(y), jnp.zeros((), y.dtype)),
        tf_loop_sum, None),
    "as is, then reduced": (lambda y: y, lambda y: y, 0),
    "all-reduced, then reduced": ("all_reduce", "all_reduce", "copies"),
}


@pytest.mark.parametrize("form", list(COMPUTED))
@pytest.mark.parametrize("scale, x64", INT64_SCALES)
@pytest.mark.parametrize("n", [1, 2, 4])  # One replica: plain tensors in TF, plain arrays here.
def test_int64_numbers_a_step_computes_are_tfs(n, scale, x64, form):
    # TF computes with int64 labels in int64 in the step and in `reduce`; jdist in the dtype
    # JAX holds them in.
    if n == 1 and form.startswith("all-reduced"):
        pytest.skip("TF's one-device MirroredStrategy raises on an eager in-step all_reduce of "
                    "a plain tensor ('destinations must be one of a DistributedValues object').")
    strategy, tf_strategy = both(n)
    scale = 2**29 if scale == "large" else scale
    rows = [np.array([scale, 3, scale - i, 7], np.int64) for i in range(n)]
    jax_step, tf_step, reduced = COMPUTED[form]

    def computed(s, step, context):
        value = s.experimental_distribute_values_from_function(
            lambda ctx: rows[ctx.replica_id_in_sync_group])
        if step == "all_reduce":
            step = lambda y: context().all_reduce("sum", y[:1])  # noqa: E731
        out = s.run(step, args=(value,))
        return out if reduced is None else s.reduce(
            "sum", out, axis=None if reduced == "copies" else reduced)
    want = outcome(tf_strategy, lambda: computed(tf_strategy, tf_step,
                                                 tf.distribute.get_replica_context))
    with jax.enable_x64(x64):
        got = outcome(strategy, lambda: computed(strategy, jax_step, jdist.get_replica_context))
        assert_matches(got, want)


# Integers a function computes itself (outside run) from int64 host numbers, in each library.
OWN = {"sum": (jnp.sum, tf.reduce_sum), "times 4": (lambda y: y * 4, lambda y: y * 4),
       "cumsum": (jnp.cumsum, tf.cumsum)}


@pytest.mark.parametrize("form", list(OWN))
@pytest.mark.parametrize("scale, x64", INT64_SCALES)
def test_int64_numbers_a_function_computes_itself_are_tfs(scale, x64, form):
    # tf.function computes them in int64; jdist.function in the dtype JAX holds them in.
    scale = 2**29 if scale == "large" else scale
    rows, (jax_fn, tf_fn) = np.array([scale, 3, scale - 1, 7, scale], np.int64), OWN[form]
    want = tf.function(tf_fn)(tf.constant(rows)).numpy()
    with jax.enable_x64(x64):
        assert_matches([np.asarray(jdist.function(jax_fn)(rows))], [want])


# ---------------------------------------------------------------------------------------------
# c. Inside strategy.run: the replica context's collectives.

# The few array ops the replica function uses, in each library.
TF_OPS = SimpleNamespace(
    get_replica_context=tf.distribute.get_replica_context,
    sum_rows=lambda x: tf.reduce_sum(x, axis=0),
    float32=lambda x: tf.cast(x, tf.float32), vector=lambda x: tf.reshape(x, [1]))
JAX_OPS = SimpleNamespace(
    get_replica_context=jdist.get_replica_context,
    sum_rows=lambda x: jnp.sum(x, axis=0),
    float32=lambda x: jnp.asarray(x, jnp.float32), vector=lambda x: jnp.reshape(x, [1]))


def weighted(ops, ctx, x):
    """The column sums of this replica's rows (zeros without rows) times (replica id + 1)."""
    return ops.sum_rows(x) * ops.float32(ctx.replica_id_in_sync_group + 1)


# Each output of the replica function: f(ops, replica context, this replica's batch (rows, 3)).
REPLICA_OUTPUTS = {
    "all_reduce_sum": lambda ops, ctx, x: ctx.all_reduce(
        "sum", {"col_sums": ops.sum_rows(x), "squares": ops.sum_rows(x) ** 2}),
    "all_reduce_mean": lambda ops, ctx, x: ctx.all_reduce("mean", weighted(ops, ctx, x)),
    "all_gather_rows": lambda ops, ctx, x: ctx.all_gather(x, axis=0),
    "all_gather_ids": lambda ops, ctx, x: ctx.all_gather(
        ops.vector(ctx.replica_id_in_sync_group), axis=0),
    "replica_id": lambda ops, ctx, x: ctx.replica_id_in_sync_group,
    "replica_id_sum": lambda ops, ctx, x: ctx.all_reduce("sum", ctx.replica_id_in_sync_group),
    "merge_reduce_rows": lambda ops, ctx, x: ctx.merge_call(
        lambda s, v: s.reduce("MEAN", v, axis=0), args=(x,)),
    "merge_reduce_sums": lambda ops, ctx, x: ctx.merge_call(
        lambda s, v: s.reduce("SUM", v, axis=None), args=(weighted(ops, ctx, x),)),
    "merge_reduce_to": lambda ops, ctx, x: ctx.merge_call(  # On one replica: a plain tensor.
        lambda s, v: s.extended.reduce_to("SUM", v, destinations=v),
        args=(weighted(ops, ctx, x),)),
    "merge_batch_reduce_to": lambda ops, ctx, x: ctx.merge_call(
        lambda s, v: s.extended.batch_reduce_to("MEAN", [(v, v), (v, v)]),
        args=(weighted(ops, ctx, x),)),
    "merge_returns_per_replica": lambda ops, ctx, x: ctx.merge_call(
        lambda s, v: v, args=(weighted(ops, ctx, x),)),
}


def replica_fn(ops):
    """The replica function: every output of `REPLICA_OUTPUTS`, with ``ops`` (a closure: jdist
    takes a partial's arguments as run's arguments, which must be arrays or hashable)."""
    captured = ops.vector(7)  # Made outside: every replica returns this one tensor object.

    @tf.autograph.experimental.do_not_convert  # Autograph cannot parse the lambdas.
    def fn(x):
        ctx = ops.get_replica_context()
        outputs = {name: output(ops, ctx, x) for name, output in REPLICA_OUTPUTS.items()}
        return {**outputs, "captured": captured}
    return fn


JAX_REPLICA_FN, TF_REPLICA_FN = replica_fn(JAX_OPS), replica_fn(TF_OPS)


@functools.lru_cache(maxsize=None)
def replica_context_results(n):
    """On global batches of 4 and 3 rows (even on 2 and 4 replicas, then on 3; uneven on the
    others), each output's local results, as pairs (jdist's, TF's)."""
    strategy, tf_strategy = both(n)
    results = {name: [] for name in REPLICA_OUTPUTS}
    for x, tf_x in [batches(n, "float32")[i] for i in (0, 2)]:
        out = strategy.run(JAX_REPLICA_FN, args=(x,))
        tf_out = tf_strategy.run(TF_REPLICA_FN, args=(tf_x,))
        for name in REPLICA_OUTPUTS:
            got = jax.tree.leaves(out[name],
                                  is_leaf=lambda v: isinstance(v, jdist.DistributedValues))
            want = tf.nest.flatten(tf_out[name])
            assert len(got) == len(want)
            results[name] += [(local_results(strategy, g), local_results(tf_strategy, w))
                              for g, w in zip(got, want)]
    return results


@pytest.mark.parametrize("name", list(REPLICA_OUTPUTS))
@pytest.mark.parametrize("n", COUNTS)
def test_replica_context(n, name):
    for got, want in replica_context_results(n)[name]:
        assert_matches(got, want)


@pytest.mark.parametrize("op", ["SUM", "MEAN"])
@pytest.mark.parametrize("n", COUNTS)
def test_reduce_of_what_the_replica_function_returned(n, op):
    # Per-replica and all-reduced results reduce as PerReplica values. (A merge_fn's plain
    # result or a captured tensor, one object in TF, is Mirrored in jdist: deviations.)
    strategy, tf_strategy = both(n)
    for x, tf_x in [batches(n, "float32")[i] for i in (0, 2)]:  # Even, then uneven.
        out = strategy.run(JAX_REPLICA_FN, args=(x,))
        tf_out = tf_strategy.run(TF_REPLICA_FN, args=(tf_x,))
        for name in ("merge_returns_per_replica", "all_reduce_mean", "replica_id_sum"):
            assert_matches(outcome(strategy, lambda: strategy.reduce(op, out[name], axis=None)),
                           outcome(tf_strategy,
                                   lambda: tf_strategy.reduce(op, tf_out[name], axis=None)))


@pytest.mark.parametrize("op", ["SUM", "MEAN"])
@pytest.mark.parametrize("n", [1, 3])
def test_reduce_of_none(n, op):
    strategy, tf_strategy = both(n)
    for value in (None, (None, 1.0), {"a": None}):
        if n == 1 and op == "SUM":  # jdist gives one replica's plain value back (deviations).
            assert strategy.reduce(op, value, axis=None) == value
            continue
        try:
            want = tf_strategy.reduce(op, value, axis=None)
        except ValueError:
            with pytest.raises(ValueError, match="None"):
                strategy.reduce(op, value, axis=None)
        else:
            assert strategy.reduce(op, value, axis=None) == want == value  # MEAN: as it is.


@pytest.mark.parametrize("x64", [False, True])
@pytest.mark.parametrize("n", COUNTS)
def test_all_reduce_mean_of_the_replica_ids(n, x64):
    """The int32 ids' MEAN: TF's float64 with x64 (int32 on one replica); float32 without."""
    strategy, tf_strategy = both(n)

    def mean_of_ids(ops):
        @tf.autograph.experimental.do_not_convert
        def fn():
            ctx = ops.get_replica_context()
            return ctx.all_reduce("mean", ctx.replica_id_in_sync_group)
        return fn
    want = outcome(tf_strategy, lambda: tf_strategy.run(mean_of_ids(TF_OPS)))
    with jax.enable_x64(x64):
        assert_matches(outcome(strategy, lambda: strategy.run(mean_of_ids(JAX_OPS))), want)


@pytest.mark.parametrize("axis", [None, 0])
@pytest.mark.parametrize("n", COUNTS)
def test_integer_mean_with_x64_is_tfs_float64(n, axis):
    """With x64 on, a MEAN of int32 batches is TF's float64, bit for bit."""
    strategy, tf_strategy = both(n)
    with jax.enable_x64(True):
        for element, tf_element in batches(n, "int32"):
            assert_matches(
                outcome(strategy, lambda: strategy.reduce("MEAN", element, axis=axis)),
                outcome(tf_strategy, lambda: tf_strategy.reduce("MEAN", tf_element, axis=axis)))


def int_batch(how, strategy, value, get_replica_context, destination):
    """A nest of two integer values all-reduced (``how`` "all_reduce"), or a batch_reduce_to of
    two pairs; the second result."""
    if how == "all_reduce":
        return strategy.run(lambda x: get_replica_context().all_reduce("SUM", (x, x * 2)),
                            args=(value,))[1]
    return strategy.extended.batch_reduce_to("SUM", [(value, value), (value, destination)])[1]


@pytest.mark.parametrize("how", ["all_reduce", "batch_reduce_to"])
@pytest.mark.parametrize("x64", [False, True])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_a_batch_with_an_int32_value(n, x64, how):
    """TF reduces an int32 value with a ReductionToOneDevice of its own and refuses a batch of
    values whose ops differ, and batches int64 ones. NumPy's int64 rows are JAX's int32 without
    x64 (TF's refusal of those numbers as int32) and int64 with it (TF's batch)."""
    strategy, tf_strategy = both(n)
    rows = [np.array([r, 2 * r + 1]) for r in range(n)]
    with jax.enable_x64(x64):
        tf_dtype = jax.dtypes.canonicalize_dtype(np.int64)
        tf_value = tf_strategy.experimental_distribute_values_from_function(
            lambda ctx: tf.constant(rows[ctx.replica_id_in_sync_group], tf_dtype))
        value = strategy.experimental_distribute_values_from_function(
            lambda ctx: rows[ctx.replica_id_in_sync_group])
        got = outcome(strategy, lambda: int_batch(how, strategy, value,
                                                  jdist.get_replica_context, "CPU:0"))
        want = outcome(tf_strategy, lambda: int_batch(how, tf_strategy, tf_value,
                                                      tf.distribute.get_replica_context,
                                                      "/device:CPU:0"))
        assert_matches(got, want)


@pytest.mark.parametrize("as_float", [False, True])
@pytest.mark.parametrize("n", COUNTS)
def test_all_reduce_of_the_row_count(n, as_float):
    """A global example count, as TF users compute it: each replica's rows, all-summed. The
    operand depends on shapes only (a Python int in jdist, folded into the trace); 3 rows are
    uneven on 2, 4 and 8 replicas."""
    strategy, tf_strategy = both(n)
    x, tf_x = batches(n, "float32")[2]  # 3 rows.
    out = strategy.run(lambda x: jdist.get_replica_context().all_reduce(
        "sum", jnp.float32(x.shape[0]) if as_float else x.shape[0]), args=(x,))
    tf_out = tf_strategy.run(lambda x: tf.distribute.get_replica_context().all_reduce(
        "sum", tf.cast(tf.shape(x)[0], tf.float32) if as_float else tf.shape(x)[0]),
        args=(tf_x,))
    assert_matches(local_results(strategy, out), local_results(tf_strategy, tf_out))


# ---------------------------------------------------------------------------------------------
# d. A custom training loop, as the tf.distribute tutorial writes it.

GLOBAL_BATCH, LEARNING_RATE, EPOCHS = 8, 0.1, 2


@functools.lru_cache(maxsize=None)
def regression_data():
    """37 noisy rows of a linear teacher (the last global batch has 5) as a tf.data dataset and
    as arrays, and initial weights."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(37, 3)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5]]) + 0.3 + 0.1 * rng.normal(size=(37, 1)))
    w0, b0 = rng.normal(size=(3, 1)).astype(np.float32), np.float32([0.5])
    rows = (x, y.astype(np.float32))
    dataset = tf.data.Dataset.from_tensor_slices(rows).batch(GLOBAL_BATCH)
    return steady(dataset), rows, w0, b0


def train_tf(tf_strategy):
    dataset, _, w0, b0 = regression_data()
    with tf_strategy.scope():
        w, b = tf.Variable(w0), tf.Variable(b0)
        optimizer = tf.keras.optimizers.SGD(LEARNING_RATE)

    dist = tf_strategy.experimental_distribute_dataset(dataset)

    @tf.function(input_signature=dist.element_spec)  # One trace for full and partial batches.
    def train_step(x, y):
        def step_fn(x, y):
            with tf.GradientTape() as tape:
                per_example_loss = tf.reduce_sum(tf.square(x @ w + b - y), axis=1)
                loss = tf.nn.compute_average_loss(per_example_loss,
                                                  global_batch_size=GLOBAL_BATCH)
            grads = tape.gradient(loss, [w, b])
            optimizer.apply_gradients(zip(grads, [w, b]))  # All-reduces (sums) the gradients.
            return loss
        return tf_strategy.reduce("SUM", tf_strategy.run(step_fn, args=(x, y)), axis=None)

    losses = [float(train_step(x, y)) for _ in range(EPOCHS) for x, y in dist]
    return losses, {"w": w.numpy(), "b": b.numpy()}


def train_jdist(strategy, source, compiled):
    dataset, rows, w0, b0 = regression_data()
    if source == "numpy":  # Full batches placed in blocks (where they split evenly).
        dataset = strategy.experimental_make_numpy_dataset(rows).batch(GLOBAL_BATCH)

    def step_fn(params, x, y):
        def loss_fn(p):
            per_example_loss = jnp.sum(jnp.square(x @ p["w"] + p["b"] - y), axis=1)
            return jdist.nn.compute_average_loss(per_example_loss,
                                                 global_batch_size=GLOBAL_BATCH)
        loss, grads = jax.value_and_grad(loss_fn)(params)
        grads = jdist.get_replica_context().all_reduce("sum", grads)
        return jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads), loss

    def train_step(params, x, y):
        params, loss = strategy.run(step_fn, args=(params, x, y))
        return params, strategy.reduce("SUM", loss, axis=None)
    if compiled:  # As TF's tf.function: jdist.function runs the partial batch as Python.
        train_step = jdist.function(train_step)

    params = {"w": jnp.asarray(w0), "b": jnp.asarray(b0)}
    dist = strategy.experimental_distribute_dataset(dataset)
    losses = []
    for _ in range(EPOCHS):
        for x, y in dist:
            params, loss = train_step(params, x, y)
            losses.append(float(loss))
    return losses, jdist.to_host(params)


@pytest.mark.parametrize("compiled", [False, True], ids=["run", "jdist.function"])
@pytest.mark.parametrize("source", ["tf.data", "numpy"])
@pytest.mark.parametrize("n", COUNTS)
def test_training_loop(n, source, compiled):
    strategy, tf_strategy = both(n)
    losses, params = train_jdist(strategy, source, compiled)
    tf_losses, tf_params = train_tf(tf_strategy)
    assert len(tf_losses) == EPOCHS * 5
    np.testing.assert_allclose(losses, tf_losses, rtol=1e-5)
    for name in tf_params:
        assert params[name].shape == tf_params[name].shape
        np.testing.assert_allclose(params[name], tf_params[name], rtol=1e-5, err_msg=name)


# ---------------------------------------------------------------------------------------------
# e. experimental_distribute_values_from_function, a different shape per replica.

def replica_value(dtype):
    def value_fn(ctx):
        """Replica r gets (r + 2) % 3 rows of 2 columns (replica 1 none), its values from r."""
        rid = ctx.replica_id_in_sync_group
        value = np.arange((rid + 2) % 3 * 2).reshape(-1, 2) + 10 * rid
        return (value / 7 + 0.1).astype(dtype) if dtype == "float32" else value.astype(dtype)
    return value_fn


@pytest.mark.parametrize("dtype", ["float32", "int32"])
@pytest.mark.parametrize("n", COUNTS)
def test_values_from_function(n, dtype):
    strategy, tf_strategy = both(n)
    value = strategy.experimental_distribute_values_from_function(replica_value(dtype))
    tf_value = tf_strategy.experimental_distribute_values_from_function(replica_value(dtype))
    assert_matches(local_results(strategy, value), local_results(tf_strategy, tf_value))
    for op in ("SUM", "MEAN"):
        assert_matches(outcome(strategy, lambda: strategy.reduce(op, value, axis=0)),
                       outcome(tf_strategy, lambda: tf_strategy.reduce(op, tf_value, axis=0)))
    assert_matches(outcome(strategy, lambda: strategy.gather(value, axis=0)),
                   outcome(tf_strategy, lambda: tf_strategy.gather(tf_value, axis=0)))


@pytest.mark.parametrize("n", [2, 3])
def test_values_from_function_of_tf_tensors(n):
    """A value function written for TF returns TF tensors: jdist takes the numeric ones as host
    values, and refuses a string tensor with its typed error (JAX holds no strings)."""
    strategy, tf_strategy = both(n)

    def value_fn(ctx):
        return tf.constant([1.5, 2.0]) * (ctx.replica_id_in_sync_group + 1)
    assert_matches(
        local_results(strategy, strategy.experimental_distribute_values_from_function(value_fn)),
        local_results(tf_strategy,
                      tf_strategy.experimental_distribute_values_from_function(value_fn)))
    with pytest.raises(errors.UnsupportedValueError, match="string"):
        strategy.experimental_distribute_values_from_function(lambda ctx: tf.constant(["a"]))

# ---------------------------------------------------------------------------------------------
# f. CrossDeviceOps called directly: reduce, batch_reduce and broadcast to values and devices.

CROSS_DEVICE_OPS = {  # name -> (jdist's, TF's)
    "ReductionToOneDevice": (jdist.ReductionToOneDevice, tf.distribute.ReductionToOneDevice),
    "NcclAllReduce": (jdist.NcclAllReduce, tf.distribute.NcclAllReduce),
    "HierarchicalCopyAllReduce": (lambda: jdist.HierarchicalCopyAllReduce(num_packs=2),
                                  lambda: tf.distribute.HierarchicalCopyAllReduce(num_packs=2)),
}


def even_value(dtype, shape, convert=np.asarray):
    def value_fn(ctx):
        """Replica r's ``shape`` values from r; float32 ones with inexact sums and means."""
        value = np.arange(np.prod(shape)).reshape(shape) + 5 * ctx.replica_id_in_sync_group
        value = (value / 7 + 0.1) if dtype == "float32" else value
        return convert(value.astype(dtype))
    return value_fn


def values_of_both(n, dtype, shape=(2, 3)):
    """The same per-replica value in each library, and each library's name of the last device.

    TF's replicas hold tensors made on their devices: a NumPy value keeps the device name
    ``"cpu"``, which TF's one-value shortcut does not match with ``CPU:0``.
    """
    strategy, tf_strategy = both(n)
    return ((strategy.experimental_distribute_values_from_function(even_value(dtype, shape)),
             f"CPU:{n - 1}"),
            (tf_strategy.experimental_distribute_values_from_function(
                even_value(dtype, shape, tf.constant)), f"/device:CPU:{n - 1}"))


@pytest.mark.parametrize("op", ["SUM", "MEAN"])
@pytest.mark.parametrize("dtype, x64", [("float32", False), ("int32", False), ("int32", True)])
@pytest.mark.parametrize("name", list(CROSS_DEVICE_OPS))
@pytest.mark.parametrize("n", COUNTS)
def test_cross_device_ops(n, name, dtype, x64, op):
    """reduce to the value's own devices and to one device, then batch_reduce of both at once
    (an int32 MEAN is TF's float64 with x64, float32 without)."""
    with jax.enable_x64(x64):
        check_cross_device_ops(n, name, dtype, op)


def check_cross_device_ops(n, name, dtype, op):
    strategy, tf_strategy = both(n)
    ops, tf_ops = (factory() for factory in CROSS_DEVICE_OPS[name])
    (v, last), (tf_v, tf_last) = values_of_both(n, dtype)
    (w, _), (tf_w, _) = values_of_both(n, dtype, shape=(4,))
    jdist_op, tf_op = jdist.ReduceOp(op), tf.distribute.ReduceOp(op)
    for destinations, tf_destinations in [(v, tf_v), (last, tf_last)]:
        assert_matches(outcome(strategy, lambda: ops.reduce(jdist_op, v, destinations)),
                       outcome(tf_strategy, lambda: tf_ops.reduce(tf_op, tf_v, tf_destinations)))
    got = outcome(strategy, lambda: ops.batch_reduce(jdist_op, [(v, v), (w, last)]))
    want = outcome(tf_strategy, lambda: tf_ops.batch_reduce(tf_op, [(tf_v, tf_v),
                                                                     (tf_w, tf_last)]))
    if isinstance(want, Exception) or isinstance(got, Exception):
        assert_matches(got, want)
    else:
        for g, w_ in zip(got, want):
            assert_matches(local_results(strategy, g), local_results(tf_strategy, w_))


@pytest.mark.parametrize("dtype", ["float32", "int32"])
@pytest.mark.parametrize("name", list(CROSS_DEVICE_OPS))
@pytest.mark.parametrize("n", COUNTS)
def test_cross_device_ops_of_one_value_and_broadcast(n, name, dtype):
    """A plain tensor is a one-replica value: on the destination's device already, TF returns it
    as it is (an int MEAN stays int); elsewhere it is reduced (MEAN divides by one)."""
    strategy, tf_strategy = both(n)
    ops, tf_ops = (factory() for factory in CROSS_DEVICE_OPS[name])
    (v, last), (tf_v, tf_last) = values_of_both(n, dtype)
    one = jax.device_put(np.array([3, 4], dtype), jax.devices()[0])
    with tf.device("/device:CPU:0"):
        tf_one = tf.constant(np.array([3, 4], dtype))
    for op in ("SUM", "MEAN"):
        for destinations, tf_destinations in [("CPU:0", "/device:CPU:0"), (last, tf_last)]:
            assert_matches(
                outcome(strategy, lambda: [ops.reduce(jdist.ReduceOp(op), one, destinations)]),
                outcome(tf_strategy, lambda: [tf_ops.reduce(tf.distribute.ReduceOp(op), tf_one,
                                                            tf_destinations)]))
    assert_matches(outcome(strategy, lambda: ops.broadcast(one, v)),
                   outcome(tf_strategy, lambda: tf_ops.broadcast(tf_one, tf_v)))


# ---------------------------------------------------------------------------------------------
# g. The order of float sums: random float32 values over 3, 5 and 8 replicas.

@functools.lru_cache(maxsize=None)
def random_values_of_both(n, dtype="float32", spread=0):
    """Random values (magnitudes over ``10**-spread`` to ``10**spread``) as a per-replica value
    of jdist's strategy and of TF's with ``ReductionToOneDevice`` (TF's own strategy on one
    replica), and the two strategies."""
    strategy, tf_strategy = both(n)
    tf_strategy = reduction_to_one_device(n) if n > 1 else tf_strategy
    rng = np.random.default_rng(n)
    comps = [(rng.normal(size=500) * 10.0 ** rng.integers(-spread, spread + 1, size=500)
              ).astype(jnp.dtype(dtype)) for _ in range(n)]
    v = strategy.experimental_distribute_values_from_function(
        lambda ctx: comps[ctx.replica_id_in_sync_group])
    tf_v = tf_strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(comps[ctx.replica_id_in_sync_group]))
    return strategy, tf_strategy, v, tf_v


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("op", ["SUM", "MEAN"])
@pytest.mark.parametrize("n", [3, 5, 8])
def test_float_sums_add_the_replicas_in_order(n, op, dtype):
    """Random values whose sums round differently in another order: jdist adds the replicas in
    replica order, bit for bit TF's ``ReductionToOneDevice`` (``add_n``), in
    ``strategy.reduce``, ``all_reduce`` and the cross-device ops; bfloat16 sums round every
    partial sum, as ``add_n`` does. (TF's collective and NCCL all-reduces add in ring order,
    which gives other last bits: docs/design.md section 9.)"""
    strategy, tf_strategy, v, tf_v = random_values_of_both(n, dtype, spread=2)
    want = outcome(tf_strategy, lambda: tf_strategy.reduce(op, tf_v, axis=None))
    assert_matches(outcome(strategy, lambda: strategy.reduce(op, v, axis=None)), want)
    assert_matches(outcome(strategy, lambda: strategy.run(
        lambda x: jdist.get_replica_context().all_reduce(op, x), args=(v,))),
        outcome(tf_strategy, lambda: tf_strategy.run(
            lambda x: tf.distribute.get_replica_context().all_reduce(op, x), args=(tf_v,))))
    for ops in (jdist.ReductionToOneDevice(), jdist.NcclAllReduce()):
        assert_matches(outcome(strategy, lambda: ops.reduce(jdist.ReduceOp(op), v, "CPU:0")),
                       want)


@pytest.mark.parametrize("op", ["SUM", "MEAN"])
@pytest.mark.parametrize("n", [3, 8])
def test_bfloat16_sums_round_every_partial_sum_on_every_path(n, op):
    """bfloat16 sums whose float32 partial sums would round otherwise, on the paths not covered
    above: packed all-reduces, ``batch_reduce``, a ``merge_call`` reduce, and a reduce along
    the rows."""
    strategy, tf_strategy, v, tf_v = random_values_of_both(n, "bfloat16", spread=2)
    packed = jdist.CommunicationOptions(bytes_per_pack=256)
    tf_packed = tf.distribute.experimental.CommunicationOptions(bytes_per_pack=256)
    assert_matches(
        outcome(strategy, lambda: strategy.run(lambda x: jdist.get_replica_context().all_reduce(
            op, [x, x * 2], options=packed), args=(v,))[1]),
        outcome(tf_strategy, lambda: tf_strategy.run(
            lambda x: tf.distribute.get_replica_context().all_reduce(
                op, [x, x * 2], options=tf_packed), args=(tf_v,))[1]))
    jdist_op, tf_op = jdist.ReduceOp(op), tf.distribute.ReduceOp(op)
    assert_matches(
        outcome(strategy, lambda: jdist.ReductionToOneDevice().batch_reduce(
            jdist_op, [(v, v)])[0]),
        outcome(tf_strategy, lambda: tf.distribute.ReductionToOneDevice().batch_reduce(
            tf_op, [(tf_v, tf_v)])[0]))
    assert_matches(
        outcome(strategy, lambda: strategy.run(lambda x: jdist.get_replica_context().merge_call(
            lambda s, x: s.reduce(op, x, axis=None), args=(x,)), args=(v,))),
        outcome(tf_strategy, lambda: tf_strategy.run(
            lambda x: tf.distribute.get_replica_context().merge_call(
                lambda s, x: s.reduce(op, x, axis=None), args=(x,)), args=(tf_v,))))
    rows, tf_rows = (s.experimental_distribute_values_from_function(
        lambda ctx: constant(np.asarray(s.experimental_local_results(x)[
            ctx.replica_id_in_sync_group]).reshape(50, 10)))
        for s, x, constant in ((strategy, v, jnp.asarray), (tf_strategy, tf_v, tf.constant)))
    assert_matches(outcome(strategy, lambda: strategy.reduce(op, rows, axis=0)),
                   outcome(tf_strategy, lambda: tf_strategy.reduce(op, tf_rows, axis=0)))


@pytest.mark.parametrize("op", ["SUM", "MEAN"])
@pytest.mark.parametrize("n", [3, 6, 8])
def test_reduce_of_a_value_every_replica_shares(n, op):
    """A step's all-reduced output (TF: a PerReplica of equal values; jdist: a Mirrored that
    knows it came from run), then reduced across replicas: TF adds the copies one at a time
    (``7x + x`` is not ``8x``), and its MEAN divides that sum by N (not the value itself, as a
    Mirrored of TF's own is: `test_reduce_of_a_mirrored_value`)."""
    strategy, tf_strategy, v, tf_v = random_values_of_both(n)
    shared = strategy.run(lambda x: jdist.get_replica_context().all_reduce("sum", x), args=(v,))
    tf_shared = tf_strategy.run(
        lambda x: tf.distribute.get_replica_context().all_reduce("sum", x), args=(tf_v,))
    assert_matches(outcome(strategy, lambda: strategy.reduce(op, shared, axis=None)),
                   outcome(tf_strategy, lambda: tf_strategy.reduce(op, tf_shared, axis=None)))


@pytest.mark.parametrize("op", ["SUM", "MEAN"])
@pytest.mark.parametrize("n", [1, 3, 8])
def test_reduce_of_a_mirrored_value(n, op):
    """A Mirrored of TF's own (a cross-device reduce to a value's devices): its MEAN is itself;
    TF refuses to SUM it on several replicas, and so does jdist."""
    strategy, tf_strategy, v, tf_v = random_values_of_both(n)
    m = jdist.ReductionToOneDevice().reduce(jdist.ReduceOp.SUM, v, v)
    tf_m = tf.distribute.ReductionToOneDevice().reduce(tf.distribute.ReduceOp.SUM, tf_v, tf_v)
    assert_matches(outcome(strategy, lambda: strategy.reduce(op, m, axis=None)),
                   outcome(tf_strategy, lambda: tf_strategy.reduce(op, tf_m, axis=None)))


# ---------------------------------------------------------------------------------------------
# g. Dtypes TF's collective ops refuse: MirroredStrategy's default ops on several devices raise
#    in all_reduce, batch_reduce_to, gather and all_gather; reduce and reduce_to (one value, to
#    CPU destinations) and ReductionToOneDevice take every dtype.

RARE_DTYPES = ["int8", "uint8", "int16", "uint16", "uint32", "complex64", "bfloat16", "bool",
               "float16"]
DTYPE_CALLS = {
    "all_reduce": lambda lib, s, v: s.run(
        lambda x: lib.get_replica_context().all_reduce("sum", x), args=(v,)),
    "batch_reduce_to": lambda lib, s, v: s.extended.batch_reduce_to("sum", [(v, v)])[0],
    "gather": lambda lib, s, v: s.gather(v, axis=0),
    "all_gather": lambda lib, s, v: s.run(
        lambda x: lib.get_replica_context().all_gather(x, 0), args=(v,)),
    "reduce": lambda lib, s, v: s.reduce("sum", v, axis=None),
    "reduce_to": lambda lib, s, v: s.extended.reduce_to("sum", v, v),
}


@pytest.mark.parametrize("ops", ["default", "ReductionToOneDevice"])
@pytest.mark.parametrize("dtype", RARE_DTYPES)
@pytest.mark.parametrize("n", [1, 2, 3])
def test_dtypes_of_tfs_collective_ops(n, dtype, ops):
    strategy, tf_strategy = both(n)
    if ops != "default":
        strategy, tf_strategy = both_reducing_to_one_device(n)
    ints = [np.arange(3) % 2 + i for i in range(n)]
    v = strategy.experimental_distribute_values_from_function(
        lambda ctx: ints[ctx.replica_id_in_sync_group].astype(jnp.dtype(dtype)))
    tf_v = tf_strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.cast(ints[ctx.replica_id_in_sync_group], dtype))
    for name, call in DTYPE_CALLS.items():
        got = outcome(strategy, lambda: call(jdist, strategy, v))
        want = outcome(tf_strategy, lambda: call(tf.distribute, tf_strategy, tf_v))
        if dtype == "bfloat16" and not isinstance(want, Exception):
            want = [w.astype(np.float32) for w in want]  # Compared as float32 (exact here).
            got = got if isinstance(got, Exception) else [g.astype(np.float32) for g in got]
        if isinstance(want, Exception) or isinstance(got, Exception):
            assert isinstance(got, Exception) == isinstance(want, Exception), (name, got, want)
            assert not isinstance(got, Exception) or isinstance(got, errors.JdistError), name
            continue
        assert_matches(got, want)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("call", ["reduce_to", "run"])
def test_what_a_compiled_function_returns_is_tfs(n, call):
    """tf.function returns a Mirrored (a reduce_to result) as one tensor, whose MEAN is itself
    and whose SUM raises, and run's outputs as one value per replica: so does jdist.function."""
    s, ts = both(n)

    def returned(strategy, compile_, constant):
        v = strategy.experimental_distribute_values_from_function(
            lambda ctx: constant(np.float32([1.5, -2.0]) * (ctx.replica_id_in_sync_group + 1)))
        if call == "reduce_to":
            body = lambda v: strategy.extended.reduce_to("SUM", v, v)  # noqa: E731
        else:
            body = lambda v: strategy.run(lambda x: x * 2.0, args=(v,))  # noqa: E731
        out = compile_(body)(v)
        return [outcome(strategy, lambda: out)] + [
            outcome(strategy, lambda op=op: strategy.reduce(op, out, axis=None))
            for op in ("MEAN", "SUM")]
    got = returned(s, jdist.function, np.asarray)
    want = returned(ts, tf.function, tf.constant)
    for g, w in zip(got, want):
        assert_matches(g, w)


@pytest.mark.parametrize("n", [2, 4])
def test_python_ints_per_replica_multiplied(n):
    s, ts = both(n)
    value_fn = lambda ctx: [0, 2, 5, 7][ctx.replica_id_in_sync_group]  # noqa: E731
    def body(strategy):
        return lambda v: strategy.reduce("SUM", strategy.run(lambda x: x * x, args=(v,)),
                                         axis=None)
    got = outcome(s, lambda: jdist.function(body(s))(
        s.experimental_distribute_values_from_function(value_fn)))
    want = outcome(ts, lambda: tf.function(tf.autograph.experimental.do_not_convert(body(ts)))(
        ts.experimental_distribute_values_from_function(value_fn)))
    assert_matches(got, want)


def test_one_replicas_values_from_a_function_are_a_per_replica_of_one():
    """TF's MirroredStrategy wraps one replica's value in a PerReplica: arithmetic on it in the
    cross-replica context raises, and a MEAN of its ints is float64 (float32 without x64)."""
    s, ts = both(1)
    for value_fn in (lambda ctx: np.int32([1, 2]), lambda ctx: np.float32(0.5)):
        v = s.experimental_distribute_values_from_function(value_fn)
        tv = ts.experimental_distribute_values_from_function(value_fn)
        assert_matches(outcome(s, lambda: v), outcome(ts, lambda: tv))
        for op in ("SUM", "MEAN"):
            assert_matches(outcome(s, lambda: s.reduce(op, v, axis=None)),
                           outcome(ts, lambda: ts.reduce(op, tv, axis=None)))
        assert isinstance(outcome(s, lambda: v + 1), Exception)
        assert isinstance(outcome(ts, lambda: tv + 1), Exception)
