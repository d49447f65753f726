"""AutoShardPolicy (TF's auto-sharding of experimental_distribute_dataset across workers): the
rules one process can check, against NumPy and, where TF is installed, against TF's own
per-worker pipelines. The rows two workers receive are checked in ``test_multi_worker.py``; on
one worker every policy is a no-op."""

import numpy as np
import pytest

import jdist
from jdist import errors
from jdist._src.input import auto_shard
from jdist._src.input import batches as input_batches
from jdist._src.input.auto_shard import AutoShardPolicy as P
from jdist.testing import mirrored

from _tf_skip import tf_or_skip

try:  # TF's logical devices are configured when _tf_reference is imported, before any TF op.
    import tensorflow  # noqa: F401
except ImportError:
    strategies = None
else:
    from _tf_reference import strategies


@pytest.mark.parametrize("batch, workers, replicas, index, sizes", [
    (7, 2, 2, 0, [2, 2, 2, 1]), (7, 2, 2, 1, [2, 1, 2, 2]),  # TF's docstring example.
    (8, 2, 2, 1, [2, 2, 2, 2]), (3, 1, 4, 0, [1, 1, 1, 0]), (10, 3, 1, 2, [3, 4, 3])])
def test_batch_sizes_for_worker(batch, workers, replicas, index, sizes):
    assert auto_shard.batch_sizes_for_worker(batch, workers, replicas, index) == sizes


def _rows(batches):
    return [{k: v.tolist() for k, v in b.items()} for b in batches]


@pytest.mark.parametrize("workers, replicas, order", [
    (1, 4, None), (4, 1, None), (2, 2, (0, 2, 1, 3)), (2, 3, (0, 2, 4, 1, 3, 5)),
    (3, 2, (0, 3, 1, 4, 2, 5))])
def test_chunk_order_is_w_plus_r_times_workers(workers, replicas, order):
    assert auto_shard.chunk_order(workers, replicas) == order


