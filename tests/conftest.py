"""Shared fixtures: strategies over 1, 2, 3, 4 and 8 of the eight simulated CPU devices.

The root ``conftest.py`` creates the devices (XLA_FLAGS) before JAX starts.
"""

import functools

import jax
import pytest

import jdist
from jdist._src import context

REPLICA_COUNTS = (1, 2, 3, 4, 8)


@functools.lru_cache(maxsize=None)
def mirrored(n):
    """A MirroredStrategy over the first ``n`` simulated devices (shared, so programs are reused)."""
    return jdist.MirroredStrategy(jax.devices()[:n])


@pytest.fixture(params=REPLICA_COUNTS, ids=lambda n: f"{n}rep")
def strategy(request):
    """A MirroredStrategy over 1, 2, 3, 4 and 8 replicas."""
    return mirrored(request.param)


@pytest.fixture(autouse=True)
def _clean_context():
    """Every test starts and ends with no strategy set."""
    jdist.experimental_set_strategy(None)
    yield
    assert not context._state.frames, "a test left a strategy scope open"
    jdist.experimental_set_strategy(None)
