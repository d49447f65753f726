"""jdist.experimental.PreemptionCheckpointHandler (issue 48): a training process sent SIGTERM
mid-epoch saves at the next step boundary and exits with the configured code; a second process,
on another replica count, resumes there and ends with the uninterrupted run's parameters."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

import jdist
from jdist import errors

pytest.importorskip("orbax.checkpoint")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _preemption_program as program  # noqa: E402

PROGRAM = str(pathlib.Path(program.__file__))


def start(directory, replicas, delay):
    return subprocess.Popen([sys.executable, PROGRAM, str(directory), str(replicas), str(delay)],
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


def test_sigterm_mid_epoch_saves_exits_and_resumes_on_another_replica_count(tmp_path):
    seen = []
    reference = program.train(tmp_path / "straight", 2,
                              report=lambda step, ids: seen.append(ids))
    directory = tmp_path / "preempted"
    first = start(directory, 2, 0.3)
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

    code, lines, err = finish(start(directory, 3, 0.0))
    assert code == 0, err
    assert before + steps_of(lines) == seen
    resumed = json.loads(lines[-1][len("done "):])
    for key, value in reference.items():
        np.testing.assert_allclose(np.asarray(resumed[key], np.float32), value, rtol=0,
                                   atol=1e-6)


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
(pathlib.Path(sys.argv[1]) / f"{attempt}-{index}").write_text("")
if attempt < int(sys.argv[2]):
    sys.exit(42) if index == 1 else time.sleep(60)  # Worker 0 is still running: ended.
"""


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
