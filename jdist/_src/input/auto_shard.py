"""Auto-sharding of ``experimental_distribute_dataset`` across workers (TF's ``AutoShardPolicy``).

Each of ``W`` workers of ``R`` replicas feeds its replicas the rows TF's ``input_lib`` gives
them (policies: ``docs/multi_worker.md``). Where TF shards by data (``DATA``; ``AUTO`` on data
without file readers, `reads_files`) every worker reads the same global batches, so jdist splits
each as one process does and only reorders the chunks (`chunk_order`): no exchange per step.
Otherwise each worker's pipeline is rebatched: a ``tf.data`` one by TF's own ``rebatch`` and
``auto_shard_dataset`` (so file sharding and its errors are TF's), other data by
`rebatched_for_worker`. TF rebatches on one worker too, so the policy decides there how a
partial batch is split; one replica is never rebatched.
"""

import enum
import itertools
from typing import Iterator, List, NamedTuple, Optional, Tuple

import jax
import numpy as np

from jdist._src import errors
from jdist._src.input import batches as input_batches


class AutoShardPolicy(enum.IntEnum):
    """How ``experimental_distribute_dataset`` shards its data over workers (TF's enum values).

    Example:
      >>> import jdist
      >>> opts = jdist.InputOptions(auto_shard_policy=jdist.AutoShardPolicy.DATA)
      >>> opts.auto_shard_policy.name, int(jdist.AutoShardPolicy.OFF)
      ('DATA', -1)
    """
    OFF = -1
    AUTO = 0
    FILE = 1
    DATA = 2
    HINT = 3


def as_policy(value) -> Optional[AutoShardPolicy]:
    """``value`` (None, an `AutoShardPolicy`, TF's enum member, its int or name) checked."""
    if value is None or isinstance(value, AutoShardPolicy):
        return value
    raw = getattr(value, "value", value)  # TF's enum member: its int value.
    try:
        if isinstance(value, str):
            return AutoShardPolicy[value.upper()]
        if isinstance(raw, (int, np.integer)) and not isinstance(raw, bool):
            return AutoShardPolicy(int(raw))
        raise ValueError(raw)
    except (KeyError, ValueError):
        raise errors.InvalidArgumentError(
            f"{value!r} is not an AutoShardPolicy (OFF, AUTO, FILE, DATA, HINT).") from None


def tf_dataset_policy(dataset) -> Optional[AutoShardPolicy]:
    """The policy a ``tf.data`` dataset's options ask for: None for TF's default ``AUTO``."""
    policy = as_policy(dataset.options().experimental_distribute.auto_shard_policy)
    return None if policy is AutoShardPolicy.AUTO else policy


def effective_policy(asked: Optional[AutoShardPolicy],
                     on_dataset: Optional[AutoShardPolicy]) -> AutoShardPolicy:
    """The policy the options (``asked``) and the dataset ask for (raises if they differ);
    TF's ``AUTO`` if neither."""
    if asked is not None and on_dataset is not None and asked is not on_dataset:
        raise errors.InvalidArgumentError(
            f"InputOptions asks for AutoShardPolicy.{asked.name} but the tf.data dataset's "
            f"options for {on_dataset.name}; set one of them.")
    policy = asked if asked is not None else on_dataset
    return AutoShardPolicy.AUTO if policy is None else policy


def chunk_order(num_workers: int, replicas_per_worker: int) -> Optional[Tuple[int, ...]]:
    """TF's ``DATA`` sharding as an order of chunks: global replica ``w * R + r`` receives chunk
    ``w + r * W`` of each global batch; None where that is the identity.

    Example:
      >>> chunk_order(2, 2), chunk_order(2, 1)
      ((0, 2, 1, 3), None)
    """
    if num_workers == 1 or replicas_per_worker == 1:
        return None
    return tuple(w + r * num_workers for w in range(num_workers)
                 for r in range(replicas_per_worker))


