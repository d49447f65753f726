"""Writes ``docs/benchmarks.md`` and its throughput plot from the figures of one benchmark run.

Every ``bench_*.py`` records its figures as JSON (``common.record``) in one results folder;
``run_all.py`` runs them all into a fresh folder and then this script, so the page only ever
shows numbers measured together, on the machine it names. Run alone:
``python benchmarks/report.py RESULTS_FOLDER``.
"""

import common  # noqa: F401  (first: the devices the benchmarks ran on, for the machine line)

import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import pathlib  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "benchmarks.md"
PLOT = ROOT / "docs" / "img" / "scaling.png"
CURVES = (("jdist", "jdist (strategy.run)"), ("hand", "hand-written jit(shard_map)"),
          ("tf", "tf.distribute"))


def machine():
    """One line naming the machine, the software and the device backend."""
    import jax  # pylint: disable=import-outside-toplevel

    cpu = platform.processor() or platform.machine()
    cpuinfo = pathlib.Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]
        cpu = names[0] if names else cpu
    devices = jax.devices()
    return (f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}; "
            f"Python {platform.python_version()}, jax {jax.__version__}; backend "
            f"{jax.default_backend()} with {len(devices)} devices ({devices[0].device_kind})")


def plot(scaling):
    """Examples/s against the replica count, one line per implementation measured."""
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

    rows = sorted((f["data"] for f in scaling if "replicas" in f["data"]),
                  key=lambda d: d["replicas"])
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    for key, label in CURVES:
        points = [(d["replicas"], d[key]) for d in rows if key in d]
        if points:
            ax.plot(*zip(*points), marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks([d["replicas"] for d in rows], [str(d["replicas"]) for d in rows])
    ax.set_xlabel("replicas (simulated CPU devices, 16 rows each)")
    ax.set_ylabel("training throughput (examples/s)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOT)
    plt.close(fig)


def table(figures):
    lines = ["| figure | value | target | met | measured |", "| --- | --- | --- | --- | --- |"]
    for f in figures:
        met = "" if f["met"] is None else ("yes" if f["met"] else "**MISSED**")
        value = f"{f['value']:.3g} {f['unit']}".strip()
        lines.append(f"| {f['metric']} | {value} | {f['target'] or ''} | {met} | {f['detail']} |")
    return "\n".join(lines)


def write_page(results):
    files = sorted(results.glob("*.json"))
    if not files:
        raise SystemExit(f"no benchmark results in {results}")
    benchmarks = {p.stem: json.loads(p.read_text()) for p in files}
    measured = datetime.datetime.fromtimestamp(max(p.stat().st_mtime for p in files),
                                               datetime.timezone.utc)
    parts = ["# Benchmarks", "",
             "Written by `make bench` from one run of every `benchmarks/bench_*.py`; each ratio "
             "compares two ways measured in the same run, alternating, so load on the machine "
             "hits both alike. The docstring of each benchmark says what it measures.", "",
             f"**Machine:** {machine()}.  ",
             f"**Measured:** {measured:%Y-%m-%d %H:%M} UTC (the last figure's time).",
             ""]
    if "scaling" in benchmarks:
        plot(benchmarks["scaling"])
        has_tf = any("tf" in f["data"] for f in benchmarks["scaling"])
        parts += ["## Training throughput against replica count", "",
                  f"![Training throughput against replica count]({PLOT.relative_to(PAGE.parent)})",
                  "", "TensorFlow was measured too." if has_tf else
                  "TensorFlow was not installed for this run, so its curve is absent.", ""]
    for name, figures in benchmarks.items():
        parts += [f"## `bench_{name}.py`", "", table(figures), ""]
    PAGE.write_text("\n".join(parts))
    print(f"wrote {PAGE.relative_to(ROOT)} ({sum(map(len, benchmarks.values()))} figures)")


if __name__ == "__main__":
    write_page(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else
               pathlib.Path(__file__).parent / "results")
