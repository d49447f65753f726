"""The multi-worker watchdog: a stuck or dead peer ends every worker in bounded time.

JAX gives no error for a peer that never reaches a collective (the others wait forever), and a
dead peer ends them only by a heartbeat SIGABRT. So a thread publishes this worker's heartbeat
and count of launched collective programs, and reads its peers': one behind or silent for
``timeout_seconds`` ends the process with `errors.UnavailableError` printed and
`UNAVAILABLE_EXIT_CODE` (the main thread, blocked in the collective, cannot raise). At exit
(`stop`, before JAX's shutdown barrier) a worker waits for its peers' end, so a failed peer is
reported the same way instead of the barrier aborting. Worker 0, hosting the coordination
service, ends last.
"""

import contextlib
import ctypes
import os
import signal
import socket
import sys
import threading
import time
from typing import Iterator

import jax

from jdist._src import errors
from jdist._src import jax_internals
from jdist._src.multi_worker.runtime import UNAVAILABLE_EXIT_CODE
from jdist._src.multi_worker.runtime import Cluster


class Watchdog:
    """Publishes this worker's progress; ends the process when a peer stays behind or silent
    for ``timeout_seconds`` (module doc)."""

    def __init__(self, cluster: Cluster, timeout_seconds: float):
        self._cluster = cluster
        self._timeout = float(timeout_seconds)
        self._poll = min(1.0, self._timeout / 10)
        self.launched = 0
        self.busy = 0  # How many `busy` scopes this worker is in (published).
        self.failed = False  # The main thread ended with an uncaught exception (`start`).
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="jdist-watchdog", daemon=True)
        # Only worker 0 hosts the coordination service; the others' JAX client aborts the
        # process the moment its connection drops (`_on_abort`).
        self._abort_handler = _ABORT_HANDLER(self._on_abort) if cluster.index else None

    def note_launch(self) -> None:
        """Counts one collective program launched by this worker (called by the guard)."""
        self.launched += 1

    def start(self) -> None:
        """Starts the thread, and notes an uncaught exception that ends the main thread."""
        _STARTED.append(self)
        self._thread.start()
        if self._abort_handler is not None and os.name == "posix":
            libc = ctypes.CDLL(None)
            libc.signal.argtypes = (ctypes.c_int, _ABORT_HANDLER)
            libc.signal(signal.SIGABRT, self._abort_handler)
        hook = sys.excepthook

        def failing(kind, value, traceback):
            # A collective's runtime error is most likely a peer's end, named at exit.
            self.failed = not issubclass(kind, jax.errors.JaxRuntimeError)
            hook(kind, value, traceback)
        sys.excepthook = failing

    def stop(self) -> None:
        """At exit: announces this worker's end and waits for every peer's (or reports one that
        died or stays away). After an uncaught exception it announces a failure and ends the
        process at once: JAX's shutdown barrier would wait in vain for the peers it ends."""
        self._stop.set()
        if self in _STARTED:
            _STARTED.remove(self)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        if self.failed:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)  # Python's status for an uncaught exception.

    def _on_abort(self, signum):  # pylint: disable=unused-argument
        """SIGABRT on a worker other than 0: JAX's client aborts at once when the coordination
        service dies. If the service's port refuses connections, end typed (status 14) instead;
        any other abort goes on."""
        if not _accepts(self._cluster.coordinator):
            self._fail(f"{self._cluster.name(0)}, which hosts the coordination service, has "
                       "died: the job cannot go on without it.")

    def _loop(self):
        client, me, beat = jax_internals.distributed_client(), self._cluster.index, 0
        peers = {w: _Peer() for w in range(self._cluster.num_workers) if w != me}
        exit_since = None
        while True:
            exiting = self._stop.wait(self._poll if exit_since is None else _EXIT_POLL_S)
            beat += 1
            now = time.monotonic()
            exit_since = now if exiting and exit_since is None else exit_since
            if exiting and self.failed:
                self._announce_failure(client, beat)
                return
            try:
                client.key_value_set(f"jdist/watchdog/{me}",
                                     f"{beat} {self.launched} {_ENDED if exiting else 0} "
                                     f"{min(self.busy, 1)}",
                                     allow_overwrite=True)
                states = {w: _try_get(client, f"jdist/watchdog/{w}") for w in peers}
            except Exception as e:  # pylint: disable=broad-except
                self._fail(f"the coordination service is unreachable ({type(e).__name__}): "
                           f"{self._cluster.name(0)}, which hosts it, has died.")
            for w, peer in peers.items():
                problem = peer.update(states[w], self.launched, now, self._timeout)
                if exit_since is not None:
                    problem = self._exit_problem(peer, problem,
                                                 now - max(exit_since, peer.busy_at))
                if problem:
                    self._fail(f"{self._cluster.name(w)} {problem}", client, beat)
            if exit_since is not None and all(peer.done for peer in peers.values()):
                return  # Every peer has ended too: JAX's shutdown barrier will pass.

    def _exit_problem(self, peer, problem, waited):
        """Why a peer keeps this ending worker waiting (JAX's shutdown barrier would abort)."""
        if peer.done == _ENDED:
            return None  # This worker waits in no collective any more.
        if peer.done or problem is not None or waited <= self._timeout:
            return problem
        return (f"did not end within {self._timeout:g} s (CommunicationOptions.timeout_seconds) "
                "of this worker's end.")

    def _announce_failure(self, client, beat):
        try:  # Tell the peers at once that this worker ends with an error.
            client.key_value_set(f"jdist/watchdog/{self._cluster.index}",
                                 f"{beat} {self.launched} {_FAILED} 0", allow_overwrite=True)
            # Let the peers read it before this process's end closes its connections (a peer's
            # collective would fail untyped).
            time.sleep(2 * self._poll)
            if self._cluster.index == 0:
                self._outlive_peers(client)
        except Exception:  # pylint: disable=broad-except
            pass  # The service is gone: the peers find out themselves.

    def _outlive_peers(self, client):
        """Worker 0's end closes the coordination service, aborting peers still running: wait
        until every peer has announced its own failure (a dead one never does: at most a second
        more), then as long as each waits before ending."""
        peers = [f"jdist/watchdog/{w}" for w in range(1, self._cluster.num_workers)]
        deadline = time.monotonic() + self._poll + 1
        while time.monotonic() < deadline and not all(
                _try_get(client, key).endswith(f" {_FAILED}") for key in peers):
            time.sleep(_EXIT_POLL_S)
        time.sleep(2 * self._poll + 0.2)

    def _fail(self, message, client=None, beat=0):
        if client is not None:
            self._announce_failure(client, beat)
        error = errors.UnavailableError(message)
        sys.stdout.flush()
        sys.stderr.write(f"\njdist.errors.UnavailableError: {error}\n")
        sys.stderr.flush()
        os._exit(UNAVAILABLE_EXIT_CODE)


