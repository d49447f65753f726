"""The position of a distributed iterator, saved in a checkpoint and read back.

A numpy pipeline's position is global: each shuffle's seed state when the iterator was made,
and the GLOBAL batches handed out since. Restored, the shuffles continue from that state and the
pipeline skips those batches as row indices (no data read), so the same global batches follow,
split for any replica count. A tf.data or grain iterator the caller made is positioned by its
own state (read unbuffered, so it is at the handed-out position); a Python iterable cannot be.
"""

import base64
import os
import sys
import tempfile
from typing import Any

from jdist._src import errors
from jdist._src.input.numpy_dataset import NumpyDataset

_FORMAT = 1


def _numpy_source(dataset):
    """``dataset``'s `NumpyDataset` where its batches are global ones, else None."""
    plan = getattr(dataset, "_plan", None)
    source = getattr(plan, "source", None)
    if source is not None and isinstance(source.dataset, NumpyDataset):
        return source.dataset
    return None


def _unpositionable(what):
    return errors.InvalidArgumentError(
        f"the position of an iterator over {what} cannot be saved or restored: only an "
        "iterator of strategy.experimental_distribute_dataset(strategy."
        "experimental_make_numpy_dataset"
        "(arrays)...) knows its position. Use a numpy dataset (its shuffle, batch, repeat, take, "
        "skip and shard are tf.data's), or give experimental_distribute_dataset a tf.data or "
        "grain iterator, iter(tf_dataset), with InputOptions(experimental_per_replica_buffer_"
        "size=0) (tf.data checkpoints its position), or leave the iterator out and resume at an "
        "epoch boundary.")


def _own_state_iterator(dataset):
    """``(kind, iterator)``: the tf.data or grain iterator ``dataset`` reads, else ``(None, None)``."""
    source = getattr(getattr(dataset, "_plan", None), "source", None)
    tf, grain = sys.modules.get("tensorflow"), sys.modules.get("grain")
    if source is not None and tf is not None and isinstance(source.dataset, tf.data.Iterator):
        return "tf.data", source.dataset
    if (source is not None and grain is not None
            and isinstance(source.dataset, grain.DatasetIterator)):
        return "grain", source.dataset
    return None, None


def _own_state(dataset, kind, iterator, read_early):
    """The tf.data or grain iterator's own state, where it is at the handed-out position."""
    if dataset.options.experimental_per_replica_buffer_size != 0 or read_early:
        raise errors.InvalidArgumentError(
            f"the {kind} iterator this distributed dataset reads is ahead of the batches handed "
            "out (read ahead by the prefetch, or by element_spec before the first step): its "
            "state would skip them. Make the distributed dataset with jdist.InputOptions("
            "experimental_per_replica_buffer_size=0), and save after a step.")
    if kind == "grain":
        return {"format": _FORMAT, "grain": iterator.get_state()}
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    with tempfile.TemporaryDirectory() as folder:
        tf.train.Checkpoint(iterator=iterator).write(os.path.join(folder, "iterator"))
        files = {}
        for name in sorted(os.listdir(folder)):
            with open(os.path.join(folder, name), "rb") as f:
                files[name] = base64.b64encode(f.read()).decode("ascii")
    return {"format": _FORMAT, "tf.data": files}


def _restore_own_state(dataset, kind, iterator, state):
    """Puts ``iterator`` (unread) at the saved position; returns an iterator over it."""
    if kind == "grain":
        iterator.set_state(state)
    else:
        import tensorflow as tf  # pylint: disable=import-outside-toplevel
        with tempfile.TemporaryDirectory() as folder:
            for name, text in state.items():
                with open(os.path.join(folder, os.path.basename(name)), "wb") as f:
                    f.write(base64.b64decode(text))
            tf.train.Checkpoint(iterator=iterator).read(
                os.path.join(folder, "iterator")).assert_consumed()
    return dataset._iterator_at(Position(dataset))  # pylint: disable=protected-access


