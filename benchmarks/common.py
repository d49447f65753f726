"""What the benchmarks share: eight simulated CPU devices and a plain-JAX MLP.

Import it before anything that imports jax: it requests the simulated devices, which JAX reads
when its backend starts (a device count the caller already set in ``XLA_FLAGS`` wins).
"""

import atexit
import contextlib
import os
import pathlib
import statistics
import sys

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402


def init_mlp(key, layers):
    """He-initialised dense layers ``w0, b0, w1, ...`` for the sizes in ``layers``."""
    params = {}
    for i, (fan_in, fan_out) in enumerate(zip(layers[:-1], layers[1:])):
        key, sub = jax.random.split(key)
        params[f"w{i}"] = jax.random.normal(sub, (fan_in, fan_out)) * jnp.sqrt(2.0 / fan_in)
        params[f"b{i}"] = jnp.zeros((fan_out,))
    return params


def mlp_logits(params, x):
    """The MLP of `init_mlp`: dense layers with ReLU between them."""
    depth = len(params) // 2
    for i in range(depth):
        x = x @ params[f"w{i}"] + params[f"b{i}"]
        if i < depth - 1:
            x = jax.nn.relu(x)
    return x


def record(benchmark, metric, value, unit="", target=None, met=None, detail="", **data):
    """Adds one figure to ``<results>/<benchmark>.json``, which ``report.py`` turns into a page.

    The results folder is ``$JDIST_BENCH_RESULTS`` (``run_all.py`` sets it) or
    ``benchmarks/results``. ``value`` is the headline number (a ratio where the benchmark
    compares two ways), ``target`` its goal as text, ``met`` whether it was reached, ``detail``
    the raw measurements behind it, ``data`` any numbers a plot needs (JSON-compatible).
    """
    import json  # pylint: disable=import-outside-toplevel

    path = results_file(benchmark)
    path.parent.mkdir(parents=True, exist_ok=True)
    figures = json.loads(path.read_text()) if path.exists() else []
    figures.append({"metric": metric, "value": float(value), "unit": unit, "target": target,
                    "met": met, "detail": detail, "data": data})
    path.write_text(json.dumps(figures, indent=1))


def results_file(benchmark):
    """Where `record` keeps ``benchmark``'s figures: ``$JDIST_BENCH_RESULTS`` (``run_all.py``
    sets it) or ``benchmarks/results``."""
    folder = os.environ.get("JDIST_BENCH_RESULTS", pathlib.Path(__file__).parent / "results")
    return pathlib.Path(folder) / f"{benchmark}.json"


def paired_ratio(times, num, den):
    """The median over rounds of ``times[num][i] / times[den][i]``: two ways timed in the same
    rounds, so the machine's drifts (20-30% between rounds here) hit both alike."""
    return statistics.median(n / d for n, d in zip(times[num], times[den]))


def guard_waits(strategy):
    """Whether ``strategy``'s CPU dispatch guard waits on the previous program before each
    launch (several CPU devices): a fair hand-written loop waits exactly where it does."""
    return strategy.extended._guard.enabled  # pylint: disable=protected-access


def unguarded(strategy, call):
    """``call()`` with ``strategy``'s CPU dispatch guard off, as it is on GPU and TPU: what
    ``run`` costs there besides the device's own dispatch (benchmarks only: it reaches into the
    strategy's private guard; safe only where each program is waited for before the next)."""
    guard = strategy.extended._guard  # pylint: disable=protected-access
    guard.enabled = False
    try:
        return call()
    finally:
        guard.enabled = True


@contextlib.contextmanager
def replayed_launches(strategy):
    """Inside, each compiled program ``strategy`` launches runs once; later launches of it return
    those first outputs at once. What a ``strategy.run`` call then costs is jdist's host-side
    work alone: flattening, checks, the guard, wrapping outputs (benchmarks only: it reaches
    into the strategy's private dispatch guard). Yields the list of the replayed outputs, in
    the order their programs first ran (what each program returns, as JAX returned it)."""
    guard = strategy.extended._guard  # pylint: disable=protected-access
    launch, first, replayed = guard.launch, {}, []

    def replay(program, args, waited):
        if id(program) not in first:
            first[id(program)] = program, jax.block_until_ready(launch(program, args, waited))
            replayed.append(first[id(program)][1])
        return first[id(program)][1]
    guard.launch = replay
    try:
        yield replayed
    finally:
        del guard.launch  # The class's method again.


def cpu_ticks():
    """The machine's CPU time counters since boot, in ticks (``/proc/stat``: user, nice,
    system, idle, iowait, irq, softirq, steal), or None where there are no such counters."""
    try:
        fields = pathlib.Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    return [int(f) for f in fields[1:9]] if fields[:1] == ["cpu"] and len(fields) > 8 else None


def record_stolen_time(benchmark, start):
    """Records the share of the machine's CPU time its hypervisor gave to other guests (steal)
    since ``start`` (`cpu_ticks`): one way a shared virtual machine moves every absolute figure,
    not the only one. On 2026-11-27 the least wrapper of `bench_compile` cost 18 us over the raw
    call at 10 leaves in one run, 66 us in a probe with 30% stolen, and 52 us in a run with 1.6%
    stolen (everything ran 2-3x slower then), so compare absolute figures within one run only."""
    end = cpu_ticks()
    if start is None or end is None or not results_file(benchmark).exists():
        return  # No counters here, or a benchmark that recorded nothing (it only prints).
    spent = [b - a for a, b in zip(start, end)]
    if sum(spent):
        record(benchmark, "CPU time taken by the hypervisor (steal) while this ran (reference)",
               100.0 * spent[7] / sum(spent), "%",
               detail="of all cores' time; absolute figures above rise with it")


# Each benchmark's table ends with the steal its run saw (``bench_NAME.py`` records as NAME).
if pathlib.Path(sys.argv[0]).stem.startswith("bench_"):
    atexit.register(record_stolen_time, pathlib.Path(sys.argv[0]).stem[len("bench_"):],
                    cpu_ticks())