def batch_sizes_for_worker(global_batch_size: int, num_workers: int,
                           num_replicas_per_worker: int, worker_index: int) -> List[int]:
    """TF's ``batch_sizes_for_worker``: ``W * R`` sizes summing to ``B``, worker 0's (``ceil``
    sizes first, then ``floor``) rotated left by ``w * R``.

    Example:
      >>> batch_sizes_for_worker(7, 2, 2, 0), batch_sizes_for_worker(7, 2, 2, 1)
      ([2, 2, 2, 1], [2, 1, 2, 2])
    """
    n = num_workers * num_replicas_per_worker
    floor, ceil_count = divmod(global_batch_size, n)
    worker_0 = [floor + 1] * ceil_count + [floor] * (n - ceil_count)
    offset = worker_index * num_replicas_per_worker
    return worker_0[offset:] + worker_0[:offset]


def rebatched_for_worker(batches: Iterator, num_workers: int, replicas_per_worker: int,
                        worker_index: int, full_rows: int) -> Iterator:
    """``OFF``'s per-replica batches for one worker: the rows of ``batches`` cut by TF's
    sub-batch sizes (`batch_sizes_for_worker` of ``full_rows``, cycled), as TF's ``rebatch``."""
    pending: list = []
    tree, sizes, want = None, None, None
    for batch in batches:
        leaves, tree = jax.tree_util.tree_flatten(batch)
        if sizes is None:
            sizes = itertools.cycle(batch_sizes_for_worker(
                full_rows, num_workers, replicas_per_worker, worker_index))
            want = next(sizes)
        pending = [np.concatenate([p, a]) for p, a in zip(pending, leaves)] if pending else [
            np.asarray(a) for a in leaves]
        while pending and input_batches.batch_size(pending) >= want:
            yield jax.tree_util.tree_unflatten(tree, [a[:want] for a in pending])
            pending, want = [a[want:] for a in pending], next(sizes)
    if pending and input_batches.batch_size(pending):  # The end: a last, shorter sub-batch.
        yield jax.tree_util.tree_unflatten(tree, pending)


def off_batch_rows(source) -> int:
    """The full batch size ``OFF`` rebatches a `NumpyDataset` or an iterable by. Raises where
    none is declared: TF's legacy rebatch is not reproduced for Python data."""
    rows = source.static_rows()
    if rows is None:
        raise errors.InvalidArgumentError(
            "AutoShardPolicy.OFF cuts the data into TF's per-worker batch sizes, computed from "
            "the dataset's full batch size, which this dataset does not declare (a list or "
            "generator of batches). Batch it with "
            "strategy.experimental_make_numpy_dataset(data).batch(global_batch_size) or "
            "tf.data's .batch(global_batch_size), or read each worker's own data with "
            "distribute_datasets_from_function.")
    return rows


class Share(NamedTuple):
    """How this worker reads the data: with ``pipeline`` None it splits the global batches,
    replica ``g`` taking chunk ``order[g]``; else its own `input_batches.Source` of per-replica
    batches, dealt ``R`` per step."""
    order: Optional[Tuple[int, ...]] = None
    pipeline: Optional[input_batches.Source] = None


