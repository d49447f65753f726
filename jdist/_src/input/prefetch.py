"""The background feeder: prepares a distributed dataset's batches ahead of the step.

A `Prefetcher` runs one worker thread (``jdist-prefetch-<n>``) that reads the source, splits and
transfers each element into a bounded queue, so host loading overlaps the step. No thread is
left behind: the worker is non-daemon and always joined (by `Prefetcher.close`, which the
iterator calls at the end of its data, on ``close`` and from ``weakref.finalize``), never holds
the iterator, and is closed at interpreter exit before Python joins non-daemon threads. An
exception in the worker is raised by the consumer's next ``get``; the data then counts as ended.
"""

import itertools
import queue
import threading
import weakref

import jax

END = object()  # Put by the worker after the last element.
_POLL_S = 0.05  # How often a blocked worker or consumer re-checks whether it should stop.
_names = itertools.count()
_live: "weakref.WeakSet[Prefetcher]" = weakref.WeakSet()
_live_lock = threading.Lock()


class _Raised:
    """An exception raised in the worker, carried to the consumer."""
    __slots__ = ("exc",)

    def __init__(self, exc):
        self.exc = exc


class Prefetcher:
    """Produces ``transform(item)`` for each item of ``source`` on a worker thread, at most
    ``buffer_size`` waiting; ``on_close(source)`` runs once the worker has stopped."""

    def __init__(self, source, transform, buffer_size=1, on_close=None):
        self._queue = queue.Queue(maxsize=max(1, int(buffer_size)))
        self._stop = threading.Event()
        self._source = source
        self._on_close = on_close
        self._closed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(
            target=_work, args=(source, transform, self._queue, self._stop,
                                jax.config.jax_enable_x64),
            name=f"jdist-prefetch-{next(_names)}", daemon=False)
        with _live_lock:
            _live.add(self)
        self._thread.start()

    @property
    def thread(self):
        """The worker thread (for tests and diagnostics)."""
        return self._thread

    def get(self):
        """The next finished element, `END` after the last one; re-raises worker exceptions."""
        while True:
            try:
                item = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if self._thread.is_alive() or not self._queue.empty():
                    continue
                return END  # Stopped without a word (closed from another thread).
            if isinstance(item, _Raised):
                exc, item.exc = item.exc, None
                raise exc
            return item

    def close(self):
        """Stops the worker, joins it and releases the source. Safe to call more than once."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        if threading.current_thread() is self._thread:
            return  # Collected on the worker itself: it sees the stop flag and exits on its own.
        while self._thread.is_alive():
            _drain(self._queue)  # Unblocks a worker waiting to put.
            self._thread.join(_POLL_S)
        _drain(self._queue)
        with _live_lock:
            _live.discard(self)
        source, self._source = self._source, None
        if self._on_close is not None and source is not None:
            self._on_close(source)


def _work(source, transform, out, stop, x64):
    # JAX's 64-bit mode may be a thread's own (`jax.enable_x64()`): place as the consumer would.
    try:
        with jax.enable_x64(x64):
            _feed(source, transform, out, stop)
    except BaseException as exc:  # Forwarded to the consumer, whatever it is.
        _put(out, _Raised(exc), stop)


def _feed(source, transform, out, stop):
    while not stop.is_set():
        try:
            item = next(source)
        except StopIteration:
            _put(out, END, stop)
            return
        element = transform(item)
        del item
        if not _put(out, element, stop):
            return
        del element


def _put(out, item, stop):
    """Puts ``item`` unless asked to stop first; returns whether it was put."""
    while not stop.is_set():
        try:
            out.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _drain(q):
    while True:
        try:
            q.get_nowait()
        except queue.Empty:
            return


def live_threads():
    """The worker threads of prefetchers that are still running (for tests)."""
    return [t for t in threading.enumerate() if t.name.startswith("jdist-prefetch-")]


def _close_all():
    with _live_lock:
        prefetchers = list(_live)
    for p in prefetchers:
        p.close()


try:  # CPython's hook run before non-daemon threads are joined at exit (no public one).
    threading._register_atexit(_close_all)  # type: ignore[attr-defined]
except (AttributeError, RuntimeError):  # pragma: no cover - other Pythons / late import.
    import atexit
    atexit.register(_close_all)
