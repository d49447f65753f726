"""The documentation a clone carries: no links outside the repository, the dataset verbs, the
exported names and the packaging metadata (issue 9, items 15, 17, 18)."""

import importlib.util
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

import jdist

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_docs_link_only_files_of_the_repository(path):
    text = path.read_text()
    assert "../shared" not in text and "shared/notes" not in text
    for target in re.findall(r"`((?:docs|benchmarks|examples|tests|jdist)/[\w./]+)`", text):
        assert (ROOT / target).exists(), f"{path.name} names {target}, which does not exist"


@pytest.mark.parametrize("verb", ["shuffle(buffer_size, seed=None", "batch(batch_size, "
                                  "drop_remainder=False)", "repeat(count=None)", "take(count)",
                                  "skip(count)", "shard(num_shards, index)",
                                  "prefetch(buffer_size=None)"])
def test_api_documents_the_dataset_verbs(verb):
    assert f"`{verb}" in (ROOT / "docs" / "api.md").read_text()


def test_numpy_dataset_type_is_exported():
    ds = jdist.get_strategy().experimental_make_numpy_dataset(np.arange(3))
    assert isinstance(ds, jdist.NumpyDataset) and "NumpyDataset" in jdist.__all__
    assert [b.tolist() for b in jdist.NumpyDataset(np.arange(3)).batch(2)] == [[0, 1], [2]]


def test_license_is_an_spdx_string():
    # The table form `license = { text = ... }` makes setuptools >= 77 print a deprecation
    # warning on every pip install.
    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^license = "Apache-2.0"$', text, re.M)
    assert re.search(r'requires = \["setuptools>=77', text)


def test_a_session_without_tensorflow_says_how_to_run_the_comparisons():
    """`make test` has no TensorFlow: each skip and the session's last lines name `make test-tf`
    (a test file skipped whole counts once; 3 parametrized tests count 3)."""
    if importlib.util.find_spec("tensorflow") is not None:
        pytest.skip("TensorFlow is installed: the comparisons run")
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-rs", "tests/test_tf_losses.py",
         "tests/test_auto_shard.py::test_a_policy_asked_in_input_options_is_tf_s"],
        cwd=ROOT, capture_output=True, text=True, timeout=120).stdout
    lines = out.splitlines()
    assert lines[-1].startswith("5 skipped in "), out  # pytest counts the file as 2 modules.
    assert "3 tests and 1 test file compare with TensorFlow and were skipped: run `make test-tf`" \
        in lines, out
    reason = "compares with TensorFlow, which is not installed: run `make test-tf`"
    assert [re.sub(r"\.py:\d+:", ".py:", line) for line in lines if "SKIPPED" in line] == [
        f"SKIPPED [2] tests/test_tf_losses.py: {reason}",
        f"SKIPPED [3] tests/test_auto_shard.py: {reason}"], out
