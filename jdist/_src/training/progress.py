"""Progress and logging on the chief only: a tqdm bar over a distributed dataset, print/log helpers.

Every worker runs the same loop, so only the chief prints (``should_checkpoint``). Nothing here
communicates (values are read from this process's copy; `PerReplica`, which would need a
reduce, is refused on every process alike): no collective ends up in a chief-only branch.
Inside ``strategy.run`` they print through ``jax.debug.callback`` from replica 0 only.
"""

import io
import logging
import sys
import time
from typing import Any, Iterable, Iterator, Optional, TextIO

import jax
import numpy as np

from jdist._src import context
from jdist._src import errors
from jdist._src import extras
from jdist._src.training import state as state_lib
from jdist._src.values import DistributedValues
from jdist._src.values import Mirrored

COMPILE_NOTICE = "jdist: compiling the first step (once per input shape)..."
PLAIN_LINES = 10  # Off a terminal: one line per tenth of the steps (and the last step).
PLAIN_SECONDS = 30.0  # Off a terminal, the number of steps unknown: one line per 30 s.


def is_chief(strategy: Optional[Any] = None) -> bool:
    """Whether this process prints and writes checkpoints: ``strategy.extended.should_checkpoint``
    (``strategy`` default: the current one; see `print_once`'s example)."""
    strategy = context.get_strategy() if strategy is None else strategy
    return bool(strategy.extended.should_checkpoint)


def _host_value(value):
    """A printable host value; refuses PerReplica (combining it would need a collective)."""
    if isinstance(value, DistributedValues) and not isinstance(value, Mirrored):
        raise errors.UnsupportedValueError(
            f"cannot print a {type(value).__name__} value: its replicas differ. Reduce it first "
            "(strategy.reduce, on every worker), then print the result.")
    if isinstance(value, (Mirrored, jax.Array)):
        return state_lib.to_host(value)
    return value


def _emit(write, values, strategy):
    """Calls ``write(values)`` once: on the chief, and inside ``run`` from replica 0 only."""
    if context.in_replica_function():
        chief = is_chief(context.get_replica_context().strategy)

        def callback(replica_id, *host_values):
            if chief and int(replica_id) == 0:
                write(host_values)
        replica_id = context.get_replica_context().replica_id_in_sync_group
        jax.debug.callback(callback, replica_id, *values)
        return
    host_values = [_host_value(v) for v in values]  # On every process: the same errors.
    if is_chief(strategy):
        write(host_values)


def print_once(*values: Any, sep: str = " ", file: Optional[TextIO] = None,
               strategy: Optional[Any] = None) -> None:
    """``print(*values, sep=sep, file=file)`` once per step for the whole job: on the chief
    (of ``strategy``, default the current one), from one replica. `Mirrored` values and arrays
    are read from one local copy; a `PerReplica` raises `errors.UnsupportedValueError` (reduce
    it first, on every worker).

    Example:
      >>> import jax.numpy as jnp, jdist
      >>> s = jdist.MirroredStrategy(["cpu:0", "cpu:1"])
      >>> jdist.print_once("loss", s.run(lambda: jnp.float32(0.5)))
      loss 0.5
      >>> jdist.is_chief(s)
      True
    """
    _emit(lambda host_values: print(*host_values, sep=sep, flush=True,
                                    file=sys.stdout if file is None else file), values, strategy)


def log_once(msg: str, *args: Any, level: int = logging.INFO,
             logger: Optional[logging.Logger] = None, strategy: Optional[Any] = None) -> None:
    """``logger.log(level, msg, *args)`` once for the whole job (see `print_once`); ``logger``
    default: ``logging.getLogger("jdist")``."""
    logger = logging.getLogger("jdist") if logger is None else logger
    _emit(lambda host_args: logger.log(level, msg, *host_args), args, strategy)


def _total(dataset):
    try:
        return len(dataset)
    except TypeError:  # cardinality: a property on distributed datasets, else a method.
        count = getattr(dataset, "cardinality", None)
        count = count() if callable(count) else count
        try:
            count = int(count)
        except (TypeError, ValueError):
            return None
        return count if count >= 0 else None


class _Discard(io.TextIOBase):
    """Where tqdm draws when ``file`` is not a terminal: `ProgressBar` prints plain lines."""

    def write(self, text):
        return len(text)


