"""The CPU dispatch guard: never two collective programs in flight on the CPU runtime.

JAX's CPU runtime (jax 0.10) can deadlock when a program containing collectives is dispatched
while the previous one is still running on some simulated devices: the all-reduce rendezvous
waits for threads that are busy with the other program, and XLA aborts the process after 40 s
(``../shared/notes/cpu_simulated_devices.md``). Waiting for the previous collective program's
outputs before dispatching the next one removes the hang and costs nothing measurable there,
since the simulated devices share the host's cores anyway.

On GPU and TPU the guard is off, so dispatch stays asynchronous.
"""

import threading

import jax


class DispatchGuard:
    """Serialises collective programs on one platform: call `dispatch` around each launch."""

    def __init__(self, enabled):
        self.enabled = enabled
        self._lock = threading.Lock()
        self._in_flight = ()

    def dispatch(self, program, *args):
        """Runs ``program(*args)`` after the previous guarded program has finished."""
        if not self.enabled:
            return program(*args)
        with self._lock:
            _wait(self._in_flight)
            outputs = program(*args)
            self._in_flight = jax.tree_util.tree_leaves(outputs)
            return outputs

    def wait(self):
        """Blocks until the last guarded program has finished (used before host-side reads)."""
        with self._lock:
            _wait(self._in_flight)
            self._in_flight = ()


def _wait(arrays):
    for array in arrays:
        try:
            array.block_until_ready()
        except RuntimeError:
            pass  # Deleted (donated to a later program): that program ran after it.


_guards = {}
_guards_lock = threading.Lock()


def guard_for(platform, num_devices):
    """Returns the process-wide guard for ``platform`` (enabled on CPU with several devices)."""
    enabled = platform == "cpu" and num_devices > 1
    with _guards_lock:
        key = (platform, enabled)
        if key not in _guards:
            _guards[key] = DispatchGuard(enabled)
        return _guards[key]