class Position:
    """Where a `DistributedIterator` is: the seed state it started from, and the global batches
    handed out since (from ``batches``, a restore's)."""

    def __init__(self, dataset: Any, batches: int = 0):
        self.dataset = dataset
        numpy = _numpy_source(dataset)
        self._seeds = None if numpy is None else [s.state() for s in numpy.iteration_seeds]
        self._batches = batches

    def advance(self, count: int = 1) -> None:
        """Counts ``count`` more global batches handed out (-1: one handed back)."""
        self._batches += count

    def state(self) -> dict:
        """The position as JSON (`iterator_state`)."""
        numpy, (kind, iterator) = _numpy_source(self.dataset), _own_state_iterator(self.dataset)
        if iterator is not None:
            # pylint: disable-next=protected-access
            early = self._batches == 0 and self.dataset._spec_known
            return _own_state(self.dataset, kind, iterator, early)
        if numpy is None:
            raise _unpositionable(_described(self.dataset))
        return {"format": _FORMAT, "pipeline": numpy.describe(), "seeds": self._seeds,
                "batches": self._batches}


def _described(dataset):
    plan = getattr(dataset, "_plan", None)
    if plan is None:
        return f"a {type(dataset).__name__}"
    if not hasattr(plan, "source"):
        return "per-worker or per-replica pipelines (distribute_datasets_from_function)"
    return f"a {type(plan.source.dataset).__name__}"


def iterator_state(iterator: Any) -> dict:
    """The position of ``iterator`` as JSON, for `iterator_from_state`.

    Args:
      iterator: a `DistributedIterator` of a numpy dataset, or of an unbuffered tf.data or
        grain iterator.

    Returns:
      ``{"format", "pipeline", "seeds", "batches"}`` (each shuffle's ``[seed, seed2,
      iterators made]``); for tf.data or grain, ``{"format", "tf.data" | "grain"}``.

    Raises:
      InvalidArgumentError: ``iterator`` cannot be positioned, naming what to use instead.

    Example:
      >>> import numpy as np, jdist
      >>> s = jdist.MirroredStrategy(["cpu:0", "cpu:1"])
      >>> it = iter(s.experimental_distribute_dataset(
      ...     s.experimental_make_numpy_dataset(np.arange(8)).shuffle(8, seed=1).batch(4)))
      >>> _ = next(it)
      >>> iterator_state(it)["batches"], iterator_state(it)["seeds"]
      (1, [[87654321, 1, 0]])
    """
    position = getattr(iterator, "_position", None)
    if position is None:
        raise _unpositionable(f"a {type(iterator).__name__}")
    return position.state()


def iterator_from_state(dataset: Any, state: dict) -> Any:
    """A `DistributedIterator` over ``dataset`` at the position ``state`` (`iterator_state`), on
    any replica count; later epochs get the shuffle orders they would have had.

    Args:
      dataset: a `DistributedDataset` of the same pipeline (same rows and ops).
      state: what `iterator_state` returned.

    Returns:
      A `DistributedIterator` whose next element is the saved iterator's next one.

    Raises:
      InvalidArgumentError: ``dataset`` cannot be positioned, or its pipeline is not the one
        the state was saved from.

    Example:
      >>> import numpy as np, jdist
      >>> s = jdist.MirroredStrategy(["cpu:0", "cpu:1"])
      >>> make = lambda s: s.experimental_distribute_dataset(
      ...     s.experimental_make_numpy_dataset(np.arange(8)).shuffle(8, seed=1).batch(4))
      >>> it = iter(make(s))
      >>> _ = next(it)
      >>> saved = iterator_state(it)
      >>> three = jdist.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])
      >>> resumed = iterator_from_state(make(three), saved)
      >>> s.gather(next(it), axis=0).tolist() == three.gather(next(resumed), axis=0).tolist()
      True
    """
    numpy, (kind, iterator) = _numpy_source(dataset), _own_state_iterator(dataset)
    if iterator is not None and kind in state:
        return _restore_own_state(dataset, kind, iterator, state[kind])
    if numpy is None and iterator is None:
        raise _unpositionable(_described(dataset))
    this = f"a {kind} iterator" if numpy is None else numpy.describe()
    if state.get("format") != _FORMAT or state.get("pipeline") != this:
        saved = state.get("pipeline") or " or ".join(k for k in ("tf.data", "grain") if k in state)
        raise errors.InvalidArgumentError(
            f"the saved iterator read {saved}, this dataset {this} (for a numpy pipeline: rows, "
            "then each op): restore into a dataset made as the saved one was.")
    seeds = numpy.iteration_seeds
    for seed, saved in zip(seeds, state["seeds"]):
        seed.restore(saved)
    position = Position(dataset, int(state["batches"]))
    skipped = dataset._strategy.experimental_distribute_dataset(  # pylint: disable=protected-access
        numpy.skip(int(state["batches"])), dataset.options)
    return skipped._iterator_at(position)  # pylint: disable=protected-access
