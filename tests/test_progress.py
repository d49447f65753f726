"""Progress bar and print/log helpers: chief only, once per step, no collective on the way."""

import io
import logging
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdist
from jdist import errors

pytest.importorskip("tqdm")


def strategy_as(chief, monkeypatch, n=2):
    """A fresh strategy; a non-chief one simulates a worker of a multi-worker job."""
    strategy = jdist.MirroredStrategy(["cpu:%d" % i for i in range(n)])
    if not chief:
        monkeypatch.setattr(strategy.extended, "should_checkpoint", False, raising=False)
    return strategy


@pytest.fixture(autouse=True)
def no_collectives_outside_run(monkeypatch):
    """Printing must never reduce or gather: on a chief-only path the other workers never would."""
    def refuse(*args, **kwargs):
        raise AssertionError("a collective was called by a printing helper")
    monkeypatch.setattr(jdist.Strategy, "reduce", refuse)
    monkeypatch.setattr(jdist.Strategy, "gather", refuse)


def dataset(strategy, rows=10, batch=4):
    data = strategy.experimental_make_numpy_dataset(np.arange(rows, dtype=np.float32)).batch(batch)
    return strategy.experimental_distribute_dataset(data)


def mean_step(x):
    ctx = jdist.get_replica_context()
    total = ctx.all_reduce("sum", jnp.sum(x))
    return total / ctx.all_reduce("sum", jnp.float32(x.shape[0]))


class Terminal(io.StringIO):
    """Captured output that says it is a terminal, where the bar is redrawn in place."""

    def isatty(self):
        return True


@pytest.mark.parametrize("chief", (True, False))
def test_progress_bar_draws_on_the_chief_only(chief, monkeypatch):
    strategy = strategy_as(chief, monkeypatch)
    out = Terminal()
    losses = []
    with jdist.ProgressBar(dataset(strategy), strategy, desc="train", examples_per_step=4,
                           file=out, mininterval=0) as bar:
        for x in bar:
            loss = strategy.run(mean_step, args=(x,))
            bar.set_loss(loss)
            losses.append(float(loss))
    np.testing.assert_allclose(losses, [1.5, 5.5, 8.5])  # Every element reached the loop.
    text = out.getvalue()
    if not chief:
        assert text == ""
        return
    assert text.count(jdist.ProgressBar.COMPILE_NOTICE) == 1
    assert text.index(jdist.ProgressBar.COMPILE_NOTICE) < text.index("1/3")
    final = text.rstrip().split("\r")[-1]
    assert "train: 100%" in final and "3/3" in final and "loss=8.5" in final
    assert "examples/s=" in final and "step/s" in final


@pytest.mark.parametrize("steps, shown", [
    (25, [3, 6, 9, 12, 15, 18, 21, 24, 25]),  # Each tenth (3 steps), then the last.
    (100, list(range(10, 101, 10))),
    (3, [1, 2, 3]),
    (None, [7]),  # Unknown length: every 30 s (not reached here), then the last.
])
def test_progress_bar_off_a_terminal_prints_plain_lines(steps, shown):
    """Into a log (not a TTY) the bar prints whole lines, no carriage return, at most 11."""
    out = io.StringIO()
    data = [np.float32(i) for i in range(steps or 7)]
    bar = jdist.ProgressBar(data if steps else iter(data), desc="train", file=out,
                            mininterval=0)
    for x in bar:
        bar.set_loss(x)
    bar.close()
    text = out.getvalue()
    assert "\r" not in text
    notice, *lines = text.splitlines()
    assert notice == jdist.ProgressBar.COMPILE_NOTICE
    total = f"/{steps}" if steps else ""
    assert [re.search(r"(\d+(/\d+)?)(step)? \[", line)[1] for line in lines] == [
        f"{n}{total}" for n in shown], text
    assert [line.split("loss=")[1].rstrip("]") for line in lines] == [
        f"{n - 1:.4g}" for n in shown]


@pytest.mark.parametrize("chief", (True, False))
def test_print_once_prints_on_the_chief_only(chief, monkeypatch):
    strategy = strategy_as(chief, monkeypatch, n=4)
    out = io.StringIO()
    loss = strategy.run(lambda: jnp.float32(0.25))
    jdist.print_once("loss", loss, np.arange(2), file=out, strategy=strategy)
    assert out.getvalue() == ("loss 0.25 [0 1]\n" if chief else "")


@pytest.mark.parametrize("chief", (True, False))
def test_print_once_inside_run_prints_one_line_per_step(chief, monkeypatch):
    strategy = strategy_as(chief, monkeypatch, n=4)
    out = io.StringIO()

    def step(x):
        jdist.print_once("sum", x.sum(), file=out)
        return x * 2

    for _ in range(2):
        strategy.run(step, args=(jnp.arange(3.0),))
    jax.effects_barrier()
    assert out.getvalue() == ("sum 3.0\n" * 2 if chief else "")


@pytest.mark.parametrize("chief", (True, False))
def test_per_replica_values_are_refused_everywhere(chief, monkeypatch):
    strategy = strategy_as(chief, monkeypatch)
    value = jdist.testing.per_replica(strategy, [np.float32(1), np.float32(2)])
    with pytest.raises(errors.UnsupportedValueError, match="reduce it first|Reduce it first"):
        jdist.print_once(value, strategy=strategy)
    bar = jdist.ProgressBar([], strategy, file=io.StringIO())
    with pytest.raises(errors.UnsupportedValueError):
        bar.set_loss(value)
    bar.close()


@pytest.mark.parametrize("chief", (True, False))
def test_log_once(chief, monkeypatch, caplog):
    strategy = strategy_as(chief, monkeypatch)
    with caplog.at_level(logging.INFO, logger="jdist"):
        jdist.log_once("step %d loss %.2f", 3, strategy.run(lambda: jnp.float32(0.5)),
                       strategy=strategy)
    assert [r.getMessage() for r in caplog.records] == (["step 3 loss 0.50"] if chief else [])


def test_missing_tqdm_is_a_typed_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    with pytest.raises(errors.MissingDependencyError, match=r"jdist\[progress\]"):
        jdist.ProgressBar([])


def test_compile_notice_can_be_left_out():
    out = io.StringIO()
    for _ in jdist.ProgressBar([1, 2], file=out, compile_notice=False):
        pass
    assert jdist.ProgressBar.COMPILE_NOTICE not in out.getvalue()
