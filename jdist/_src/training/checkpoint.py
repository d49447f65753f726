"""Checkpoints of Mirrored training state with orbax-checkpoint (the ``checkpoint`` extra).

What is saved is the host value (`to_host`), so state saved from N replicas restores into M.
Orbax finalises each step atomically (a writer killed mid-save leaves the last complete one),
and a JSON ``spec`` of every leaf beside the state is checked before a restore reads anything:
orbax would silently cast to the target's dtype. The iterator's position goes into the same
JSON (`iterator_state`). Only the chief writes, with no collective, so the others skip it
without blocking; they wait for it while it is alive (`watchdog.busy`).
"""

import os
from typing import Any, Optional

import jax
import numpy as np

from jdist._src import context
from jdist._src import errors
from jdist._src import extras
from jdist._src.input import iterator_state
from jdist._src.training import progress
from jdist._src.training import state as state_lib
from jdist._src.multi_worker import watchdog
from jdist._src.values import DistributedValues
from jdist._src.values import Mirrored
from jdist._src.values import is_distributed

_FORMAT = 1


def _orbax():
    return extras.require("orbax.checkpoint", "checkpoint")


def _leaf_spec(leaf):
    if isinstance(leaf, Mirrored):
        leaf = leaf.value
    elif isinstance(leaf, DistributedValues):
        raise errors.UnsupportedValueError(
            f"a checkpoint holds one value per leaf; got a {type(leaf).__name__} leaf. Reduce or "
            "gather it first.")
    if not hasattr(leaf, "shape"):
        leaf = np.asarray(leaf)
    return [list(leaf.shape), np.dtype(leaf.dtype).name]


def tree_spec(tree: Any) -> list:
    """Every leaf's ``[key path, shape, dtype name]`` (JSON), in flattening order."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_distributed)[0]
    return [[jax.tree_util.keystr(path)] + _leaf_spec(leaf) for path, leaf in leaves]


def _check_spec(saved, target, step):
    """Raises unless ``target``'s leaves have the saved paths, shapes and dtypes."""
    saved_paths, target_paths = [p for p, _, _ in saved], [p for p, _, _ in target]
    if saved_paths != target_paths:
        missing = sorted(set(saved_paths) - set(target_paths))
        extra = sorted(set(target_paths) - set(saved_paths))
        raise errors.InvalidArgumentError(
            f"checkpoint step {step} does not match the restore target's structure: only in the "
            f"checkpoint {missing or 'none'}, only in the target {extra or 'none'}.")
    for (path, shape, dtype), (_, want_shape, want_dtype) in zip(saved, target):
        if shape != want_shape:
            raise errors.ShapeMismatchError(
                f"checkpoint step {step}: {path} has shape {tuple(shape)}, the target "
                f"{tuple(want_shape)}.")
        if dtype != want_dtype:
            raise errors.InvalidArgumentError(
                f"checkpoint step {step}: {path} has dtype {dtype}, the target {want_dtype}; "
                "jdist does not cast on restore.")


