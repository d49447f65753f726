"""Saving a checkpoint when the job is told to stop (TF's ``PreemptionCheckpointHandler`` and
``TerminationConfig``).

The signal handler only sets a flag: a save from inside it could run mid-step, with the state
half updated. At the next step boundary the handler saves the state and iterator position,
waits for the write and exits with a "restart me" code. With several workers, every
``check_every`` boundaries each adds one tiny collective (the maximum of the workers' flags,
``MultiWorkerExtended._any_worker``): every worker launches it at the same point of the same
program sequence, so it cannot deadlock, and all stop at the same boundary. No worker waits on
the coordination service's key-value store, which a peer steps behind would not answer in time.
"""

import contextlib
import signal
import sys
import threading
from typing import Any, Callable, Iterator, Optional, Sequence

import jax

from jdist._src import errors
from jdist._src.training.checkpoint import CheckpointManager
from jdist._src.input.datasets import DistributedIterator

RESTARTABLE_EXIT_CODE = 42  # TF's (failure_handling._RESTARTABLE_EXIT_CODE).


class TerminationConfig:
    """How a `PreemptionCheckpointHandler` learns of a termination and how it exits
    (``tf.distribute.experimental.TerminationConfig``).

    Args:
      termination_watcher_fn: returns True once the job is to stop (asked at every boundary).
      exit_fn: called instead of ``sys.exit(exit_code)``.
      save_fn: called instead of the handler's save.
      grace_period: kept for TF's interface (the next boundary must come within it).
      exit_code: jdist's: the exit status (TF's: 42).
      signals: jdist's: the signals meaning "stop".
      check_every: with several workers, how many boundaries apart they agree on stopping
        (jdist's; each agreement is a collective read back on the host). Default 1 on CPU,
        where the dispatch guard waits for every step anyway; 10 elsewhere.

    Example:
      >>> import signal
      >>> TerminationConfig(exit_code=75, signals=(signal.SIGTERM, signal.SIGINT)).exit_code
      75
    """

    def __init__(self, termination_watcher_fn: Optional[Callable[[], bool]] = None,
                 exit_fn: Optional[Callable[[], Any]] = None,
                 grace_period: Optional[float] = None,
                 save_fn: Optional[Callable[[], Any]] = None,
                 exit_code: int = RESTARTABLE_EXIT_CODE,
                 signals: Sequence[int] = (signal.SIGTERM,),
                 check_every: Optional[int] = None):
        self.termination_watcher_fn = termination_watcher_fn
        self.exit_fn = exit_fn
        self.grace_period = 0 if grace_period is None else grace_period
        self.save_fn = save_fn
        self.exit_code = int(exit_code)
        self.signals = tuple(signals)
        self.check_every = None if check_every is None else int(check_every)


def _agreement(strategy, check_every):
    """``(any_worker, every)``: how and how often workers agree to stop; ``(None, 1)`` alone."""
    extended = strategy.extended
    if getattr(extended, "num_workers", 1) > 1:
        default = 1 if extended._guard.enabled else 10  # pylint: disable=protected-access
        return extended._any_worker, max(1, check_every or default)  # pylint: disable=protected-access
    if jax.process_count() > 1:
        raise errors.InvalidArgumentError(
            "PreemptionCheckpointHandler runs on several processes only under a "
            "MultiWorkerMirroredStrategy spanning them (its workers agree on the step to stop "
            f"at); the checkpoint manager's strategy is a {type(strategy).__name__}.")
    return None, 1


