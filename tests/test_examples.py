"""Smoke tests of the examples, with few epochs, asserting their numbers."""

import importlib.util
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

pytest.importorskip("sklearn")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))

import side_by_side_tf  # noqa: E402
import train_digits_resumable  # noqa: E402

import jdist  # noqa: E402


def test_resumable_digits_ends_where_an_uninterrupted_run_does(tmp_path):
    """Stopped mid-epoch (step 9 of 2 x 6) on 2 replicas, resumed on 3."""
    pytest.importorskip("orbax.checkpoint")
    common = ["--epochs", "2", "--batch-size", "256", "--save-every", "4"]

    def train(directory, *extra):
        return train_digits_resumable.train(train_digits_resumable.parse_args(
            [*common, "--checkpoint-dir", str(tmp_path / directory), *extra]))

    step, straight, accuracy = train("straight", "--replicas", "2")
    assert step == 12 and accuracy > 0.8
    assert train("resumed", "--replicas", "2", "--stop-at-step", "9")[0] == 9
    assert sorted(int(p.name) for p in (tmp_path / "resumed").iterdir()) == [4, 8, 9]
    step, resumed, resumed_accuracy = train("resumed", "--replicas", "3")
    assert step == 12 and resumed_accuracy == accuracy
    for a, b in zip(jax.tree_util.tree_leaves(jdist.to_host(straight)),
                    jax.tree_util.tree_leaves(jdist.to_host(resumed))):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_flax_nnx_training_matches_one_device():
    pytest.importorskip("flax")
    import train_flax_nnx  # pylint: disable=import-outside-toplevel
    one, _ = train_flax_nnx.train(replicas=1, epochs=1, learning_rate=1e-2)
    four, accuracy = train_flax_nnx.train(replicas=4, epochs=1, learning_rate=1e-2)
    assert len(four) == 1437 // 128
    np.testing.assert_allclose(four, one, rtol=1e-4)
    assert four[-1] < four[0] / 4 and accuracy > 0.85


def test_side_by_side_matches_numpy(capsys):
    x, y = side_by_side_tf.make_data(6)
    np.testing.assert_allclose(side_by_side_tf.jdist_losses(x, y, 4),
                               side_by_side_tf.numpy_losses(x, y), rtol=1e-5)
    assert side_by_side_tf.main(["--replicas", "2", "--steps", "4"]) == 0
    out = capsys.readouterr().out
    has_tf = importlib.util.find_spec("tensorflow") is not None
    assert ("tf.distribute" in out.splitlines()[-6]) == has_tf
    assert ("TensorFlow is not installed" in out) != has_tf


def test_exact_evaluation_counts_every_image_once():
    """examples/evaluate_digits.py (its own process: it sets up its devices when imported), whose
    last batch leaves a replica empty: the exact accuracy is the single-device one."""
    script = pathlib.Path(__file__).resolve().parents[1] / "examples" / "evaluate_digits.py"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run([sys.executable, str(script), "--epochs", "1"], env=env, timeout=300,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "rows per replica [2, 2, 2, 2, 2, 2, 1, 0]" in done.stdout
    lines = dict(line.split(":", 1) for line in done.stdout.splitlines() if ":" in line)
    exact = float(lines["exact test accuracy"].split()[0])
    assert exact == float(lines["single-device reference"]) and exact > 0.8
