"""MultiWorkerMirroredStrategy: 2 workers x 2 CPU devices against 1 process x 4 devices, faults,
the launcher, and the single-worker strategy.

Multi-process runs use loopback only (127.0.0.1), are bounded by a timeout, and every process a
test starts is ended by that test, by PID. One run of ``_multi_worker_program.py`` checks many
results at once (written to JSON and compared here) so that processes start few times.
"""

import io
import json
import os
import subprocess
import sys
import time
import types

import numpy as np
import pytest

import jdist
from jdist._src.multi_worker import strategy as multi_worker
from jdist._src.multi_worker import runtime
from jdist._src.multi_worker.launcher import _pump
from jdist.launch import free_ports
from jdist.launch import worker_env

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PROGRAM = os.path.join(HERE, "_multi_worker_program.py")
TIMEOUT = 240


def _env(devices, **extra):
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    # The jdist of this checkout, not whichever one the environment has installed.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    env.update(extra)
    return env


def _start(cmd, env):
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _finish(procs, timeout):
    """Waits for every process (killing, by PID, any still running at the deadline)."""
    deadline, outputs = time.monotonic() + timeout, []
    try:
        for p in procs:
            try:
                out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
            outputs.append(out.decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outputs


def _compare(workers, single):
    assert single.keys() == workers[0].keys() == workers[1].keys()
    for key, expected in single.items():
        if key.startswith("_") or key == "input_context":
            continue
        if "global" in expected:
            for got in (w[key] for w in workers):
                tol = expected.get("tolerance", 0)
                np.testing.assert_allclose(got["global"], expected["global"], rtol=0, atol=tol,
                                           err_msg=key)
                assert got.get("kind") == expected.get("kind"), key
        else:
            merged = {**workers[0][key]["replicas"], **workers[1][key]["replicas"]}
            assert merged == expected["replicas"], key


def test_two_workers_equal_one_process(tmp_path):
    """run, reduce (both modes), gather (uneven), all_reduce, all_gather, merge_call,
    jdist.function, a dataset with a partial last batch and training give the same numbers."""
    out2, out1 = str(tmp_path / "two"), str(tmp_path / "one")
    launcher = _start([sys.executable, "-m", "jdist.launch", "--nproc", "2",
                       "--devices-per-proc", "2", PROGRAM, out2], _env(2))
    single = _start([sys.executable, PROGRAM, out1], _env(4))
    logs = _finish([launcher, single], TIMEOUT)
    assert launcher.returncode == 0 and single.returncode == 0, logs
    workers = [json.load(open(f"{out2}.{i}")) for i in range(2)]
    one = json.load(open(f"{out1}.0"))
    assert [w["_devices"] for w in workers] == [[2, 2], [2, 2]] and one["_devices"] == [1, 4]
    everyone = [0, 1, 2048, 2049]  # Device ids: 2048 x process + local index.
    assert [w["_worker_devices"] for w in workers] == [
        [everyone[:2], everyone[:2], everyone], [everyone[2:], everyone[2:], everyone]]
    assert one["_worker_devices"] == [[0, 1, 2, 3]] * 3
    _compare(workers, one)
    # Each worker reads its own input pipeline: InputContext(2 pipelines, worker index, 4).
    assert workers[0]["input_context"]["replicas"] == {"0": [2, 0, 4]}
    assert workers[1]["input_context"]["replicas"] == {"2": [2, 1, 4]}
    assert one["input_context"]["replicas"] == {"0": [1, 0, 4]}
    _check_per_worker(workers)
    _check_destinations(workers, one)
    _check_auto_shard(workers, one)
    _check_exact(one)
    _check_int64(one)
    print(f"2x2: {workers[0]['_seconds']:.1f} s, 1x4: {one['_seconds']:.1f} s")


def test_a_plain_value_is_each_workers_own(tmp_path):
    """TF's multi-worker strategy takes a plain array or number that the cross-replica context
    reduces or gathers as this worker's value, and with one replica per worker its reduce_to and
    broadcast_to results are such plain values: 2 workers x 1 replica, against NumPy."""
    out = str(tmp_path / "values")
    launcher = _start([sys.executable, "-m", "jdist.launch", "--nproc", "2", "--devices-per-proc",
                       "1", os.path.join(HERE, "_worker_values_program.py"), out], _env(1))
    logs = _finish([launcher], TIMEOUT)
    assert launcher.returncode == 0, logs
    got = [json.load(open(f"{out}.{w}", encoding="utf-8")) for w in range(2)]
    assert [g.pop("_roles") for g in got] == [[True] * 4, [False, False, True, True]]
    assert got[0] == got[1]  # Every worker gets the result.
    per_worker = {"mine": [np.float32([1, 10]), np.float32([2, 10])],
                  "same": [np.float32([3, 4])] * 2, "number": [np.float32(2), np.float32(3)],
                  "scalar": [np.float32(1), np.float32(2)],
                  "matrix": [np.full((2, 2), 1, np.float32), np.full((2, 2), 2, np.float32)],
                  "merged": [np.float32([1, 10])] * 2,  # The merge's SUM of [0, 5] and [1, 5].
                  "reduce_to": [np.float32([1, 10])] * 2,
                  "broadcast": [np.float32([1, 10]), np.float32([2, 10])]}
    for name, (a, b) in per_worker.items():
        expected = {f"reduce SUM {name} None": a + b, f"reduce MEAN {name} None": (a + b) / 2,
                    f"reduce_to SUM {name}": [a + b], f"reduce_to MEAN {name}": [(a + b) / 2],
                    # Each result keeps the value's shape (rank 0 too), as in TF.
                    f"batch_reduce_to SUM {name}": [a + b] * 2,
                    f"batch_reduce_to MEAN {name}": [(a + b) / 2] * 2}
        if name not in ("number", "scalar"):
            expected.update({f"reduce SUM {name} 0": a.sum(0) + b.sum(0),
                             f"reduce MEAN {name} 0": (a.sum(0) + b.sum(0)) / (len(a) + len(b)),
                             f"gather {name}": np.concatenate([a, b])})
        for case, want in expected.items():
            np.testing.assert_array_equal(got[0][case], want, err_msg=case)
            assert np.shape(got[0][case]) == np.shape(want), case  # (No broadcasting.)
    for case in ("reduce 1048576 None", "reduce 1048576 0", "reduce_to 1048576"):
        assert np.ravel(got[0][f"int64 {case}"]).tolist() == [1 + 2**20]
    # Issue 49: an integer MEAN across workers is TF's 1.5, in JAX's default float without x64.
    assert got[0]["int32 MEAN None"] == got[0]["int32 MEAN reduce_to"] == [[1.5], "float32"]
    assert got[0]["int32 MEAN 0"] == [1.5, "float32"]  # Along axis 0: a scalar.
    assert got[0]["float64 reduce None"] == [float(np.float32(0.1) + np.float32(1.1))]


def _destinations_expected():
    """The cases of ``_destinations``, computed in NumPy: (where the result lies (local device
    indices, "all": Mirrored), its value)."""
    v = [np.arange(3, dtype=np.float32) * (i + 1) - 1 for i in range(4)]
    total, mean = sum(v), sum(v) / 4
    ordered = 8 * v[0] + 4 * v[1] + 2 * v[2] + v[3]  # functools.reduce(a * 2 + b), in order.
    seven = [7, 7]
    return {"reduce_to_name": ([1], total), "reduce_to_device": ([0], mean),
            "reduce_to_own_task": ([1], total), "batch_reduce_to": ("all", total),
            "broadcast_back": ("all", total),
            "broadcast_to_local": ([1], total), "broadcast_host": ([1], seven),
            "ops_reduce": ([1], total), "ops_batch": ([1], mean), "ops_broadcast": ([1], seven),
            "to_one_mirrored": ("all", ordered), "to_one_mean": ([1], ordered / 4),
            "to_one_batch": ([1], ordered), "to_one_default": ([1], total)}


def _check_destinations(workers, one):
    """This worker's devices and the strategy's: every worker reads what 1 process x 4 devices
    reads. Another worker's device: InvalidArgumentError on every worker (and the program went
    on: the parts after it agree)."""
    expected = _destinations_expected()
    assert set(one["_destinations"]) == set(expected)
    remote = {"remote_name", "remote_device", "remote_batch"}
    for w, got in enumerate([one] + workers):
        got = got["_destinations"]
        for case, (on, value) in expected.items():
            assert (got[case]["on"], got[case]["kind"]) == (on, one["_destinations"][case][
                "kind"]), (case, w)
            np.testing.assert_array_equal(got[case]["value"], value, err_msg=f"{case} {w}")
        if w:
            assert set(got) == set(expected) | remote
            for case in remote:
                assert got[case]["error"] == "InvalidArgumentError", (case, w)
                assert "results go to this worker's devices" in got[case]["message"], case


def _expected_shards(policy, workers, per_worker):
    """Per step, each replica's rows of 18 rows batched by 7, as TF shards them (NumPy):
    one worker (but OFF): each batch cut over all replicas in ceil(B/N) chunks;
    DATA: replica (w, r) gets chunk w + r * W; OFF: worker w cuts the row stream by
    batch_sizes_for_worker (worker 0's sizes rotated by w * R), R sub-batches per step."""
    batches, n = np.split(np.arange(18), [7, 14]), workers * per_worker
    chunks = [[b[j * -(-len(b) // n):(j + 1) * -(-len(b) // n)] for j in range(n)]
              for b in batches]
    if workers == 1 and policy != "OFF":  # OFF rebatches the row stream on one worker too.
        return [dict(enumerate(c)) for c in chunks]
    if policy == "DATA":
        return [{w * per_worker + r: c[w + r * workers] for w in range(workers)
                 for r in range(per_worker)} for c in chunks]
    sizes = [2, 2, 2, 1]  # ceil(7 / 4) = 2 for the first 7 % 4 = 3 sub-batches, then floor.
    streams = []
    for w in range(workers):
        rotated = sizes[w * per_worker:] + sizes[:w * per_worker]
        cuts = np.cumsum([rotated[i % n] for i in range(12)])
        parts = [p for p in np.split(np.arange(18), cuts[cuts < 18]) if len(p)]
        streams.append(parts)
    steps = max(-(-len(p) // per_worker) for p in streams)
    return [{w * per_worker + r: (streams[w][k * per_worker + r]
                                  if k * per_worker + r < len(streams[w]) else [])
             for w in range(workers) for r in range(per_worker)} for k in range(steps)]


def _check_auto_shard(workers, one):
    """AutoShardPolicy OFF / DATA / AUTO and the default (AUTO, = DATA for a NumpyDataset) on 2
    workers x 2 replicas give TF's rows, and on one process (1 x 4), where OFF still rebatches
    the row stream; FILE raises on 2 (a NumpyDataset reads no files)."""
    for policy in ("OFF", "DATA", "AUTO", "None"):  # None: TF's default AUTO.
        tf_policy = "DATA" if policy in ("AUTO", "None") else policy
        for runs, shape in (([one], (1, 4)), (workers, (2, 2))):
            expected = _expected_shards(tf_policy, *shape)
            steps = [run["_auto_shard"][policy] for run in runs]
            assert len({len(s) for s in steps}) == 1, (policy, shape)
            got = [{int(i): rows for s in step for i, rows in s.items()} for step in zip(*steps)]
            assert got == [{i: list(map(float, r)) for i, r in e.items()} for e in expected], (
                policy, shape, got)
    assert one["_auto_shard"]["FILE"] is None
    assert [w["_auto_shard"]["FILE"] for w in workers] == ["InvalidArgumentError"] * 2


def _final_loss(out):
    lines = [line for line in out.splitlines() if "final training loss" in line]
    assert len(lines) == 1, out  # Printed once, by the chief.
    return float(lines[0].split()[-1])


def test_digits_example_two_workers_equal_one_process():
    """One epoch of examples/train_digits.py on 2 workers x 2 devices and on 1 process x 4
    devices, partial last batches kept (exact ragged steps across workers): the same final
    loss and test accuracy."""
    script = os.path.join(os.path.dirname(HERE), "examples", "train_digits.py")
    args = [script, "--epochs", "1"]
    start = time.monotonic()
    launcher = _start([sys.executable, "-m", "jdist.launch", "--nproc", "2",
                       "--devices-per-proc", "2"] + args, _env(2))
    single = _start([sys.executable] + args, _env(4))
    two, one = _finish([launcher, single], TIMEOUT)
    # One epoch does not reach the example's accuracy target (exit status 1); both runs agree.
    assert launcher.returncode == single.returncode and single.returncode in (0, 1), (two, one)
    assert "[Gloo]" not in two  # gloo's 4 "Rank i is connected" lines: the launcher drops them.
    assert abs(_final_loss(two) - _final_loss(one)) <= 1e-6, (two, one)
    accuracy = [line.split("test accuracy ")[1].split()[0] for line in two.splitlines()
                if "test accuracy" in line]
    assert accuracy == [one.split("test accuracy ")[1].split()[0]], (two, one)
    print(f"digits, 1 epoch: {time.monotonic() - start:.1f} s for both runs")


def _check_exact(one):
    """What the exact ragged steps give (the same on 2 workers, compared above): TF's values."""
    assert one["exact_epoch2_traces"]["global"] == 0  # The second epoch reuses every plan.
    steps = [key for key in one if key.startswith("exact0_")]
    assert len(steps) == 3 * 10  # Three steps, the last partial: jdist.function's the same.
    for key in steps:
        compiled, run = one[key.replace("exact0_", "compiled0_")], one[key]
        if "global" not in run:
            assert compiled == run, key
            continue
        np.testing.assert_allclose(compiled["global"], run["global"], rtol=0, atol=1e-6,
                                   err_msg=key)
    assert one["exact_rows"]["replicas"] == {"0": 1, "1": 1, "2": 1, "3": 0}
    assert np.isnan(one["exact0_2_mean"]["global"][3])  # jnp.mean of no rows, as in TF.
    # merge_fn saw every replica's value (4 of them) in full and partial steps alike.
    assert all(v % 100 == 4 for key in ("exact0_0_correct", "exact0_2_correct",
                                        "per_worker_exact1_correct")
               for v in one[key]["global"])
    assert one["exact0_0_correct"]["kind"] == "Mirrored"  # Every replica holds it.
    assert len(one["per_worker_exact1_x"]["global"]) == 3  # Rows 2, 1, 0, 0.
    assert one["per_worker_exact_steps"]["global"] == 2
    assert one["exact_errors"]["replicas"]["0"] == {
        "all_reduce": "UnevenValuesError", "loop": "UnevenValuesError",
        "all_reduce_shapes": "ShapeMismatchError"}


def _check_int64(one):
    # `_compare` found the workers' outcomes equal to one process's; these are TF's.
    for source in ("dataset", "values_from_function", "per_worker"):
        for how in ("all_reduce", "reduce"):
            assert np.ravel(one[f"int64_{source}_{2**20}_{how}"]["global"]) == [2 + 2 * 2**20]
    assert one[f"int64_ragged_{2**20}_reduce"] == {"global": 3 + 7 * 2**20}  # 1 + 2 + 3s + 4s.


def _check_per_worker(workers):
    """PER_WORKER pipelines of 3 and 5 per-replica batches of 2 rows on 2 workers x 2 replicas:
    3 steps, the worker out of data takes part with empty batches; host values that differ
    between workers, a plain value reduced across workers with two replicas each, and workers
    out of step raise the same typed error on both."""
    w0, w1 = (w["_per_worker"] for w in workers)
    assert w0 == w1
    assert w0["steps"] == [
        [[0, 1, 2, 3, 10, 11, 12, 13], [], 52.0],
        [[4, 5, 14, 15, 16, 17], [2, 0, 2, 2], 71.0],
        [[18, 19], [0, 0, 2, 0], 37.0]]
    uneven, array, number, disagreeing, plain, out_of_step = w0["errors"]
    assert plain[0] == "InvalidArgumentError" and "several replicas per worker" in plain[1]
    assert disagreeing[0] == "UnevenValuesError" and "see differently" in disagreeing[1]
    assert uneven is None  # The same batches, ragged: gathered exactly.
    assert w0["exact_steps"] == [step[0] for step in w0["steps"]]
    assert array[0] == "InvalidArgumentError"
    assert "run got args[0] with different values" in array[1]
    assert "worker 1 (task worker:1" in array[1] and "numpy (3,) float32 hash" in array[1]
    assert number[0] == "InvalidArgumentError" and "float 0.5; worker 1" in number[1]
    assert "float 1.5" in number[1]
    assert out_of_step[0] == "InvalidArgumentError" and "out of step" in out_of_step[1]
    assert w0["equal_host_values"] == 2.0
    assert w0["plain_refused"] == ["InvalidArgumentError: several replicas per worker"]


def _fault_run(fault, folder, port):
    procs = []
    for i in range(2):
        env = worker_env(_env(2), [port, 1], i)
        with open(folder / f"{fault}{i}.txt", "wb") as out:
            procs.append(subprocess.Popen([sys.executable, PROGRAM, "unused", fault], env=env,
                                          stdout=out, stderr=subprocess.STDOUT))
    return procs


def _wait_survivors(runs, timeout):
    """When each process ended (wall clock, by (fault, worker)); every process still running at
    the deadline is killed, by PID."""
    procs = {(fault, i): p for fault, ps in runs.items() for i, p in enumerate(ps)}
    deadline, ended = time.monotonic() + timeout, {}
    try:
        while len(ended) < len(procs) and time.monotonic() < deadline:
            for key, p in procs.items():
                if key not in ended and p.poll() is not None:
                    ended[key] = time.time()
            time.sleep(0.05)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return ended


def _fatal(out):
    """JAX's fatal log (absl's ``F<mmdd> ...`` line, its C++ stack) in a worker's output."""
    return any(line[:1] == "F" and line[1:5].isdigit() for line in out.splitlines()) or any(
        text in out for text in ("Check failure", "Terminating process", "Fatal Python"))


def test_faults_end_in_bounded_time_with_typed_errors(tmp_path):
    """A dead worker, a stalled one (timeout 8 s), one whose script raises, and per-worker
    shape disagreement."""
    # The ports are taken together, so the runs' coordinators never share one: taken one at
    # a time, a port closed by one call can be handed out again by the next.
    faults = ("die", "stall", "raise", "shapes")
    runs = {fault: _fault_run(fault, tmp_path, port)
            for fault, port in zip(faults, free_ports(len(faults)))}
    ended = _wait_survivors(runs, 120)
    out = {f"{fault}{i}": (tmp_path / f"{fault}{i}.txt").read_text(errors="replace")
           for fault in runs for i in range(2)}
    # An uncaught exception: worker 1 announces its failure at exit, so worker 0 ends well
    # before the timeout, and worker 1 does not wait for it in JAX's shutdown barrier.
    assert runs["raise"][1].returncode == 1 and "worker 1's own bug" in out["raise1"]
    assert runs["raise"][0].returncode == runtime.UNAVAILABLE_EXIT_CODE, out["raise0"]
    assert "worker 1 (task worker:1" in out["raise0"] and "ended with an error" in out["raise0"]
    fault_at = float(out["raise1"].split("fault at ")[1].split()[0])
    assert ended["raise", 0] - fault_at < 6, (ended["raise", 0] - fault_at, out["raise0"])
    for fault in ("die", "stall"):
        assert runs[fault][0].returncode == runtime.UNAVAILABLE_EXIT_CODE, out[f"{fault}0"]
        assert "jdist.errors.UnavailableError: worker 1 (task worker:1" in out[f"{fault}0"]
        # Within the timeout plus 10 s of worker 1 dying or stalling.
        fault_at = float(out[f"{fault}1"].split("fault at ")[1].split()[0])
        assert ended[fault, 0] - fault_at < 8 + 10, (ended[fault, 0] - fault_at, out[f"{fault}0"])
    assert "stopped sending heartbeats" in out["die0"]
    assert "alive but stuck" in out["stall0"]
    assert runs["die"][1].returncode == 3
    for name in ("shapes0", "shapes1"):
        assert runs["shapes"][int(name[-1])].returncode == 5, out[name]
        # Worker 1's replicas hold another shape: the all_reduce's operands differ (TF's
        # error), raised on both workers before any collective program runs.
        assert "typed error ShapeMismatchError" in out[name]
        assert "(2, 3)" in out[name] and "(2, 2)" in out[name]
        assert not _fatal(out[name]), out[name]


def test_chief_death_and_typed_failures_end_every_worker_typed(tmp_path):
    """Worker 0, which hosts JAX's coordination service, killed (SIGKILL): worker 1 ends with
    UnavailableError and status 14 at once (JAX's client aborted it, SIGABRT: 134). Both workers
    ending with an uncaught ShapeMismatchError, worker 1 half a second later: status 1 on both
    and no JAX fatal log (worker 0's end closed the service under worker 1, which aborted)."""
    runs = {fault: _fault_run(fault, tmp_path, port)
            for fault, port in zip(("chief", "uncaught"), free_ports(2))}
    ended = _wait_survivors(runs, 60)
    out = {f"{fault}{i}": (tmp_path / f"{fault}{i}.txt").read_text(errors="replace")
           for fault in runs for i in range(2)}
    assert runs["chief"][0].returncode == -9, out["chief0"]
    assert runs["chief"][1].returncode == runtime.UNAVAILABLE_EXIT_CODE, out["chief1"]
    assert ("jdist.errors.UnavailableError: worker 0 (task worker:0, 127.0.0.1:" in out["chief1"]
            and "which hosts the coordination service, has died" in out["chief1"])
    fault_at = float(out["chief0"].split("fault at ")[1].split()[0])
    assert ended["chief", 1] - fault_at < 5, (ended["chief", 1] - fault_at, out["chief1"])
    for i in range(2):
        assert runs["uncaught"][i].returncode == 1, out[f"uncaught{i}"]
        assert "ShapeMismatchError: a collective" in out[f"uncaught{i}"]
        assert not _fatal(out[f"uncaught{i}"]), out[f"uncaught{i}"]


def test_launcher_stops_the_others_when_one_fails(tmp_path):
    script = tmp_path / "w.py"
    script.write_text(
        "import json, os, sys, time\n"
        "index = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
        f"open(r'{tmp_path}/pid%d' % index, 'w').write(str(os.getpid()))\n"
        "print('hello', os.environ['XLA_FLAGS'], sys.argv[1:])\n"
        "if index == 1:\n    time.sleep(0.5); sys.exit(3)\n"
        "time.sleep(60)\n")
    start = time.monotonic()
    launcher = _start([sys.executable, "-m", "jdist.launch", "--nproc", "2",
                       "--devices-per-proc", "3", str(script), "a", "--b"], _env(8))
    (out,) = _finish([launcher], 30)
    assert launcher.returncode == 3, out
    assert time.monotonic() - start < 20
    assert "[worker 0] hello --xla_force_host_platform_device_count=3 ['a', '--b']" in out
    assert "[worker 1] hello" in out
    pid0 = int((tmp_path / "pid0").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid0, 0)


def test_worker_env():
    env = worker_env({"XLA_FLAGS": "--foo --xla_force_host_platform_device_count=8"},
                     [11, 12], 1, 2)
    assert json.loads(env["TF_CONFIG"]) == {
        "cluster": {"worker": ["127.0.0.1:11", "127.0.0.1:12"]},
        "task": {"type": "worker", "index": 1}}
    assert env["XLA_FLAGS"] == "--foo --xla_force_host_platform_device_count=2"
    a, b = free_ports(2)
    assert a != b


def test_the_launcher_drops_gloos_messages_wherever_they_land():
    """gloo prints "Rank i is connected" in pieces, one thread per device: a message can land
    inside the script's line or inside another device's message (as CI once saw)."""
    def message(rank):
        return (b"[Gloo] Rank %d is connected to 3 peer ranks. "
                b"Expected number of connected peer ranks is : 3\n" % rank)
    inside_another = b"[Gloo] Rank " + message(3) + message(2)[len(b"[Gloo] Rank "):]
    inside_a_line = b"epoch 1" + message(0) + b" loss 1.5\n"
    newline_after = b"step 2" + message(1) + b"\n"
    kept = message(1).replace(b"to 3", b"to 2")  # Kept: the counts differ.
    out = types.SimpleNamespace(buffer=io.BytesIO(), flush=lambda: None)
    _pump(io.BytesIO(inside_another + inside_a_line + newline_after + kept + b"last"), 1, out)
    assert out.buffer.getvalue().decode().splitlines() == [
        "[worker 1] epoch 1 loss 1.5", "[worker 1] step 2", "[worker 1] " + kept.decode().strip(),
        "[worker 1] last"]


def test_single_worker_is_mirrored_over_local_devices(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    s = jdist.MultiWorkerMirroredStrategy()
    assert s.num_replicas_in_sync == 8 and s.cluster_resolver.cluster_spec().as_dict() == {}
    ext = s.extended
    assert ext.should_checkpoint and ext.should_save_summary and ext.should_init
    assert ext.worker_index == 0 and ext.num_workers == 1 and ext.experimental_between_graph
    v = s.experimental_distribute_values_from_function(
        lambda c: np.float32(c.replica_id_in_sync_group))
    assert float(s.reduce("sum", v, axis=None)) == 28.0
    s.configure(cluster_spec={"worker": ["a:1"]})
    with pytest.raises(jdist.errors.ClusterMismatchError, match="starts once per process"):
        s.configure(cluster_spec={"worker": ["a:1", "b:2"]}, task_type="worker", task_id=1)
    assert repr(s).startswith("MultiWorkerMirroredStrategy(devices=['/job:localhost/replica:0/")


def test_strategy_options_are_all_reduce_defaults(monkeypatch):
    """As in TF, the strategy's CommunicationOptions are ReplicaContext.all_reduce's defaults:
    bytes_per_pack packs a nest into one all-reduce (lowered: 2 all-reduces become 1), with the
    same sums. Across CPU processes one pack per dtype is the default (issue 51: gloo reduces
    an all-reduce's arrays one by one, ~1-3 ms each on loopback), unless bytes_per_pack is set."""
    monkeypatch.delenv("TF_CONFIG", raising=False)
    counts = []
    for options in (None, jdist.CommunicationOptions(bytes_per_pack=1 << 20)):
        s = jdist.MultiWorkerMirroredStrategy(communication_options=options)
        v = s.experimental_distribute_values_from_function(lambda c: {
            "a": np.full((2, 3), c.replica_id_in_sync_group, np.float32),
            "b": np.arange(5, dtype=np.float32)})
        f = jdist.function(lambda v, s=s: s.run(
            lambda x: jdist.get_replica_context().all_reduce("sum", x), args=(v,)))
        counts.append(jdist.testing.count_all_reduces(f.lower(v).as_text()))
        for got in s.experimental_local_results(f(v)):
            np.testing.assert_array_equal(got["a"], np.full((2, 3), 28, np.float32))
            np.testing.assert_array_equal(got["b"], 8 * np.arange(5, dtype=np.float32))
    assert counts == [2, 1]
    two = runtime.Cluster(jdist.SimpleClusterResolver({"worker": ["a:1", "b:2"]},
                                                      task_type="worker", task_id=0))
    one = runtime.Cluster(jdist.SimpleClusterResolver({}))
    default, set_ = jdist.CommunicationOptions(), jdist.CommunicationOptions(bytes_per_pack=64)
    assert multi_worker._in_step_options(default, two, "cpu").bytes_per_pack == 1 << 40
    assert multi_worker._in_step_options(set_, two, "cpu") is set_
    assert multi_worker._in_step_options(default, two, "gpu") is default
    assert multi_worker._in_step_options(default, one, "cpu") is default


def test_cluster_parsing():
    resolver = jdist.SimpleClusterResolver(
        {"worker": ["w0:1", "w1:2"], "chief": ["c:3"]}, task_type="worker", task_id=1)
    cluster = runtime.Cluster(resolver)
    assert cluster.tasks == [("chief", 0), ("worker", 0), ("worker", 1)]
    assert (cluster.index, cluster.coordinator, cluster.num_workers) == (2, "c:3", 3)
    assert cluster.name(2) == "worker 2 (task worker:1, w1:2)"
    evaluator = jdist.SimpleClusterResolver({"worker": ["w0:1", "w1:2"], "evaluator": ["e:1"]},
                                            task_type="evaluator", task_id=0)
    assert runtime.Cluster(evaluator).num_workers == 1
    with pytest.raises(jdist.errors.InvalidArgumentError, match="ParameterServerStrategy"):
        runtime.Cluster(jdist.SimpleClusterResolver({"worker": ["a:1"], "ps": ["p:1"]}))
    with pytest.raises(jdist.errors.InvalidArgumentError, match="not among the cluster"):
        runtime.Cluster(jdist.SimpleClusterResolver({"worker": ["a:1", "b:2"]},
                                                    task_type="worker", task_id=5))


def test_jax_already_initialised_differently(monkeypatch):
    cluster = runtime.Cluster(jdist.SimpleClusterResolver(
        {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, task_type="worker", task_id=0))
    # JAX's backend runs in this test process already: starting jax.distributed must fail loudly.
    with pytest.raises(jdist.errors.ClusterMismatchError, match="before anything uses JAX"):
        runtime.initialize(cluster, 5)


def test_watchdog_ignores_a_peer_that_ended_without_keeping_this_worker_waiting():
    """A peer that ended (status 1) after launching as many collective programs as this worker
    is no fault: this worker may still be finishing its own host-side work."""
    from jdist._src.multi_worker.watchdog import _Peer
    peer = _Peer()
    assert peer.update("5 10 1", 10, now=1000.0, timeout=8) is None
    assert peer.update("5 10 1", 12, now=1005.0, timeout=8) is None  # Behind, within timeout.
    assert "ended for 8 s" in peer.update("5 10 1", 12, now=1014.0, timeout=8)