class PreemptionCheckpointHandler:
    """Saves one checkpoint and exits when the process is told to stop
    (``tf.distribute.experimental.PreemptionCheckpointHandler``).

    From construction on, the configured signals set a flag. At the next step boundary the
    handler saves checkpoint `total_run_calls` and exits. jdist's state is values, not
    variables, so `run` saves its function's first argument (the state before the step) and
    the position of a `DistributedIterator` argument. Under ``MultiWorkerMirroredStrategy`` a
    signal to any worker stops all at the same boundary; every worker must make the same
    sequence of `run` and `save_checkpoint_if_preempted` calls.

    Args:
      cluster_resolver: kept for TF's interface (the manager's is used).
      checkpoint_dir: kept for TF's interface (the manager's is used).
      checkpoint_or_checkpoint_manager: a `jdist.checkpoint.CheckpointManager`.
      termination_config: a `TerminationConfig`; default: SIGTERM, exit code 42.

    Example:
      >>> import os, signal, tempfile, numpy as np, jdist
      >>> s = jdist.MirroredStrategy(["cpu:0", "cpu:1"])
      >>> manager = jdist.checkpoint.CheckpointManager(tempfile.mkdtemp(), s)
      >>> handler = PreemptionCheckpointHandler(None, manager, termination_config=
      ...     TerminationConfig(exit_fn=lambda: print("exit"), exit_code=75))
      >>> it = iter(s.experimental_distribute_dataset(
      ...     s.experimental_make_numpy_dataset(np.arange(8.0, dtype=np.float32)).batch(2)))
      >>> step = lambda w, it: w + s.reduce("sum", s.run(lambda x: x.sum(), args=(next(it),)),
      ...                                   axis=None)
      >>> w = handler.run(step, np.float32(0), it)  # 0 + 1
      >>> os.kill(os.getpid(), signal.SIGTERM)  # Only flagged: the step boundary saves.
      >>> w = handler.run(step, w, it)  # Saves w = 1 and the iterator, "exits", steps on.
      exit
      >>> manager.latest_step, handler.total_run_calls, float(w)
      (1, 2, 6.0)
      >>> handler.close(); manager.close()
    """

    def __init__(self, cluster_resolver: Any, checkpoint_or_checkpoint_manager: Any,
                 checkpoint_dir: Optional[str] = None,
                 termination_config: Optional[TerminationConfig] = None):
        del cluster_resolver, checkpoint_dir  # The manager's strategy knows its workers.
        manager = checkpoint_or_checkpoint_manager
        if not isinstance(manager, CheckpointManager):
            raise errors.InvalidArgumentError(
                "PreemptionCheckpointHandler saves through a jdist.checkpoint.CheckpointManager; "
                f"got a {type(manager).__name__}.")
        self._manager = manager
        self._config = termination_config or TerminationConfig()
        self._any_worker, self._every = _agreement(manager.strategy, self._config.check_every)
        self._boundaries = 0
        self._total_run_calls = manager.latest_step or 0
        self._signalled = threading.Event()
        self._previous = {sig: signal.signal(sig, lambda *_: self._signalled.set())
                          for sig in self._config.signals}

    @property
    def total_run_calls(self) -> int:
        """The number of `run` calls, counting those before the restart."""
        return self._total_run_calls

    def _preempted(self) -> bool:
        """Whether this process, or with several workers any of them, was told to stop."""
        due, self._boundaries = self._boundaries % self._every == 0, self._boundaries + 1
        if not due:
            return False
        watcher = self._config.termination_watcher_fn
        told = self._signalled.is_set() or bool(watcher is not None and watcher())
        return told if self._any_worker is None else self._any_worker(told)

    def run(self, distributed_train_function: Callable, *args: Any, **kwargs: Any) -> Any:
        """``distributed_train_function(*args, **kwargs)``, after saving ``args[0]`` (and the
        first `DistributedIterator` argument's position) and exiting if told to stop."""
        iterator = next((v for v in (*args, *kwargs.values())
                         if isinstance(v, DistributedIterator)), None)
        self.save_checkpoint_if_preempted(args[0] if args else None, iterator=iterator)
        result = distributed_train_function(*args, **kwargs)
        self._total_run_calls += 1
        return result

    def save_checkpoint_if_preempted(self, state: Any, iterator: Optional[Any] = None) -> None:
        """At a step boundary: if told to stop, saves ``state`` and ``iterator``'s position as
        checkpoint `total_run_calls`, waits for the write and exits."""
        if not self._preempted():
            return
        if self._config.save_fn is not None:
            self._config.save_fn()
        else:
            self._manager.save(self._total_run_calls, state, iterator=iterator)
            self._manager.wait_until_finished()
        self._signalled.clear()  # Handled: an exit_fn that returns goes on training.
        if self._config.exit_fn is not None:
            self._config.exit_fn()
            return
        self.close()
        sys.exit(self._config.exit_code)

    @contextlib.contextmanager
    def watch_preemption_scope(self) -> Iterator[None]:
        """A scope for the training loop (TF's): it closes the handler on the way out."""
        try:
            yield
        finally:
            self.close()

    def close(self) -> None:
        """Gives the signals back their previous handlers."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
