"""Root pytest setup (tests and doctests): eight simulated CPU devices, set before JAX starts."""

import importlib.util
import os

import pytest

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


# Doctests of the features of an extra (jdist[progress], jdist[checkpoint]): skipped where it is
# not installed (`pip install -e '.[test]'`), as the tests of those features skip.
_EXTRA_DOCTESTS = {"jdist._src.progress.ProgressBar": "tqdm",
                   "jdist._src.checkpoint.CheckpointManager": "orbax"}


def pytest_collection_modifyitems(items):
    for item in items:
        module = _EXTRA_DOCTESTS.get(item.name)
        if module and importlib.util.find_spec(module) is None:
            item.add_marker(pytest.mark.skip(reason=f"needs {module}, an extra of jdist"))
