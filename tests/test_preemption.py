"""jdist.experimental.PreemptionCheckpointHandler (issue 48): a training process sent SIGTERM
mid-epoch saves at the next step boundary and exits with the configured code; a second process,
on another replica count, or 2 launched workers, resumes there and ends with the uninterrupted
run's parameters. With
2 workers x 2 devices (loopback, every process bounded and ended by its pid) a SIGTERM to one
worker stops both at one step, and a worker killed mid-collective ends the other, typed."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import jdist
from jdist import errors
from jdist.launch import free_ports
from jdist.launch import worker_env

pytest.importorskip("orbax.checkpoint")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _preemption_program as program  # noqa: E402

PROGRAM = str(pathlib.Path(program.__file__))


def start(directory, replicas, delay, launcher=()):
    """One process on ``replicas`` devices, or with ``launcher`` (``jdist.launch`` options)
    the launched workers, each on all its devices (their lines prefixed ``[worker i]``)."""
    command = [sys.executable, "-m", "jdist.launch", *launcher] if launcher else [sys.executable]
    return subprocess.Popen(command + [PROGRAM, str(directory), str(replicas), str(delay)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(process, timeout=120):
    """The process's (return code, stdout lines, stderr), ended by its pid if it overruns."""
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate(timeout=30)
    return process.returncode, out.splitlines(), err


def steps_of(lines):
    return [json.loads(line.split(" ", 2)[2]) for line in lines if line.startswith("step ")]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The parameters and the example ids of each step of a run that never stopped."""
    seen = []
    params = program.train(tmp_path_factory.mktemp("straight"), 2,
                           report=lambda step, ids: seen.append(ids))
    return params, seen


def resumed_matches(directory, replicas, before, uninterrupted, launcher=()):
    """Resumes on ``replicas`` replicas (or the launched workers): worker 0 continues where
    ``before`` (the steps' ids) stopped, with the same global batches (gathered in another
    order across workers: DATA sharding), and ends with the uninterrupted run's parameters
    (within 1e-6)."""
    code, lines, err = finish(start(directory, replicas, 0.0, launcher))
    assert code == 0, err
    prefix = "[worker 0] " if launcher else ""
    lines = [line[len(prefix):] for line in lines if line.startswith(prefix)]
    reference, seen = uninterrupted
    order = sorted if launcher else list
    assert [order(ids) for ids in steps_of(lines)] == [order(ids) for ids in seen[len(before):]]
    resumed = json.loads(lines[-1][len("done "):])
    for key, value in reference.items():
        np.testing.assert_allclose(np.asarray(resumed[key], np.float32), value, rtol=0,
                                   atol=1e-6)


@pytest.mark.parametrize("replicas,resume,launcher", [
    (2, 3, ()),  # 1 x 2 -> 1 x 3.
    (4, 0, ("--nproc", "2", "--devices-per-proc", "2"))])  # 1 x 4 -> 2 workers x 2.
def test_sigterm_mid_epoch_saves_exits_and_resumes_on_another_replica_count(
        tmp_path, uninterrupted, replicas, resume, launcher):
    directory = tmp_path / "preempted"
    first = start(directory, replicas, 0.3)
    watchdog = threading.Timer(120, first.kill)  # Bounds the read below: ends it by its pid.
    watchdog.start()
    try:
        lines = []
        for line in first.stdout:  # Told to stop in the 4th step's pause, mid-epoch 1.
            lines.append(line.strip())
            if line.startswith("step 4 "):
                os.kill(first.pid, signal.SIGTERM)
                break
    finally:
        code, rest, err = finish(first)
        watchdog.cancel()
    assert code == 75, err
    before = steps_of(lines + rest)
    with jdist.checkpoint.CheckpointManager(directory) as manager:
        assert manager.latest_step == len(before) and 4 <= len(before) < program.PER_EPOCH
    assert before == uninterrupted[1][:len(before)]
    resumed_matches(directory, resume, before, uninterrupted, launcher)


def start_workers(directory, folder, delay, **options):
    """2 workers x 2 CPU devices on loopback, each one's output in ``folder/worker<i>.txt``;
    ``options``: the program's ``JDIST_TEST_*`` settings, e.g. ``TIMEOUT=2``."""
    ports, procs = free_ports(2), []
    base = {**os.environ, "JAX_PLATFORMS": "cpu",
            **{f"JDIST_TEST_{k}": str(v) for k, v in options.items()}}
    for i in range(2):
        env = worker_env(base, ports, i, devices_per_proc=2)
        with open(folder / f"worker{i}.txt", "w") as out:
            procs.append(subprocess.Popen([sys.executable, PROGRAM, str(directory), "0",
                                           str(delay)], env=env, stdout=out,
                                          stderr=subprocess.STDOUT))
    return procs


