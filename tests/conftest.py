"""Shared fixtures: strategies over several of the eight simulated CPU devices.

The root ``conftest.py`` creates the devices (XLA_FLAGS) before JAX starts.
"""

import pytest

import jdist
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
