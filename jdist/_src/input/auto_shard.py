"""Auto-sharding of ``experimental_distribute_dataset`` across workers (TF's ``AutoShardPolicy``).

With ``W`` workers of ``R`` replicas (``N = W * R``) each worker feeds its own replicas the rows
TF's ``input_lib`` gives them: it rebatches the dataset for its replicas, then auto-shards it
(``auto_shard_dataset``) under the dataset's policy (a ``tf.data`` dataset's
``options().experimental_distribute.auto_shard_policy``, or ``InputOptions(auto_shard_policy)``)
or, when none is asked for, TF's default ``AUTO``:

* ``DATA``: TF turns the rebatch into its legacy one (each global batch cut into ``N``
  consecutive chunks of ``ceil(B / N)`` rows, trailing ones shorter or empty) and shards the
  chunk stream: worker ``w`` keeps chunks ``w, w + W, ...``, so its replica ``r``, the global
  replica ``w * R + r``, gets chunk ``w + r * W`` of each global batch (`chunk_order`). Every
  worker reads the same global batches, so jdist splits each one as one process does and only
  reorders the chunks: no exchange between the workers per step.
* ``AUTO``: TF shards by file where it finds file readers, else by data. A `NumpyDataset` or a
  Python iterable reads no files: ``DATA``.
* ``OFF``: TF rebatches each worker's copy into the sub-batch sizes of
  ``tf.data.experimental.batch_sizes_for_worker(B, W, R, w)`` (``N`` sizes ``ceil`` / ``floor``
  of ``B / N``, worker 0's list rotated by ``w * R``), as a stream of rows (``unbatch`` then
  ``batch`` cycling through the sizes). Each global batch therefore spans ``W`` steps on every
  worker, and every worker processes every row.
* ``FILE``: TF rewrites the graph at its file readers; a `NumpyDataset` or an iterable has
  none, so across workers TF's iterator fails ("unshardable source") and jdist raises when the
  dataset is distributed; on one worker TF skips the rewrite, which leaves ``OFF``'s rebatch.
* ``HINT``: TF shards at the ``SHARD_HINT`` placeholders of a tf.data graph; data without any
  is not sharded, which leaves ``OFF``'s rebatch.

A ``tf.data`` dataset whose rows TF shards by data (``DATA``, or ``AUTO`` on a graph without
file readers, `reads_files`) is split like the others, with no exchange per step. Otherwise (a
reader under ``AUTO``, ``FILE``, ``OFF``, ``HINT``) each worker's pipeline is rebatched and
auto-sharded by TF itself (the same ``rebatch`` and ``auto_shard_dataset`` as TF's
``input_lib``), so the file sharding, its fallback to data and TF's errors (too few files for
the workers) are TF's own, and the workers keep in step as ``PER_WORKER`` pipelines do.

With one worker TF still rebatches, so the policy still matters there: ``DATA`` and ``AUTO``
without files split each global batch as above (in order), while ``OFF``, ``FILE`` and
``HINT``, and ``AUTO`` on a tf.data graph with readers, cut the row stream by
``batch_sizes_for_worker(B, 1, N, 0)``: a partial last batch of 4 rows on 4 replicas of a
``B = 7`` dataset gives ``[r r] [r r] [] []``, not ``[r] [r] [r] [r]``. One replica is never
rebatched.
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
    """``value`` (None, an `AutoShardPolicy`, TF's enum member, its int or name) checked.

    Raises:
      InvalidArgumentError: not a policy.
    """
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
    """The policy the options (``asked``) and the dataset ask for; TF's ``AUTO`` if neither.

    Raises:
      InvalidArgumentError: the two ask for different policies.
    """
    if asked is not None and on_dataset is not None and asked is not on_dataset:
        raise errors.InvalidArgumentError(
            f"InputOptions asks for AutoShardPolicy.{asked.name} but the tf.data dataset's "
            f"options for {on_dataset.name}; set one of them.")
    policy = asked if asked is not None else on_dataset
    return AutoShardPolicy.AUTO if policy is None else policy


def chunk_order(num_workers: int, replicas_per_worker: int) -> Optional[Tuple[int, ...]]:
    """TF's ``DATA`` sharding as an order of chunks: the global replica ``w * R + r`` receives
    chunk ``w + r * W`` of each global batch cut into ``N`` chunks; None where that is the
    identity (one worker, or one replica per worker).

    Args:
      num_workers: ``W``.
      replicas_per_worker: ``R``.

    Returns:
      Per global replica, the index of its chunk, or None.

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
    """TF's ``batch_sizes_for_worker``: worker ``worker_index``'s sub-batch sizes of one batch.

    Args:
      global_batch_size: ``B``, the rows of a full global batch.
      num_workers: ``W``.
      num_replicas_per_worker: ``R``.
      worker_index: ``w``.

    Returns:
      ``W * R`` sizes summing to ``B``: worker 0's (``ceil`` sizes first, then ``floor``)
      rotated left by ``w * R``.

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
    """``OFF``'s stream of per-replica batches for one worker: the rows of ``batches`` cut
    by TF's sub-batch sizes (`batch_sizes_for_worker`, cycled), as TF's ``rebatch`` cuts them.

    Args:
      batches: the global batches (NumPy nests with a leading batch axis).
      num_workers: ``W``.
      replicas_per_worker: ``R``.
      worker_index: ``w``.
      full_rows: ``B``, the full batch size (`off_batch_rows`).

    Returns:
      An iterator of per-replica batches, to be dealt ``R`` per step to this worker's replicas.

    Example:
      >>> rows = [np.arange(7), np.arange(7, 10)]
      >>> [b.tolist() for b in rebatched_for_worker(iter(rows), 2, 2, 1, 7)]
      [[0, 1], [2], [3, 4], [5, 6], [7, 8], [9]]
    """
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
        while pending and _rows(pending) >= want:
            yield jax.tree_util.tree_unflatten(tree, [a[:want] for a in pending])
            pending, want = [a[want:] for a in pending], next(sizes)
    if pending and _rows(pending):  # The end of the data: a last, shorter sub-batch.
        yield jax.tree_util.tree_unflatten(tree, pending)


def _rows(leaves):
    sizes = {np.shape(a)[0] for a in leaves}
    if len(sizes) != 1:
        raise errors.InvalidArgumentError(
            f"the arrays of one batch must share their leading (batch) size, got {sorted(sizes)}.")
    return sizes.pop()


def off_batch_rows(source) -> int:
    """The full batch size ``B`` that ``OFF`` rebatches a `NumpyDataset` or an iterable by: the
    one it declares (a `NumpyDataset`'s ``batch``).

    Raises:
      InvalidArgumentError: no full batch size is known. Across workers TF would then fall
        back to its legacy rebatch, which jdist does not reproduce for Python data, so it
        refuses rather than guess (on one worker that rebatch is the plain split).
    """
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
    """How this worker reads ``experimental_distribute_dataset``'s data (`worker_share`).

    Either ``pipeline`` is None and the worker splits the global batches over all replicas as
    one process does, replica ``g`` taking chunk ``order[g]`` (``order`` None: chunk ``g``);
    or ``pipeline`` is this worker's own `input_batches.Source` of per-replica batches, dealt
    ``R`` per step to its replicas and kept in step with the other workers'.
    """
    order: Optional[Tuple[int, ...]] = None
    pipeline: Optional[input_batches.Source] = None


def worker_share(source, asked: Optional[AutoShardPolicy], extended) -> Share:
    """This worker's share of ``experimental_distribute_dataset``'s data, as TF's ``input_lib``
    gives it (see the module doc): on one worker too, where TF still rebatches (its ``OFF`` /
    ``FILE`` rebatch splits a partial batch unlike the ``DATA`` one).

    Args:
      source: the dataset's `input_batches.Source`.
      asked: ``InputOptions.auto_shard_policy``.
      extended: the strategy's extended (its workers and local replicas).

    Raises:
      InvalidArgumentError: see `effective_policy`; workers with different replica counts;
        ``FILE`` across workers on data without files; ``OFF`` across workers on an iterable
        without a declared full batch size (`off_batch_rows`).
    """
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
    """Whether TF's ``AUTO`` might shard the ``tf.data`` ``dataset`` by file: its serialised
    graph (functions included, an ``interleave``'s say) names one of TF's reader ops or a
    ``Placeholder``. Without any TF's file sharding finds nothing and ``AUTO`` shards by
    data; with one (or a name that only looks like one, in a string constant), TF's own rewrite
    decides (`worker_share`). The bytes are searched, not parsed: an in-memory dataset's graph
    holds its data.

    Example:
      >>> import tensorflow as tf  # doctest: +SKIP
      >>> reads_files(tf.data.Dataset.range(8).batch(4))  # doctest: +SKIP
      False
    """
    try:
        graph = dataset._as_serialized_graph().numpy()  # pylint: disable=protected-access
    except Exception:  # pylint: disable=broad-except  # Not serialisable: TF's rewrite decides.
        return True
    return any(op in graph for op in _FILE_SHARDING_OPS)


def _tf_worker_dataset(dataset, asked, num_workers, replicas_per_worker, worker_index):
    """This worker's pipeline of a ``tf.data`` dataset, built by TF's own functions as its
    ``input_lib`` builds it: ``rebatch`` into this worker's sub-batch sizes (TF's legacy
    rebatch where the graph has no batch op to size them), then ``auto_shard_dataset`` under
    the dataset's policy (``asked`` set on its options first)."""
    # Not TF's public API: the functions its input_lib calls (TF is installed: this is tf.data).
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
