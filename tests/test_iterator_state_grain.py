"""A grain iterator's position in a jdist checkpoint (issue 48; skipped without grain).

``experimental_distribute_dataset(iter(grain_dataset), InputOptions(experimental_per_replica_
buffer_size=0))``: the step holds grain's ``get_state()``, and a restore continues a new
``iter(grain_dataset)`` there on another replica count, with the uninterrupted read's global
batches; a prefetching dataset is refused at the save, and a restore into another kind of
pipeline is refused, both typed.
"""

import jax
import numpy as np
import pytest

import jdist
from jdist import errors

grain = pytest.importorskip("grain")
pytest.importorskip("orbax.checkpoint")

UNBUFFERED = jdist.InputOptions(experimental_per_replica_buffer_size=0)


def pipeline():
    return grain.MapDataset.range(60).shuffle(seed=3).map(lambda i: (i, 2 * i)).batch(6)


def distributed(strategy, options=UNBUFFERED):
    return strategy.experimental_distribute_dataset(iter(pipeline()), options)


def test_a_grain_iterator_resumes_on_another_replica_count(tmp_path):
    straight = [np.asarray(x).tolist() for x, _ in pipeline()]
    first, second = (jdist.MirroredStrategy(jax.local_devices()[:n]) for n in (2, 3))
    it = iter(distributed(first))
    before = [np.asarray(first.gather(next(it)[0], axis=0)).tolist() for _ in range(4)]
    with jdist.checkpoint.CheckpointManager(tmp_path, first) as manager:
        manager.save(4, {"w": np.float32(4)}, iterator=it)
    with jdist.checkpoint.CheckpointManager(tmp_path, second) as manager:
        _, resumed = manager.restore({"w": np.float32(0)}, iterator=distributed(second))
        with pytest.raises(errors.InvalidArgumentError, match="saved iterator read grain"):
            manager.restore({"w": np.float32(0)}, iterator=second.experimental_distribute_dataset(
                second.experimental_make_numpy_dataset(np.arange(60)).batch(6)))
    after = [np.asarray(second.gather(x, axis=0)).tolist() for x, _ in resumed]
    assert before == straight[:4] and after == straight[4:]


def test_a_prefetching_grain_iterator_is_refused_at_the_save(tmp_path):
    strategy = jdist.MirroredStrategy(jax.local_devices()[:2])
    it = iter(distributed(strategy, jdist.InputOptions()))
    next(it)
    with jdist.checkpoint.CheckpointManager(tmp_path, strategy) as manager:
        with pytest.raises(errors.InvalidArgumentError, match="buffer_size=0"):
            manager.save(1, {"w": np.float32(0)}, iterator=it)
        assert manager.latest_step is None