def wait_for(path, text, procs, timeout=90):
    """Polls ``path`` until it holds ``text`` (True), a process ends or time is up (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and all(p.poll() is None for p in procs):
        if text in path.read_text():
            return True
        time.sleep(0.05)
    return False


def signal_worker_1(directory, folder, step, signum, timeout, **options):
    """Starts the 2 x 2 job, sends ``signum`` to worker 1 once it has printed ``step``, and
    returns each process's (status, seconds) (`end_all`) and both workers' output."""
    procs = start_workers(directory, folder, 0.3, **options)
    try:
        assert wait_for(folder / "worker1.txt", f"step {step} ", procs)
        os.kill(procs[1].pid, signum)
    finally:
        ended = end_all(procs, timeout)
    return ended, [(folder / f"worker{i}.txt").read_text() for i in range(2)]


def end_all(procs, timeout):
    """Each process's exit status and seconds until it ended; one still running at the
    deadline is killed, by its pid, and its status is None."""
    t0, ended = time.monotonic(), {}
    try:
        while len(ended) < len(procs) and time.monotonic() - t0 < timeout:
            ended.update({i: time.monotonic() - t0 for i, p in enumerate(procs)
                          if i not in ended and p.poll() is not None})
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(p.returncode if i in ended else None, ended.get(i)) for i, p in enumerate(procs)]


def test_sigterm_to_one_worker_stops_both_at_one_step_and_resumes_on_one_process(
        tmp_path, uninterrupted):
    """Worker 1 (never paused: it waits inside each step's collective for worker 0) is told
    to stop after step 4 of epoch 1; both exit 75 after the chief's one checkpoint at the
    same step (the next even one: they agree every 2 steps), and 1 process x 4 replicas
    resumes there."""
    directory = tmp_path / "preempted"
    ended, out = signal_worker_1(directory, tmp_path, 4, signal.SIGTERM, 60)
    assert [code for code, _ in ended] == [75, 75], out
    before = [steps_of(text.splitlines()) for text in out]
    assert before[0] == before[1]  # The same steps: they stopped at one boundary.
    with jdist.checkpoint.CheckpointManager(directory) as manager:
        assert manager.all_steps() == [len(before[0])]
    assert len(before[0]) in (4, 6)  # check_every=2: at an agreement after the signal.
    # The same global batches; gathered in another order (DATA sharding over 2 workers).
    assert [sorted(ids) for ids in before[0]] == [
        sorted(ids) for ids in uninterrupted[1][:len(before[0])]]
    resumed_matches(directory, 4, before[0], uninterrupted)


def test_a_worker_killed_inside_a_collective_ends_the_other_typed(tmp_path):
    """Killed at the end of its grace period (SIGKILL) while worker 0 pauses: worker 0 then
    waits in a collective that never completes, and the watchdog ends it (status 14,
    UnavailableError) within its 5 s timeout, not hanging; no checkpoint is written."""
    directory = tmp_path / "killed"
    ended, (out, _) = signal_worker_1(directory, tmp_path, 2, signal.SIGKILL, 40)
    assert ended[0][0] == 14 and ended[0][1] < 5 + 10, (ended, out)
    assert "jdist.errors.UnavailableError: worker 1 (task worker:1" in out
    with jdist.checkpoint.CheckpointManager(directory) as manager:
        assert manager.latest_step is None


def test_a_chief_saving_longer_than_the_timeout_is_not_reported_dead(tmp_path):
    """Worker 0's wait for its preemption checkpoint takes 5 s more, with a 2 s timeout: worker
    1, which has exited and waits for it to end, does not report it (its heartbeat goes on and
    it announces the save); both exit 75 with the checkpoint."""
    directory = tmp_path / "slow"
    ended, out = signal_worker_1(directory, tmp_path, 4, signal.SIGTERM, 60, TIMEOUT=2,
                                 SLOW_SAVE=5)
    assert [code for code, _ in ended] == [75, 75], out
    assert ended[0][1] > 5, ended  # The save did take longer than the timeout.
    with jdist.checkpoint.CheckpointManager(directory) as manager:
        assert manager.all_steps() == [len(steps_of(out[0].splitlines()))]


def test_a_peer_waits_in_a_collective_for_a_chief_saving_longer_than_the_timeout(tmp_path,
                                                                                 uninterrupted):
    """The same mid-training (a save after step 3): worker 1 runs on into step 4's collective
    and waits there the 5 s; the job ends with the uninterrupted run's parameters."""
    procs = start_workers(tmp_path / "slow", tmp_path, 0.0, TIMEOUT=2, SLOW_SAVE=5, SAVE_AT=3)
    ended = end_all(procs, 90)
    out = [(tmp_path / f"worker{i}.txt").read_text() for i in range(2)]
    assert [code for code, _ in ended] == [0, 0], out
    assert min(seconds for _, seconds in ended) > 5, ended
    for text in out:
        done = json.loads(text.splitlines()[-1][len("done "):])
        for key, value in uninterrupted[0].items():
            np.testing.assert_allclose(np.asarray(done[key], np.float32), value, rtol=0,
                                       atol=1e-6)


def test_a_busy_peer_is_waited_for_while_its_heartbeat_goes_on():
    """The rule the two tests above exercise: a peer that publishes it is busy (saving) is
    never behind, but it is reported once its heartbeat stops (it died mid-save), and once it
    stays behind ``timeout`` seconds after the save."""
    from jdist._src.multi_worker.watchdog import _Peer
    peer = _Peer()
    assert peer.update("1 3 0 1", 5, now=1000.0, timeout=2) is None
    assert peer.update("9 3 0 1", 5, now=1010.0, timeout=2) is None  # Behind 10 s, saving.
    assert "stopped sending heartbeats" in peer.update("9 3 0 1", 5, now=1013.0, timeout=2)
    peer = _Peer()
    assert peer.update("1 3 0 1", 5, now=1000.0, timeout=2) is None
    assert peer.update("2 3 0 0", 5, now=1001.5, timeout=2) is None  # Saved; behind 1.5 s.
    assert "did not launch" in peer.update("3 3 0 0", 5, now=1002.5, timeout=2)


def test_the_handler_needs_a_checkpoint_manager_and_gives_the_signal_back(tmp_path):
    with pytest.raises(errors.InvalidArgumentError, match="CheckpointManager"):
        jdist.experimental.PreemptionCheckpointHandler(None, str(tmp_path))
    before = signal.getsignal(signal.SIGINT)
    config = jdist.experimental.TerminationConfig(signals=(signal.SIGINT,))
    with jdist.checkpoint.CheckpointManager(tmp_path) as manager:
        handler = jdist.experimental.PreemptionCheckpointHandler(None, manager,
                                                                 termination_config=config)
        with handler.watch_preemption_scope():
            assert signal.getsignal(signal.SIGINT) != before
            assert handler.run(lambda w: w + 1, 1) == 2 and handler.total_run_calls == 1
        assert signal.getsignal(signal.SIGINT) == before and manager.latest_step is None


RESTARTED = """
import json, os, pathlib, sys, time
attempt, index = int(os.environ["JDIST_RESTART"]), json.loads(os.environ["TF_CONFIG"])["task"]["index"]
folder = pathlib.Path(sys.argv[1])
(folder / f"{attempt}-{index}").write_text("")
if attempt < int(sys.argv[2]):
    if index == 0:
        time.sleep(60)  # Still running when worker 1 fails: the launcher ends it.
    for _ in range(300):  # Worker 1 fails once worker 0 has started (bounded: 30 s).
        if (folder / f"{attempt}-0").exists():
            break
        time.sleep(0.1)
    sys.exit(42)
"""


def test_the_launcher_restarts_a_preempted_job_on_fewer_workers(tmp_path, uninterrupted):
    """``--nproc 2 --restart-nproc 1``: worker 1 is preempted after step 5 (its
    termination_watcher_fn), both exit 75 after the chief's checkpoint at step 6 (they agree
    every 2 steps), and the job goes on as 1 worker x 2 devices from there: the same global
    batches, and the uninterrupted run's parameters within 1e-6."""
    out = subprocess.run(
        [sys.executable, "-m", "jdist.launch", "--nproc", "2", "--devices-per-proc", "2",
         "--max-restarts", "1", "--restart-nproc", "1", PROGRAM, str(tmp_path), "0", "0"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "JDIST_TEST_STOP_AT": "5"})
    assert out.returncode == 0, out.stderr
    assert "starting the job again (1 of 1 restarts, 1 workers)" in out.stderr
    lines = [line[len("[worker 0] "):] for line in out.stdout.splitlines()
             if line.startswith("[worker 0] ")]
    reference, seen = uninterrupted
    assert [sorted(ids) for ids in steps_of(lines)] == [sorted(ids) for ids in seen]
    assert [line.split()[1] for line in lines[:8]] == "1 2 3 4 5 6 7 8".split()
    assert "[worker 1] step 7 " not in out.stdout  # The restart has no worker 1.
    with jdist.checkpoint.CheckpointManager(tmp_path) as manager:
        assert manager.all_steps() == [6]
    resumed = json.loads(lines[-1][len("done "):])
    for key, value in reference.items():
        np.testing.assert_allclose(np.asarray(resumed[key], np.float32), value, rtol=0,
                                   atol=1e-6)


@pytest.mark.parametrize("failures,status", [(1, 0), (3, 42)])
def test_the_launcher_starts_a_failed_job_again(tmp_path, failures, status):
    """``--max-restarts 2``: worker 1 fails ``failures`` times; each start runs both anew."""
    script = tmp_path / "job.py"
    script.write_text(RESTARTED)
    out = subprocess.run([sys.executable, "-m", "jdist.launch", "--nproc", "2", "--max-restarts",
                          "2", str(script), str(tmp_path), str(failures)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == status, out.stderr
    starts = min(failures, 2) + 1
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "job.py") == [
        f"{a}-{i}" for a in range(starts) for i in range(2)]
    assert out.stderr.count("starting the job again") == starts - 1