def worker_share(source, asked: Optional[AutoShardPolicy], extended) -> Share:
    """This worker's share of the data, as TF's ``input_lib`` gives it (on one worker too).
    Raises for workers with different replica counts, ``FILE`` across workers on data without
    files, ``OFF`` without a full batch size (and see `effective_policy`)."""
    workers, index = extended._input_pipeline()
    local = len(extended._local_replica_ids())
    if local * workers == 1:  # TF neither rebatches nor shards for one replica.
        return Share()
    on_dataset = tf_dataset_policy(source.dataset) if source.is_tf else None
    policy = effective_policy(asked, on_dataset)
    if local * workers != len(extended.replica_devices):
        raise errors.InvalidArgumentError(
            f"auto-sharding (AutoShardPolicy.{policy.name}) needs the same number of replicas "
            f"on every worker (TF's rule); this worker has {local} of "
            f"{len(extended.replica_devices)}.")
    if policy is AutoShardPolicy.AUTO and not (source.is_tf and reads_files(source.dataset)):
        policy = AutoShardPolicy.DATA  # TF finds no file to shard by, so it shards by data.
    if policy is AutoShardPolicy.DATA:  # Every worker reads the same global batches.
        return Share(order=chunk_order(workers, local))
    if source.is_tf:
        dataset = _tf_worker_dataset(source.dataset, asked, workers, local, index)
        return Share(pipeline=input_batches.Source(dataset, "experimental_distribute_dataset"))
    if policy is AutoShardPolicy.FILE and workers > 1:
        raise errors.InvalidArgumentError(
            f"AutoShardPolicy.FILE shards tf.data pipelines at their file readers; a "
            f"{type(source.dataset).__name__} reads no files, so TF's iterator would fail "
            "('unshardable source'). Use AutoShardPolicy.DATA (TF's AUTO gives it here) or "
            "OFF, or read each worker's own data with distribute_datasets_from_function.")
    # OFF; HINT (data without SHARD_HINT: nothing to shard); FILE on one worker (TF skips it).
    if workers == 1 and source.static_rows() is None:
        return Share()  # TF's legacy rebatch of each batch: the split of one process.
    return Share(pipeline=_rebatched_source(source, workers, local, index))


def _rebatched_source(source, num_workers, replicas_per_worker, worker_index):
    """``OFF``'s per-replica batches of a `NumpyDataset` or an iterable, as a source."""
    rows = off_batch_rows(source)

    def rebatched():
        batches = source.open()
        try:
            yield from rebatched_for_worker(batches, num_workers, replicas_per_worker,
                                            worker_index, rows)
        finally:
            batches.close()
    return input_batches.Source(rebatched, "experimental_distribute_dataset")


# TF's file readers (`kReaderDatasetOps` of its auto_shard rewrite; versions share the prefix)
# and its other file-sharding pattern, a Placeholder source.
_FILE_SHARDING_OPS = (b"ArrayRecordDataset", b"FixedLengthRecordDataset", b"RecordIODataset",
                      b"SSTableDataset", b"TextLineDataset", b"TFRecordDataset", b"Placeholder")


def reads_files(dataset) -> bool:
    """Whether TF's ``AUTO`` might shard ``dataset`` by file: its serialised graph names a reader
    op or a ``Placeholder`` (a false positive only leaves the decision to TF's own rewrite).
    The bytes are searched, not parsed: an in-memory dataset's graph holds its data."""
    try:
        graph = dataset._as_serialized_graph().numpy()  # pylint: disable=protected-access
    except Exception:  # pylint: disable=broad-except  # Not serialisable: TF's rewrite decides.
        return True
    return any(op in graph for op in _FILE_SHARDING_OPS)


def _tf_worker_dataset(dataset, asked, num_workers, replicas_per_worker, worker_index):
    """This worker's ``tf.data`` pipeline by TF's (private) ``rebatch``, ``auto_shard_dataset``."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tensorflow.python.data.experimental.ops import distribute  # pylint: disable=import-outside-toplevel
    from tensorflow.python.distribute import input_ops  # pylint: disable=import-outside-toplevel
    if asked is not None:
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy(int(asked)))
        dataset = dataset.with_options(options)
    replicas = num_workers * replicas_per_worker
    size = int(distribute.compute_batch_size(dataset))
    if size == -1:
        dataset = distribute._LegacyRebatchDataset(dataset, replicas)  # pylint: disable=protected-access
    else:
        dataset = dataset.rebatch(distribute.batch_sizes_for_worker(
            size, num_workers, replicas_per_worker, worker_index))
    return input_ops.auto_shard_dataset(dataset, num_workers, worker_index, replicas)