class ProgressBar:
    """A tqdm progress bar over a (distributed) dataset, drawn by the chief only (``progress`` extra).

    Iterating it yields the dataset's elements. It shows steps/s, examples/s and the loss last
    given to `set_loss`, read from the device at most once per ``mininterval`` so the steps do
    not stall. Off a terminal (a log file, CI) it prints plain lines, one per tenth of the steps.

    Args:
      dataset: what to iterate, usually ``strategy.experimental_distribute_dataset(...)``.
      strategy: the strategy deciding who is chief; default: the current one.
      total: the number of steps; default ``len(dataset)`` or its known cardinality.
      examples_per_step: the global batch size, for examples/s.
      file: where to draw (default ``sys.stderr``).
      mininterval: seconds between redraws.
      compile_notice: print `COMPILE_NOTICE` first; False when the step already ran with these
        shapes (a later epoch).

    Example:
      >>> import io, numpy as np, jdist
      >>> out = io.StringIO()
      >>> bar = jdist.ProgressBar([np.ones(4)] * 3, desc="train", file=out, mininterval=0)
      >>> for x in bar:
      ...   bar.set_loss(float(x.sum()))
      >>> bar.close()
      >>> text = out.getvalue()
      >>> text.count(jdist.ProgressBar.COMPILE_NOTICE), "3/3" in text, "loss=4" in text
      (1, True, True)
    """

    #: The line printed before the first step (which compiles) runs.
    COMPILE_NOTICE = COMPILE_NOTICE

    def __init__(self, dataset: Iterable, strategy: Optional[Any] = None,
                 total: Optional[int] = None, desc: Optional[str] = None,
                 examples_per_step: Optional[int] = None, file: Optional[TextIO] = None,
                 mininterval: float = 0.1, compile_notice: bool = True):
        tqdm = extras.require("tqdm", "progress")
        self._dataset = dataset
        self._chief = is_chief(strategy)
        self._examples = examples_per_step
        self._loss, self._last_postfix = None, -float("inf")
        self._mininterval = mininterval
        self._notice = compile_notice and self._chief
        self._file = sys.stderr if file is None else file
        self._plain = self._chief and not (callable(getattr(self._file, "isatty", None))
                                           and self._file.isatty())
        self._line_step, self._line_time = 0, time.monotonic()  # Off a terminal: the last line.
        self._bar = tqdm.tqdm(total=_total(dataset) if total is None else total, desc=desc,
                              unit="step", file=_Discard() if self._plain else self._file,
                              mininterval=mininterval, disable=not self._chief,
                              dynamic_ncols=True, ascii=self._plain or None)

    def set_loss(self, loss: Any) -> None:
        """Records the latest loss (a float, an array or a `Mirrored` value, not `PerReplica`)."""
        if isinstance(loss, DistributedValues) and not isinstance(loss, Mirrored):
            _host_value(loss)
        self._loss = loss

    def _postfix(self, force=False):
        now = time.monotonic()
        if now - self._last_postfix < self._mininterval and not force:
            return
        self._last_postfix = now
        fields = {}
        if self._loss is not None:
            fields["loss"] = f"{float(np.asarray(_host_value(self._loss))):.4g}"
        rate = self._bar.format_dict.get("rate")
        if self._examples and rate:
            fields["examples/s"] = f"{rate * self._examples:.4g}"
        self._bar.set_postfix(fields, refresh=False)

    def _plain_line(self, last):
        """Off a terminal: prints the bar each tenth of the steps (or `PLAIN_SECONDS`), last."""
        n, total, now = self._bar.n, self._bar.total, time.monotonic()
        if n == self._line_step:
            return
        due = n % -(-total // PLAIN_LINES) == 0 if total else now - self._line_time >= PLAIN_SECONDS
        if due or last:
            self._postfix(force=True)
            print(self._bar, file=self._file, flush=True)
            self._line_step, self._line_time = n, now

    def __iter__(self) -> Iterator:
        for i, element in enumerate(self._dataset):
            if i == 0 and self._notice:
                self._bar.write(COMPILE_NOTICE, file=self._file)
            yield element
            if self._chief:
                self._postfix()
            self._bar.update(1)
            if self._plain:
                self._plain_line(last=False)
        if self._plain:
            self._plain_line(last=True)
        elif self._chief:
            self._postfix(force=True)
            self._bar.refresh()

    def close(self) -> None:
        """Draws the final state and releases the bar."""
        self._bar.close()

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
