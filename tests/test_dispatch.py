"""The CPU dispatch guard: never two collective programs in flight on the CPU runtime."""

import threading

from jdist._src import dispatch


class _Output:
    """Stands in for a jax.Array: records when it is waited on."""

    def __init__(self, log, name):
        self.log, self.name = log, name

    def block_until_ready(self):
        self.log.append(f"wait {self.name}")
        return self


def test_guard_waits_for_the_previous_program_before_dispatching_the_next():
    log = []
    guard = dispatch.DispatchGuard(enabled=True)

    def program(name):
        log.append(f"dispatch {name}")
        return [_Output(log, name)]
    guard.dispatch(program, "a")
    guard.dispatch(program, "b")
    guard.wait()
    assert log == ["dispatch a", "wait a", "dispatch b", "wait b"]


def test_disabled_guard_never_waits():
    log = []
    guard = dispatch.DispatchGuard(enabled=False)
    for name in "abc":
        guard.dispatch(lambda n: [_Output(log, n)], name)
    assert log == []


def test_guard_is_on_for_multi_device_cpu_only():
    assert dispatch.guard_for("cpu", 8).enabled
    assert not dispatch.guard_for("cpu", 1).enabled
    assert not dispatch.guard_for("gpu", 8).enabled
    assert not dispatch.guard_for("tpu", 8).enabled
    assert dispatch.guard_for("cpu", 8) is dispatch.guard_for("cpu", 4)


def test_guard_serialises_threads():
    guard = dispatch.DispatchGuard(enabled=True)
    active, peak, calls = [0], [0], [0]
    lock = threading.Lock()

    def program():
        with lock:
            active[0] += 1
            calls[0] += 1
            peak[0] = max(peak[0], active[0])
        sum(range(10000))
        with lock:
            active[0] -= 1
        return [_Output([], "x")]
    threads = [threading.Thread(target=lambda: [guard.dispatch(program) for _ in range(50)])
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert peak[0] == 1 and calls[0] == 200


def test_deleted_outputs_do_not_break_the_guard():
    class Deleted:
        def block_until_ready(self):
            raise RuntimeError("Array has been deleted")
    guard = dispatch.DispatchGuard(enabled=True)
    guard.dispatch(lambda: [Deleted()])
    assert guard.dispatch(lambda: 5) == 5
