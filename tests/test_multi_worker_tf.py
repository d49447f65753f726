"""jdist's MultiWorkerMirroredStrategy against TF's, both as 2 worker processes x 1 CPU replica
on loopback: the same distributed datasets (TF's default auto-sharding by data and by file, OFF,
a worker whose data ends first, statically shaped batches, a PER_WORKER pipeline) and ragged values
from a function give each worker the same per-replica batches, all-reduced sums, gathered batches,
cardinality and end of data, TF's custom training loop (a partial last batch leaving one
worker's replica empty) the same losses and weights, and the strategy's surface (replica and
device counts, chief-only checkpoints and summaries, every worker initialising, the task) the
same values. Every process is
bounded in time and ended by this test, by PID (`test_multi_worker._finish`)."""

import json
import os
import sys

import numpy as np

from jdist.launch import free_ports
from _tf_skip import tf_or_skip
from test_multi_worker import _env
from test_multi_worker import _finish
from test_multi_worker import _start

tf = tf_or_skip()

PROGRAM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_multi_worker_tf_program.py")
TIMEOUT = 180


def _record_files(tmp_path):
    """Three TFRecord files of five int64 scalars each (file f holds 100 f, ..., 100 f + 4)."""
    files = []
    for f in range(3):
        files.append(str(tmp_path / f"part{f}.tfrecord"))
        with tf.io.TFRecordWriter(files[-1]) as writer:
            for i in range(5):
                writer.write(tf.io.serialize_tensor(tf.constant(100 * f + i, tf.int64)).numpy())
    return files


def test_datasets_across_workers_equal_tf_s(tmp_path):
    files = _record_files(tmp_path)
    tf_out, jdist_out = str(tmp_path / "tf"), str(tmp_path / "jdist")
    ports = free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    tf_workers = [_start([sys.executable, PROGRAM, "tf", tf_out, *files], _env(
        1, TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})))
        for i in range(2)]
    logs = _finish(tf_workers, TIMEOUT)
    assert all(p.returncode == 0 for p in tf_workers), logs
    launcher = _start([sys.executable, "-m", "jdist.launch", "--nproc", "2", "--devices-per-proc",
                       "1", PROGRAM, "jdist", jdist_out, *files], _env(1))
    logs = _finish([launcher], TIMEOUT)
    assert launcher.returncode == 0, logs
    for worker in range(2):
        expected = json.load(open(f"{tf_out}.{worker}", encoding="utf-8"))
        got = json.load(open(f"{jdist_out}.{worker}", encoding="utf-8"))
        assert got.keys() == expected.keys()
        for name in expected:
            if name != "_training":
                assert got[name] == expected[name], (worker, name)
        for key in ("losses", "w"):  # TF's matmul and XLA's dot may round differently.
            np.testing.assert_allclose(got["_training"][key], expected["_training"][key],
                                       rtol=1e-6, atol=1e-7)
    # What the cases are for: worker 1's file pipeline ends first and takes part with empty
    # batches; DATA splits each global batch of 7 rows 4 / 3.
    tf_1 = json.load(open(f"{tf_out}.1", encoding="utf-8"))
    assert [s["local"] for s in tf_1["files"]["steps"]][-2:] == [[[]], [[]]]
    assert tf_1["range"]["steps"][0]["local"] == [[4, 5, 6]]