_ABORT_HANDLER = ctypes.CFUNCTYPE(None, ctypes.c_int)
_ENDED, _FAILED = 1, 2  # What a worker publishes as its third field: it ends / it failed.
_EXIT_POLL_S = 0.05
_STARTED: list = []  # The process's started `Watchdog` (one at most: one strategy's runtime).


@contextlib.contextmanager
def busy() -> Iterator[None]:
    """A scope in which this worker's peers wait for it as long as it beats (a checkpoint's
    save). Does nothing without a started watchdog (one worker)."""
    for watchdog in _STARTED:
        watchdog.busy += 1
    try:
        yield
    finally:
        for watchdog in _STARTED:
            watchdog.busy -= 1


def _try_get(client, key):
    """The value at ``key``, ``""`` while the peer has not published it yet."""
    try:
        return client.key_value_try_get(key)
    except Exception as e:  # pylint: disable=broad-except
        if "NOT_FOUND" in str(e) or "not found" in str(e).lower():
            return ""
        raise


def _accepts(address):
    """Whether ``host:port`` accepts a TCP connection within a second."""
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=1).close()
    except OSError:
        return False
    return True


class _Peer:
    """What one peer last published, and since when it has been silent or behind."""

    def __init__(self):
        self.beat, self.launched, self.done = None, 0, 0
        self.beat_since = self.behind_since = time.monotonic()
        self.busy_at = float("-inf")  # When it was last seen `busy`.

    def update(self, text, mine, now, timeout):
        """Returns why the peer blocks this worker (a phrase), or None."""
        beat, launched, done, busy = (*map(int, text.split()), 0)[:4] if text else (None, 0, 0, 0)
        if beat != self.beat:
            self.beat, self.beat_since = beat, now
        if busy:
            self.busy_at = now
        if launched != self.launched or launched >= mine or busy:
            self.behind_since = now
        self.launched, self.done = launched, done
        if done == _FAILED:  # The job cannot go on: any collective would wait for it forever.
            return ("ended with an error (its own output names it); the job cannot go on "
                    "without it.")
        if done:  # A peer that ended blocks this worker only once it waits for it in vain.
            if launched >= mine or now - self.behind_since <= timeout:
                return None
            problem = "ended"
        elif now - self.beat_since > timeout:
            problem = "stopped sending heartbeats (it has died)"
        elif now - self.behind_since > timeout:
            problem = ("did not launch the collective program this worker waits in (it is alive "
                       "but stuck before it)")
        else:
            return None
        return (f"{problem} for {timeout:g} s (CommunicationOptions.timeout_seconds) while this "
                f"worker launched collective program #{mine}.")
