"""Saving a checkpoint when the job is told to stop (``tf.distribute.experimental``'s
``PreemptionCheckpointHandler`` and ``TerminationConfig``, issue 48).

A scheduler that preempts a job sends SIGTERM and kills it a grace period later. The handler
turns the signal into a flag; at the next step boundary (the next `PreemptionCheckpointHandler.run`
or `save_checkpoint_if_preempted`) it saves one checkpoint, the state and the data iterator's
position, through the `CheckpointManager`, waits for the write, and exits with a code the
launcher or scheduler reads as "restart me". The signal handler itself only sets the flag: a
save from inside it could run mid-step, with the state half updated.

Under ``MultiWorkerMirroredStrategy`` the signal reaches one worker, and every worker must stop
at the same step. Every ``check_every`` step boundaries each worker adds one tiny collective
program to its stream: the maximum over every replica of the workers' flags
(``MultiWorkerExtended._any_worker``), read back on the host. It cannot deadlock: it waits on
nothing but a collective, which every worker launches at the same point of the same sequence of
programs (the same count of boundaries), however many steps apart their Python loops are; no
worker blocks on the coordination service's key-value store, which a peer still steps behind
would never answer in time. A worker that dies instead is the watchdog's (`watchdog`). Every
worker reads the same maximum, so all save (the chief writes) and exit at the same boundary.
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
      termination_watcher_fn: a function of no arguments returning True once the job is to
        stop, asked at every step boundary (a platform's maintenance notice); signals are
        watched besides.
      exit_fn: called after the checkpoint is saved, instead of ``sys.exit(exit_code)``.
      grace_period: seconds the platform leaves between the signal and the kill; the handler
        saves at the next step boundary, which must come within it (kept for TF's interface).
      save_fn: called instead of the handler's save (it then saves nothing itself).
      exit_code: the exit status without ``exit_fn`` (jdist's addition; TF's is 42).
      signals: the signals that mean "stop" (jdist's addition): SIGTERM by default.
      check_every: with several workers, how many step boundaries apart they agree on whether
        to stop (jdist's addition): a signal is acted on at the next multiple, so
        ``check_every`` steps must fit in the grace period. Each agreement is one collective
        of a scalar read back on the host: 0.35-0.45 ms on 2 CPU workers over loopback, as
        much as a tiny step's own all-reduce. Default 1 on CPU, where the dispatch guard
        waits for every step anyway; 10 elsewhere, where a read back stalls the
        asynchronous dispatch.

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
    """How the workers agree to stop, and how many boundaries apart: ``(None, 1)`` on one
    process, where this process's flag decides alone.

    Raises:
      InvalidArgumentError: several processes, but a strategy that does not span them.
    """
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


def _first_iterator(args, kwargs):
    """The first argument with a position (a `DistributedIterator`), or None."""
    return next((v for v in (*args, *kwargs.values()) if isinstance(v, DistributedIterator)),
                None)


class PreemptionCheckpointHandler:
    """Saves one checkpoint and exits when the process is told to stop
    (``tf.distribute.experimental.PreemptionCheckpointHandler``).

    From construction on, the configured signals (SIGTERM by default) set a flag instead of
    ending the process. At the next step boundary the handler saves the state and the data
    iterator's position as checkpoint `total_run_calls` and exits with the configured code; a
    restarted program restores them with ``manager.restore(state, iterator=dist_dataset)``
    and continues at that step. jdist's state is values, not variables, so the handler takes
    what to save from the step's arguments: `run` saves its function's first argument (the
    state before the step) and the position of a `DistributedIterator` argument.

    Under ``MultiWorkerMirroredStrategy`` a signal to any one worker stops every worker at the
    same boundary (every ``termination_config.check_every``-th; see the module doc): the chief
    writes the checkpoint (``should_checkpoint``), and every worker exits with the code.
    Every worker must make the same sequence of `run` and `save_checkpoint_if_preempted` calls.

    Args:
      cluster_resolver: kept for TF's interface (None is fine): the manager's strategy's
        cluster is used.
      checkpoint_or_checkpoint_manager: a `jdist.checkpoint.CheckpointManager`.
      checkpoint_dir: kept for TF's interface; the manager's directory is used.
      termination_config: a `TerminationConfig`; default: SIGTERM, exit code 42.

    Raises:
      InvalidArgumentError: not a `CheckpointManager`, or several processes under a strategy
        that does not span them.

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
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in self._config.signals}

    def _on_signal(self, signum, frame):
        del signum, frame
        self._signalled.set()

    @property
    def total_run_calls(self) -> int:
        """The number of `run` calls, counting those before the restart (the latest
        checkpoint's step when the handler was made)."""
        return self._total_run_calls

    def _preempted(self) -> bool:
        """Whether to save and exit at this boundary: this process was told to stop, or, with
        several workers, any of them was (asked every ``check_every`` boundaries only)."""
        due, self._boundaries = self._boundaries % self._every == 0, self._boundaries + 1
        if not due:
            return False
        watcher = self._config.termination_watcher_fn
        told = self._signalled.is_set() or bool(watcher is not None and watcher())
        return told if self._any_worker is None else self._any_worker(told)

    def run(self, distributed_train_function: Callable, *args, **kwargs) -> Any:
        """``distributed_train_function(*args, **kwargs)``, after saving and exiting if the
        process was told to stop (TF's order: the check comes before the step).

        Args:
          distributed_train_function: one training step; its first argument is the state.
          *args: its arguments; ``args[0]`` is saved, with the position of the first
            `DistributedIterator` among them (if any).
          **kwargs: its keyword arguments.

        Returns:
          The function's result.
        """
        self.save_checkpoint_if_preempted(args[0] if args else None,
                                          iterator=_first_iterator(args, kwargs))
        result = distributed_train_function(*args, **kwargs)
        self._total_run_calls += 1
        return result

    def save_checkpoint_if_preempted(self, state: Any, iterator: Optional[Any] = None) -> None:
        """At a step boundary: if the process was told to stop, saves ``state`` and the
        position of ``iterator`` as checkpoint `total_run_calls`, waits for the write and exits.

        Args:
          state: the training state now (after `total_run_calls` steps).
          iterator: the `DistributedIterator` the steps read, or None.
        """
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
        """A scope for the training loop (TF's); the handler watches from construction to
        `close`, so the scope only closes it on the way out."""
        try:
            yield
        finally:
            self.close()

    def close(self) -> None:
        """Gives the signals back their previous handlers."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
