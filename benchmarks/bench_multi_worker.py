"""Multi-worker training throughput: jdist 2 x 1 against TF 2 x 1, plain JAX 2 x 1 and jdist 1 x 2.

Each configuration trains the MLP of ``multi_worker_step.py`` (Adam, global batch 128, the same
batches and initial weights) in fresh processes: 2 loopback workers x 1 CPU device started by
``python -m jdist.launch`` (jdist's ``MultiWorkerMirroredStrategy``; TF's, with ``TF_CONFIG`` on
127.0.0.1, when TensorFlow imports; plain JAX: ``jax.distributed`` + ``jit(shard_map)`` +
``psum``), and jdist's ``MirroredStrategy`` on 1 process x 2 devices. The configurations
alternate in rounds (one fresh launch each per round, the order rotating), because this small
shared machine drifts between minutes; reported are each configuration's median steps/s with its
range over launches, and the medians (ranges) of the per-round ratios. Every launch is bounded in
time; a launch that overruns is killed by PID with its workers. Two models: ``mlp`` (6 leaves)
and ``deep`` (32 leaves). Targets (issue 51): jdist 2 x 1 / TF 2 x 1 >= 1, jdist 2 x 1 / plain
JAX 2 x 1 >= 1, every launch of jdist 2 x 1 within 1.5x of its median. Extra ``XLA_FLAGS`` and
``JAX_*`` settings in the environment reach every worker (how the levers of
``docs/multi_worker.md`` were measured). Run: ``python benchmarks/bench_multi_worker.py``.
"""

import common  # noqa: F401  (first, as every benchmark: it records the figures)

import importlib.util  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import pathlib  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
STEP = str(HERE / "multi_worker_step.py")
ROUNDS = int(os.environ.get("JDIST_BENCH_ROUNDS", "5"))
STEPS = {"mlp": 300, "deep": 200}
LAUNCH_TIMEOUT = 180  # Seconds: TF's import and start take most of a launch.
SPREAD = 1.5


def environment(devices):
    """This environment with ``devices`` simulated CPU devices per process (and this jdist)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "XLA_FLAGS")}
    env.update(JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=os.pathsep.join(
        filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")])),
        XLA_FLAGS=" ".join(flags + [f"--xla_force_host_platform_device_count={devices}"]))
    return env


def launch(config, model):
    """Steps/s of one fresh launch of ``config`` (``(way, processes)``) and its last loss."""
    way, processes = config
    args = [way, model, str(STEPS[model])]
    if processes == 1:
        command = [sys.executable, STEP] + args
    else:
        command = [sys.executable, "-m", "jdist.launch", "--nproc", str(processes), STEP] + args
    # On a timeout subprocess.run kills the launcher by PID; its workers die with it (the
    # launcher asks Linux to SIGKILL them when it dies).
    out = subprocess.run(command, env=environment(2 if processes == 1 else 1),
                         timeout=LAUNCH_TIMEOUT, capture_output=True, text=True, check=False)
    for line in out.stdout.splitlines():
        text = line.split("] ", 1)[-1]
        if text.startswith('{"steps_per_s"'):
            figures = json.loads(text)
            return figures["steps_per_s"], figures["loss"]
    raise RuntimeError(f"{config} {model} printed no figure (status {out.returncode}):\n"
                       f"{out.stdout[-2000:]}\n{out.stderr[-3000:]}")


def spread(values):
    """How far the extremes lie from the median, as a factor (1.0: all equal)."""
    median = statistics.median(values)
    return max(max(values) / median, median / min(values))


def summary(values):
    return f"{statistics.median(values):.0f} [{min(values):.0f}, {max(values):.0f}]"


def bench(model, configs):
    """Times every configuration in ``ROUNDS`` rounds; prints and records the figures."""
    speeds, names = {c: [] for c in configs}, list(configs)
    for r in range(ROUNDS):
        for config in names[r % len(names):] + names[:r % len(names)]:
            speed, loss = launch(configs[config], model)
            speeds[config].append(speed)
            print(f"  round {r}: {config:18s} {speed:7.0f} steps/s (loss {loss:.6f})", flush=True)
    print(f"multi_worker, {model}: steps/s median [range] over {ROUNDS} fresh launches")
    for config, values in speeds.items():
        print(f"  {config:18s} {summary(values)}")
    mine = speeds["jdist 2x1"]
    for other, label in (("TF 2x1", "TF"), ("plain JAX 2x1", "plain JAX")):
        if other in speeds:
            ratios = [a / b for a, b in zip(mine, speeds[other])]
            ratio = statistics.median(ratios)
            common.record("multi_worker", f"{model}: jdist 2 x 1 / {label} 2 x 1 (steps/s)", ratio,
                          "x", ">= 1.0", ratio >= 1.0,
                          f"per round {ratio:.2f} [{min(ratios):.2f}, {max(ratios):.2f}]; "
                          f"jdist {summary(mine)}, {label} {summary(speeds[other])} steps/s")
            print(f"  jdist 2x1 / {label} 2x1: {ratio:.2f} [{min(ratios):.2f}, {max(ratios):.2f}]"
                  f" per round: {'ok' if ratio >= 1.0 else 'MISSED'}")
    ratios = [a / b for a, b in zip(mine, speeds["jdist 1x2"])]
    common.record("multi_worker", f"{model}: jdist 2 x 1 / jdist 1 x 2 (reference)",
                  statistics.median(ratios), "x",
                  detail=f"1 x 2: {summary(speeds['jdist 1x2'])} steps/s")
    common.record("multi_worker", f"{model}: jdist 2 x 1, launch-to-launch spread", spread(mine),
                  "x median", f"<= {SPREAD}", spread(mine) <= SPREAD, summary(mine))
    if "TF 2x1" in speeds:  # The machine's own launch-to-launch noise, for comparison.
        common.record("multi_worker", f"{model}: TF 2 x 1, launch-to-launch spread (reference)",
                      spread(speeds["TF 2x1"]), "x median", detail=summary(speeds["TF 2x1"]))
    print(f"  jdist 2x1 / 1x2: {statistics.median(ratios):.2f}; jdist 2x1 spread "
          f"{spread(mine):.2f}x of its median (target <= {SPREAD}): "
          f"{'ok' if spread(mine) <= SPREAD else 'MISSED'}", flush=True)


def main():
    configs = {"jdist 2x1": ("jdist", 2), "plain JAX 2x1": ("jax", 2), "jdist 1x2": ("jdist", 1)}
    if importlib.util.find_spec("tensorflow") is not None:
        configs["TF 2x1"] = ("tf", 2)
    else:
        print("multi_worker: tensorflow does not import here; TF 2 x 1 skipped (make bench runs "
              "in the environment with the tf extra)")
    for model in STEPS:
        bench(model, configs)


if __name__ == "__main__":
    main()
