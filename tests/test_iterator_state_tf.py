"""A tf.data iterator's position in a jdist checkpoint (issue 48; skipped without TensorFlow).

``experimental_distribute_dataset(iter(tf_dataset), InputOptions(experimental_per_replica_
buffer_size=0))``: ``manager.save(step, state, iterator=it)`` puts tf.data's own checkpoint of
that iterator into the step, and ``manager.restore(state, iterator=dist_dataset)`` continues a
new one there, on another replica count: the same global batches as the uninterrupted read. A
prefetching dataset (the default buffer), whose tf.data iterator is ahead of the steps, is
refused at the save, typed, instead of resuming batches later.
"""

import os

import jax
import numpy as np
import pytest

import jdist
from jdist import errors

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from _tf_skip import tf_or_skip  # noqa: E402

tf = tf_or_skip()
pytest.importorskip("orbax.checkpoint")

UNBUFFERED = jdist.InputOptions(experimental_per_replica_buffer_size=0)


def pipeline():
    return tf.data.Dataset.range(60).shuffle(60, seed=3).map(lambda i: (i, i * 2)).batch(6)


def distributed(strategy, options=UNBUFFERED):
    return strategy.experimental_distribute_dataset(iter(pipeline()), options)


def global_batches(strategy, iterator):
    return [np.asarray(strategy.gather(x, axis=0)).tolist() for x, _ in iterator]


@pytest.mark.parametrize("saved_on,resumed_on", [(2, 3), (4, 1)])
def test_a_tf_data_iterator_resumes_on_another_replica_count(tmp_path, saved_on, resumed_on):
    first = jdist.MirroredStrategy(jax.local_devices()[:saved_on])
    straight = [b.reshape(-1).tolist() for b, _ in pipeline().as_numpy_iterator()]
    it = iter(distributed(first))
    before = [np.asarray(first.gather(next(it)[0], axis=0)).tolist() for _ in range(4)]
    state = jdist.mirror({"w": np.float32(4)}, first)
    with jdist.checkpoint.CheckpointManager(tmp_path, first) as manager:
        manager.save(4, state, iterator=it)
    assert global_batches(first, it) == straight[4:]  # Saving took nothing from it.
    second = jdist.MirroredStrategy(jax.local_devices()[:resumed_on])
    with jdist.checkpoint.CheckpointManager(tmp_path, second) as manager:
        restored, resumed = manager.restore(jdist.mirror({"w": np.float32(0)}, second),
                                            iterator=distributed(second))
    assert before == straight[:4] and global_batches(second, resumed) == straight[4:]
    assert float(jdist.to_host(restored)["w"]) == 4.0


def test_a_prefetching_tf_data_iterator_is_refused_at_the_save(tmp_path):
    strategy = jdist.MirroredStrategy(jax.local_devices()[:2])
    state = jdist.mirror({"w": np.float32(0)}, strategy)
    it = iter(distributed(strategy, jdist.InputOptions()))
    next(it)
    with jdist.checkpoint.CheckpointManager(tmp_path, strategy) as manager:
        with pytest.raises(errors.InvalidArgumentError, match="buffer_size=0"):
            manager.save(1, state, iterator=it)
        early = distributed(strategy)
        assert early.element_spec is not None  # Reads the first batch ahead of the steps.
        with pytest.raises(errors.InvalidArgumentError, match="element_spec"):
            manager.save(1, state, iterator=iter(early))
        assert manager.latest_step is None


def test_a_tf_dataset_itself_is_still_refused_naming_the_iterator_form(tmp_path):
    strategy = jdist.MirroredStrategy(jax.local_devices()[:2])
    it = iter(strategy.experimental_distribute_dataset(pipeline()))
    with jdist.checkpoint.CheckpointManager(tmp_path, strategy) as manager:
        with pytest.raises(errors.InvalidArgumentError, match=r"iter\(tf_dataset\)"):
            manager.save(1, jdist.mirror({"w": np.float32(0)}, strategy), iterator=it)