class CheckpointManager:
    """Saves and restores a strategy's Mirrored state in ``directory`` (``tf.train.CheckpointManager``).

    ``directory`` (created if missing) holds the numbered checkpoints, ``max_to_keep`` of the
    newest (None: all); ``strategy`` (default: the current one) is restored into.

    Example:
      >>> import tempfile, numpy as np, jdist
      >>> s = jdist.MirroredStrategy(["cpu:0", "cpu:1"])
      >>> state = jdist.mirror({"w": np.arange(3.0, dtype=np.float32)}, s)
      >>> with jdist.checkpoint.CheckpointManager(tempfile.mkdtemp(), s) as manager:
      ...   manager.save(1, state)
      ...   manager.wait_until_finished()
      ...   restored = manager.restore(state)
      True
      >>> manager.latest_step, restored["w"].num_replicas, jdist.to_host(restored)["w"].tolist()
      (1, 2, [0.0, 1.0, 2.0])
    """

    def __init__(self, directory: "str | os.PathLike", strategy: Optional[Any] = None,
                 max_to_keep: Optional[int] = 3):
        ocp = _orbax()
        self._strategy = context.get_strategy() if strategy is None else strategy
        self._directory = os.path.abspath(os.fspath(directory))
        process = jax.process_index()  # The only writer: orbax must not wait at a barrier.
        os.makedirs(self._directory, exist_ok=True)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=False,
            multiprocessing_options=ocp.options.MultiprocessingOptions(
                primary_host=process, active_processes={process}))
        self._manager = ocp.CheckpointManager(self._directory, options=options)

    @property
    def directory(self) -> str:
        """The absolute path of the checkpoint directory."""
        return self._directory

    @property
    def strategy(self) -> Any:
        """The strategy whose state this manager saves and restores into."""
        return self._strategy

    @property
    def latest_step(self) -> Optional[int]:
        """The newest complete checkpoint's step, or None if there is none."""
        return self._manager.latest_step()

    def all_steps(self) -> list:
        """The steps of every complete checkpoint kept, oldest first."""
        return sorted(self._manager.all_steps())

    @property
    def should_checkpoint(self) -> bool:
        """Whether this process writes: ``strategy.extended.should_checkpoint``, default True."""
        return progress.is_chief(self._strategy)

    def save(self, step: int, state: Any, iterator: Optional[Any] = None) -> bool:
        """Starts writing ``state`` (`Mirrored` values, arrays or scalars; `PerReplica` raises)
        as checkpoint ``step`` (larger than every saved one) in the background, with the
        position of ``iterator``, a `DistributedIterator`. Host copies are taken first, so the
        next step may overwrite the state. Returns whether this process (the chief) wrote."""
        position = None if iterator is None else iterator_state.iterator_state(iterator)
        if not self.should_checkpoint:
            return False
        ocp = _orbax()
        host = state_lib.to_host(state)
        spec = {"format": _FORMAT, "leaves": tree_spec(host),
                "num_replicas": self._strategy.num_replicas_in_sync, "iterator": position}
        with watchdog.busy():
            return bool(self._manager.save(int(step), args=ocp.args.Composite(
                state=ocp.args.StandardSave(host), spec=ocp.args.JsonSave(spec))))

    def restore(self, target: Any, step: Optional[int] = None,
                iterator: Optional[Any] = None) -> Any:
        """Reads checkpoint ``step`` (default: the latest) as Mirrored state of the strategy.

        ``target`` has the state's structure, shapes and dtypes (or is its ``jax.eval_shape``);
        a difference raises, as does a missing step. Returns ``target``'s structure with
        `Mirrored` leaves; given ``iterator``, the `DistributedDataset` whose iterator `save`
        was given (any replica count), ``(state, distributed_iterator)`` positioned as saved.
        """
        ocp = _orbax()
        step = self.latest_step if step is None else int(step)
        if step is None or step not in self._manager.all_steps():
            raise errors.InvalidArgumentError(
                f"no checkpoint {'at all' if step is None else f'for step {step}'} in "
                f"{self._directory}; saved steps: {self.all_steps()}.")
        saved = self._manager.restore(step, args=ocp.args.Composite(spec=ocp.args.JsonRestore()))
        _check_spec(saved["spec"]["leaves"], tree_spec(target), step)
        sharding = state_lib.replicated_sharding(self._strategy)
        abstract = jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(*_leaf_spec(x), sharding=sharding), target,
            is_leaf=is_distributed)
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract)))
        state = state_lib.mirror(restored["state"], self._strategy)
        if iterator is None:
            return state
        position = saved["spec"].get("iterator")
        if position is None:
            raise errors.InvalidArgumentError(
                f"checkpoint step {step} holds no iterator position: save it with "
                "manager.save(step, state, iterator=iterator), or restore without iterator=.")
        return state, iterator_state.iterator_from_state(iterator, position)

    def wait_until_finished(self) -> None:
        """Blocks until every write this manager started is complete."""
        with watchdog.busy():
            self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending writes and stops orbax's background threads."""
        with watchdog.busy():
            self._manager.close()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