def _tf_data_shards(batch_sizes, workers, replicas):
    """TF's DATA sharding in NumPy: each global batch of rows cut into N chunks of ceil(B/N)
    (trailing ones shorter or empty); worker w keeps chunks w, w + W, ... for its replicas."""
    n, start, steps = workers * replicas, 0, []
    for size in batch_sizes:
        rows, per = np.arange(start, start + size), -(-size // n)
        chunks = [rows[j * per:(j + 1) * per] for j in range(n)]
        steps.append([chunks[w + r * workers].tolist() for w in range(workers)
                      for r in range(replicas)])
        start += size
    return steps


@pytest.mark.parametrize("workers, replicas", [(2, 2), (2, 3), (3, 2), (4, 2)])
@pytest.mark.parametrize("batch_sizes", [[8, 8], [7, 7, 4], [12, 5], [6, 3]])
def test_global_split_in_data_order_gives_tf_s_rows(workers, replicas, batch_sizes):
    """The split every worker makes of the same global batches, reordered by `chunk_order`,
    gives each global replica TF's DATA chunk (here on one process with W x R devices)."""
    s = mirrored(workers * replicas)
    placer = input_batches.Placer(s, fetch_to_device=False)
    splitter = input_batches.GlobalBatchSplitter(placer, max(batch_sizes),
                                                 auto_shard.chunk_order(workers, replicas))
    start, got = 0, []
    for size in batch_sizes:
        value = splitter(np.arange(start, start + size))
        got.append([np.asarray(x).tolist() for x in value.values])
        start += size
    assert got == _tf_data_shards(batch_sizes, workers, replicas)


@pytest.mark.parametrize("index, expected", [
    (0, [[0, 1], [2, 3], [4, 5], [6], [7, 8], [9]]),
    (1, [[0, 1], [2], [3, 4], [5, 6], [7, 8], [9]])])
def test_off_rebatches_the_row_stream(index, expected):
    batches = [{"x": np.arange(7)}, {"x": np.arange(7, 10)}]  # A partial last batch.
    got = auto_shard.rebatched_for_worker(iter(batches), 2, 2, index, full_rows=7)
    assert _rows(got) == [{"x": e} for e in expected]


class _TwoWorkers:
    """What `worker_share` reads of a strategy's extended: worker 0 of 2, 2 replicas each."""
    replica_devices = (0, 1, 2, 3)

    @staticmethod
    def _input_pipeline():
        return 2, 0

    @staticmethod
    def _local_replica_ids():
        return (0, 1)


class _OneWorker(_TwoWorkers):
    """One worker with all 4 replicas."""
    @staticmethod
    def _input_pipeline():
        return 1, 0

    @staticmethod
    def _local_replica_ids():
        return (0, 1, 2, 3)


def _source(data):
    return input_batches.Source(data, "experimental_distribute_dataset")


@pytest.mark.parametrize("asked", [None, P.AUTO, P.DATA])
def test_data_and_auto_split_the_global_batches_in_tf_s_order(asked):
    share = auto_shard.worker_share(_source([{"x": np.arange(8)}]), asked, _TwoWorkers)
    assert share == auto_shard.Share(order=(0, 2, 1, 3))


@pytest.mark.parametrize("asked", [None] + list(P))
def test_one_worker_without_a_declared_batch_size_splits_in_order(asked):
    """TF's legacy rebatch, where no batch size is known: the split of one process."""
    assert auto_shard.worker_share(_source([np.arange(8)]), asked, _OneWorker) == (
        auto_shard.Share())


def test_off_without_a_known_batch_size_raises():
    batches = [{"x": np.arange(7)}, {"x": np.arange(7, 10)}]
    with pytest.raises(errors.InvalidArgumentError, match="does not declare"):
        auto_shard.worker_share(_source(batches), P.OFF, _TwoWorkers)


def test_file_across_workers_on_data_without_files_raises():
    with pytest.raises(errors.InvalidArgumentError, match="reads no files"):
        auto_shard.worker_share(_source([np.arange(8)]), P.FILE, _TwoWorkers)


@pytest.mark.parametrize("policy, workers", [
    (P.HINT, _TwoWorkers), (P.FILE, _OneWorker), (P.HINT, _OneWorker), (P.OFF, _OneWorker)])
def test_no_hint_and_file_on_one_worker_leave_off_s_rebatch(policy, workers):
    """No SHARD_HINT to shard at, and TF skips FILE on one worker: OFF's rebatch remains."""
    dataset = mirrored(1).experimental_make_numpy_dataset({"x": np.arange(10)}).batch(7)
    share = auto_shard.worker_share(_source(dataset), policy, workers)
    off = auto_shard.worker_share(_source(dataset), P.OFF, workers)
    assert _rows(share.pipeline.open()) == _rows(off.pipeline.open())


def test_off_takes_a_numpy_dataset_s_declared_batch_size():
    dataset = mirrored(1).experimental_make_numpy_dataset({"x": np.arange(10)}).batch(7)
    assert auto_shard.off_batch_rows(_source(dataset)) == 7
    share = auto_shard.worker_share(_source(dataset), P.OFF, _TwoWorkers)
    assert _rows(share.pipeline.open()) == [
        {"x": e} for e in [[0, 1], [2, 3], [4, 5], [6], [7, 8], [9]]]


@pytest.mark.parametrize("value, policy", [
    (None, None), ("data", P.DATA), ("OFF", P.OFF), (-1, P.OFF), (P.AUTO, P.AUTO), (3, P.HINT)])
def test_as_policy(value, policy):
    assert auto_shard.as_policy(value) is policy


@pytest.mark.parametrize("value", ["shard", 7, 1.5])
def test_as_policy_rejects(value):
    with pytest.raises(errors.InvalidArgumentError, match="not an AutoShardPolicy"):
        jdist.InputOptions(auto_shard_policy=value)


@pytest.mark.parametrize("asked, on_dataset, policy", [
    (None, None, P.AUTO), (P.OFF, None, P.OFF), (None, P.DATA, P.DATA), (P.FILE, None, P.FILE),
    (P.DATA, P.DATA, P.DATA)])
def test_effective_policy_is_tf_s_auto_unless_asked(asked, on_dataset, policy):
    assert auto_shard.effective_policy(asked, on_dataset) is policy


def test_effective_policy_refuses_two_different_asks():
    with pytest.raises(errors.InvalidArgumentError, match="set one of them"):
        auto_shard.effective_policy(P.OFF, P.DATA)


def _steps(strategy, dataset, options=None):
    return [[np.asarray(x).tolist() for x in strategy.experimental_local_results(b)]
            for b in strategy.experimental_distribute_dataset(dataset, options)]


@pytest.mark.parametrize("policy", [None] + list(P))
def test_one_worker_policies_split_a_partial_batch_as_tf(policy):
    """TF rebatches on one worker too: DATA (and AUTO without files) cuts each batch in
    ceil(B/N) chunks; OFF, FILE and HINT cut the row stream by batch_sizes_for_worker, so a
    partial batch fills the first replicas (checked against TF in test_one_worker_tf_split)."""
    s = mirrored(4)
    # Batches of 7, 7 and 4 rows.
    dataset = s.experimental_make_numpy_dataset(np.arange(18, dtype=np.float32)).batch(7)
    full = [[[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0]],
            [[7.0, 8.0], [9.0, 10.0], [11.0, 12.0], [13.0]]]
    last = ([[14.0, 15.0], [16.0, 17.0], [], []] if policy in (P.OFF, P.FILE, P.HINT)
            else [[14.0], [15.0], [16.0], [17.0]])
    assert _steps(s, dataset, jdist.InputOptions(auto_shard_policy=policy)) == full + [last]


@pytest.mark.parametrize("policy", [None] + list(P))
def test_one_replica_is_never_rebatched(policy):
    s = mirrored(1)
    dataset = s.experimental_make_numpy_dataset(np.arange(10, dtype=np.float32)).batch(4)
    assert _steps(s, dataset, jdist.InputOptions(auto_shard_policy=policy)) == [
        [[0.0, 1.0, 2.0, 3.0]], [[4.0, 5.0, 6.0, 7.0]], [[8.0, 9.0]]]


def test_tf_dataset_policy():
    tf = tf_or_skip()
    dataset = tf.data.Dataset.range(8).batch(4)
    assert auto_shard.tf_dataset_policy(dataset) is None  # TF's default AUTO: not asked.
    for tf_policy, policy in ((tf.data.experimental.AutoShardPolicy.OFF, P.OFF),
                              (tf.data.experimental.AutoShardPolicy.DATA, P.DATA)):
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = tf_policy
        assert auto_shard.tf_dataset_policy(dataset.with_options(options)) is policy


def _tf_pipeline_rows(tf, dataset, workers, replicas, index):
    """Worker ``index``'s per-replica batches as TF's input_lib builds them (the oracle: TF's
    own `_make_rebatch_fn` and `auto_shard_dataset`), as lists."""
    from tensorflow.python.distribute import input_lib, input_ops
    n = workers * replicas
    rebatch = input_lib.DistributedDataset._make_rebatch_fn(None, dataset, workers, n)
    sharded = input_ops.auto_shard_dataset(rebatch(dataset, index), workers, index, n)
    return [np.asarray(b).tolist() for b in sharded.as_numpy_iterator()]


@pytest.mark.parametrize("workers, replicas", [(2, 2), (2, 3), (3, 2)])
@pytest.mark.parametrize("batch_sizes", [[8, 8], [7, 7, 4], [6, 3]])
def test_data_order_is_tf_s_data_sharding(workers, replicas, batch_sizes):
    """The chunk order jdist splits in (`_tf_data_shards`) against TF's per-worker pipelines."""
    tf = tf_or_skip()
    dataset = tf.data.Dataset.range(sum(batch_sizes)).batch(batch_sizes[0])
    expected = _tf_data_shards(
        [min(batch_sizes[0], sum(batch_sizes) - i) for i in range(0, sum(batch_sizes),
                                                                   batch_sizes[0])],
        workers, replicas)
    for w in range(workers):
        got = _tf_pipeline_rows(tf, dataset, workers, replicas, w)
        assert got == [c for step in expected for c in step[w * replicas:(w + 1) * replicas]]


def _tf_datasets(tf, tmp_path):
    files = []
    for f in range(3):
        files.append(str(tmp_path / f"part{f}.tfrecord"))
        with tf.io.TFRecordWriter(files[-1]) as writer:
            for i in range(5):
                writer.write(tf.io.serialize_tensor(tf.constant(f * 100 + i, tf.int64)).numpy())
    records = tf.data.TFRecordDataset(files).map(lambda r: tf.io.parse_tensor(r, tf.int64))

    def with_policy(dataset, policy):
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = policy
        return dataset.with_options(options)
    tf_policy = tf.data.experimental.AutoShardPolicy
    return {"range": tf.data.Dataset.range(18).batch(7),
            "range_off": with_policy(tf.data.Dataset.range(18).batch(7), tf_policy.OFF),
            "range_data": with_policy(tf.data.Dataset.range(18).batch(7), tf_policy.DATA),
            "files_auto": records.batch(4),  # TF finds the reader: FILE sharding.
            "files_data": with_policy(records.batch(4), tf_policy.DATA),
            "no_batch_op": tf.data.Dataset.from_tensor_slices(np.arange(18).reshape(3, 6))}


def _worker(index):
    return type("W", (_TwoWorkers,), {"_input_pipeline": staticmethod(lambda: (2, index))})


def _jdist_rows(share, source, index, replicas=2):
    """Worker ``index``'s per-replica batches in order: its own pipeline's, or its replicas'
    chunks of the global batches split in `Share.order` (what `GlobalBatchSplitter` gives)."""
    if share.pipeline is not None:
        return [np.asarray(b).tolist() for b in share.pipeline.open()]
    rows = []
    for batch in source.open():
        per = -(-len(batch) // len(share.order))
        mine = share.order[index * replicas:(index + 1) * replicas]
        rows += [batch[j * per:(j + 1) * per].tolist() for j in mine]
    return rows


@pytest.mark.parametrize("name, split", [
    ("range", True), ("range_off", False), ("range_data", True), ("files_auto", False),
    ("files_data", True), ("no_batch_op", True)])
@pytest.mark.parametrize("index", [0, 1])
def test_tf_data_gives_tf_s_rows(name, split, index, tmp_path):
    """Sharded by data (DATA, or AUTO without readers): the global split in TF's order, no
    pipeline of its own; otherwise TF's own pipeline. Either way TF's rows."""
    tf = tf_or_skip()
    dataset = _tf_datasets(tf, tmp_path)[name]
    share = auto_shard.worker_share(_source(dataset), None, _worker(index))
    assert (share.pipeline is None) == split
    got = _jdist_rows(share, _source(dataset), index)
    assert got == _tf_pipeline_rows(tf, dataset, 2, 2, index)
    if name == "files_auto":  # FILE: worker 0 reads files 0 and 2, worker 1 file 1.
        assert sorted(sum(got, [])) == [f * 100 + i for f in ((0, 2), (1,))[index]
                                        for i in range(5)]


@pytest.mark.parametrize("asked, on_dataset", [
    (P.OFF, "range_off"), (P.DATA, "range_data"), (P.DATA, "files_data")])
def test_a_policy_asked_in_input_options_is_tf_s(asked, on_dataset, tmp_path):
    tf = tf_or_skip()
    datasets = _tf_datasets(tf, tmp_path)
    plain = datasets["files_auto" if on_dataset.startswith("files") else "range"]
    share = auto_shard.worker_share(_source(plain), asked, _TwoWorkers)
    assert _jdist_rows(share, _source(plain), 0) == _tf_pipeline_rows(
        tf, datasets[on_dataset], 2, 2, 0)


def test_reads_files(tmp_path):
    tf = tf_or_skip()
    datasets = _tf_datasets(tf, tmp_path)
    files = [str(f) for f in sorted(tmp_path.glob("*.tfrecord"))]
    interleaved = tf.data.Dataset.from_tensor_slices(files).interleave(tf.data.TFRecordDataset)
    assert [auto_shard.reads_files(d) for d in (
        datasets["range"], datasets["no_batch_op"], datasets["files_auto"], interleaved,
        tf.data.TextLineDataset(files), tf.data.FixedLengthRecordDataset(files, 4))] == [
            False, False, True, True, True, True]


def test_too_few_files_is_tf_s_error(tmp_path):
    tf = tf_or_skip()
    path = str(tmp_path / "one.tfrecord")
    with tf.io.TFRecordWriter(path) as writer:
        writer.write(b"x")
    share = auto_shard.worker_share(_source(tf.data.TFRecordDataset([path]).batch(2)), None,
                                    _TwoWorkers)
    with pytest.raises(tf.errors.InvalidArgumentError, match="not enough"):
        list(share.pipeline.open())


def _policy_dataset(tf, dataset, policy):
    if policy is None:
        return dataset
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy(
        int(policy))
    return dataset.with_options(options)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("name, policy", [
    ("files", None), ("files", P.DATA), ("files", P.OFF), ("range", None), ("range", P.OFF),
    ("range", P.FILE), ("range", P.HINT), ("range", P.DATA), ("static", P.OFF),
    ("static", None)])
def test_one_worker_tf_split(n, name, policy, tmp_path):
    """jdist's MirroredStrategy against TF's on one worker, per step and replica: TF's rebatch
    (OFF, FILE, HINT, AUTO on files) and its legacy one (DATA, AUTO without files)."""
    tf = tf_or_skip()
    s, tf_strategy = strategies(n)
    if tf_strategy is None:
        pytest.skip("TensorFlow's devices were configured before this test.")
    path = str(tmp_path / "rows.tfrecord")
    with tf.io.TFRecordWriter(path) as writer:
        for i in range(18):
            writer.write(tf.io.serialize_tensor(tf.constant(i, tf.int64)).numpy())
    dataset = {"files": tf.data.TFRecordDataset([path]).map(
                   lambda r: tf.ensure_shape(tf.io.parse_tensor(r, tf.int64), [])).batch(7),
               "range": tf.data.Dataset.range(18).batch(7),
               "static": tf.data.Dataset.range(20).batch(6, drop_remainder=True)}[name]
    dataset = _policy_dataset(tf, dataset, policy)
    want = [[np.asarray(x).tolist() for x in tf_strategy.experimental_local_results(b)]
            for b in tf_strategy.experimental_distribute_dataset(dataset)]
    assert _steps(s, dataset) == want
    assert _optional_steps(s, dataset) == _optional_steps(tf_strategy, dataset)


def _optional_steps(strategy, dataset):
    """Every step ``get_next_as_optional`` hands over (trailing rounds included), per replica."""
    iterator, steps = iter(strategy.experimental_distribute_dataset(dataset)), []
    while True:
        optional = iterator.get_next_as_optional()
        if not optional.has_value():
            return steps
        steps.append([np.asarray(x).tolist()
                      for x in strategy.experimental_local_results(optional.get_value())])
