"""Shared fixtures: strategies over several of the eight simulated CPU devices.

The root ``conftest.py`` creates the devices (XLA_FLAGS) before JAX starts.
"""

import pytest

import jdist
from _tf_skip import REASON as TF_SKIP_REASON
from jdist._src import context
from jdist.testing import DATASET_REPLICA_COUNTS, mirrored


@pytest.fixture(params=DATASET_REPLICA_COUNTS, ids=lambda n: f"{n}rep")
def s(request):
    """A MirroredStrategy over 1, 2, 3, 4, 5 and 8 replicas (the dataset tests' counts)."""
    return mirrored(request.param)


@pytest.fixture(autouse=True)
def _clean_context():
    """Every test starts and ends with no strategy set."""
    jdist.experimental_set_strategy(None)
    yield
    assert not context._state.frames, "a test left a strategy scope open"
    jdist.experimental_set_strategy(None)


def pytest_terminal_summary(terminalreporter):
    """Ends a session that skipped comparisons with TensorFlow with a line saying how to run them
    (a test file skipped whole counts once, though pytest reports it as a module and a doctest
    module)."""
    skips = [r for r in terminalreporter.stats.get("skipped", ())
             if TF_SKIP_REASON in str(r.longrepr)]
    files = {r.longrepr[0] for r in skips if r.when == "collect"}
    tests = sum(r.when != "collect" for r in skips)
    if files or tests:
        counts = [f"{n} {what}{'s' * (n != 1)}"
                  for n, what in ((tests, "test"), (len(files), "test file")) if n]
        terminalreporter.write_line(f"{' and '.join(counts)} compare with TensorFlow and were "
                                    "skipped: run `make test-tf`")
