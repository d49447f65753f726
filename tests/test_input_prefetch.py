"""The background feeder: reads ahead (bounded), forwards errors, and never leaves a thread."""

import gc
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest

import jdist
from jdist._src.input import prefetch
from jdist.testing import mirrored


def wait_for(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class CountingLoader:
    """A re-iterable loader (forever, unless ``limit``) that counts the batches it produced."""

    def __init__(self, limit=None, fail_at=None, delay=0.0):
        self.produced = 0
        self.limit, self.fail_at, self.delay = limit, fail_at, delay

    def __iter__(self):
        k = 0
        while self.limit is None or k < self.limit:
            if k == self.fail_at:
                raise KeyError("loader failed")
            if self.delay:
                time.sleep(self.delay)
            self.produced += 1
            yield {"x": np.full((4, 2), k, np.float32)}
            k += 1


@pytest.fixture(autouse=True)
def _no_threads_left():
    gc.collect()
    assert wait_for(lambda: not prefetch.live_threads(), 5.0), (
        f"left by earlier tests: {prefetch.live_threads()}")
    yield
    gc.collect()
    assert wait_for(lambda: not prefetch.live_threads(), 5.0), prefetch.live_threads()


@pytest.mark.parametrize("buffer_size", (1, 3))
def test_reads_ahead_of_the_consumer_but_bounded(buffer_size):
    s = mirrored(2)
    loader = CountingLoader()
    options = jdist.InputOptions(experimental_per_replica_buffer_size=buffer_size)
    it = iter(s.experimental_distribute_dataset(loader, options))
    # Nothing was asked for yet, but the feeder prepares batches ahead...
    assert wait_for(lambda: loader.produced >= buffer_size)
    time.sleep(0.2)
    # ...no more than the buffer plus the one waiting to be put.
    assert loader.produced <= buffer_size + 1
    element = next(it)
    assert isinstance(element["x"].stacked, jax.Array)  # Already on the devices.
    assert np.asarray(s.gather(element["x"], 0)).tolist() == [[0, 0]] * 4
    it.close()


@pytest.mark.parametrize("source,threads", [
    ("list", 1), ("loader", 1), ("generator function", 1),
    ("numpy", 0),  # In-memory blocks, placed by the loop (`batch_blocks`).
    ("numpy, batches of 3", 0)])  # No blocks (3 rows on 2 replicas): still the loop's thread.
def test_by_default_every_streamed_source_gets_a_thread(source, threads):
    s = mirrored(2)
    rows = np.arange(16, dtype=np.float32).reshape(8, 2)
    data = {"numpy": s.experimental_make_numpy_dataset({"x": rows}).batch(4),
            "numpy, batches of 3": s.experimental_make_numpy_dataset({"x": rows}).batch(3),
            "list": [{"x": rows[:4]}, {"x": rows[4:]}],
            "loader": ListLoader([{"x": rows[:4]}, {"x": rows[4:]}]),
            "generator function": lambda: iter([{"x": rows[:4]}, {"x": rows[4:]}])}[source]
    it = iter(s.experimental_distribute_dataset(data))
    started = len(prefetch.live_threads())
    got = [np.asarray(s.gather(e["x"], 0)) for e in it]
    assert started == threads
    np.testing.assert_array_equal(np.concatenate(got), rows)
    assert not prefetch.live_threads()  # Joined at the end of the data.


class ListLoader:
    """A re-iterable loader object (not a list): jdist cannot tell whether it blocks."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


def test_break_leaves_no_thread():
    s = mirrored(4)
    loader = CountingLoader()  # Endless: the feeder is blocked on a full queue when we break.
    for i, _ in enumerate(s.experimental_distribute_dataset(loader)):
        assert len(prefetch.live_threads()) == 1
        if i == 2:
            break
    assert not prefetch.live_threads()  # Joined as soon as the loop dropped the iterator.


def test_exception_in_the_step_leaves_no_thread():
    s = mirrored(2)
    with pytest.raises(ZeroDivisionError):
        for _ in s.experimental_distribute_dataset(CountingLoader()):
            _ = 1 / 0
    gc.collect()
    assert not prefetch.live_threads()


def test_garbage_collection_and_close_stop_the_thread():
    s = mirrored(3)
    dist = s.experimental_distribute_dataset(CountingLoader(delay=0.01))
    it = iter(dist)
    next(it)
    thread = it._feed.thread
    assert thread.is_alive()
    del it
    gc.collect()
    assert not thread.is_alive()
    it = iter(dist)
    next(it)
    it.close()
    assert not prefetch.live_threads()
    with pytest.raises(StopIteration):
        next(it)


def test_a_cycle_holding_the_iterator_is_collected():
    s = mirrored(2)

    class Holder:
        pass

    holder = Holder()
    holder.self, holder.it = holder, iter(s.experimental_distribute_dataset(CountingLoader()))
    next(holder.it)
    del holder
    gc.collect()
    assert not prefetch.live_threads()


def test_end_of_data_joins_the_thread():
    s = mirrored(2)
    it = iter(s.experimental_distribute_dataset(CountingLoader(limit=3)))
    assert len(list(it)) == 3
    assert not prefetch.live_threads()


def test_loader_exceptions_reach_the_consumer():
    s = mirrored(2)
    loader = CountingLoader(fail_at=2)
    it = iter(s.experimental_distribute_dataset(loader))
    next(it)
    next(it)
    with pytest.raises(KeyError, match="loader failed"):
        next(it)
    assert not prefetch.live_threads()
    with pytest.raises(StopIteration):  # The data has ended with the error.
        next(it)


def test_splitting_errors_reach_the_consumer():
    s = mirrored(2)
    it = iter(s.experimental_distribute_dataset([np.zeros(4, np.float32), np.float32(1.0)]))
    next(it)
    with pytest.raises(ValueError, match="unbatched"):
        next(it)


def test_generators_are_closed_when_the_loop_stops_early():
    s = mirrored(2)
    closed = []

    def gen():
        try:
            while True:
                yield np.zeros(2, np.float32)
        finally:
            closed.append(True)

    for _ in s.experimental_distribute_dataset(gen):
        break
    assert closed == [True]


def test_interpreter_exit_with_a_live_iterator_does_not_hang(tmp_path):
    script = tmp_path / "exit_with_iterator.py"
    script.write_text(textwrap.dedent("""
        import os
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
        os.environ["JAX_PLATFORMS"] = "cpu"
        import itertools, numpy as np, jdist
        s = jdist.MirroredStrategy()
        loader = lambda: (np.zeros((4,), np.float32) for _ in itertools.count())
        ITERATOR = iter(s.experimental_distribute_dataset(loader))  # Endless, never closed.
        next(ITERATOR)
        print("done")
    """))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "done"


def test_prefetcher_unit_behaviour():
    items = iter(range(5))
    p = prefetch.Prefetcher(items, lambda x: x * 10, buffer_size=2)
    got = []
    while (item := p.get()) is not prefetch.END:
        got.append(item)
    assert got == [0, 10, 20, 30, 40]
    p.close()
    p.close()  # Idempotent.
    assert not p.thread.is_alive()
