"""Destinations of every process: TF device names with a job and task, and the typed error for
a device of another worker.

The placement itself across processes is compared in ``test_multi_worker.py`` (2 workers x 2
devices against 1 process x 4 devices); these are the parts one process can check.
"""

import collections

import jax
import numpy as np
import pytest

import jdist
from jdist import errors
from jdist._src.reduce import destinations
from jdist._src import devices
from jdist.testing import REPLICA_COUNTS, mirrored, per_replica

FakeDevice = collections.namedtuple("FakeDevice", "process_index platform id")
FAKES = [FakeDevice(p, "cpu", 10 * p + i) for p in range(3) for i in range(2)]
TASKS = [("chief", 0), ("worker", 0), ("worker", 1)]


@pytest.fixture
def two_workers():
    """A registered cluster of 2 workers while the test runs (this process is worker 0)."""
    devices.register_cluster([("worker", 0), ("worker", 1)])
    yield
    devices.register_cluster([])


@pytest.mark.parametrize("job, task, process", [("chief", 0, 0), ("worker", 0, 1),
                                                ("worker", 1, 2)])
def test_find_process(job, task, process):
    assert devices.find_process(job, task, TASKS) == process


@pytest.mark.parametrize("job, task", [("worker", 2), ("ps", 0), ("localhost", 1)])
def test_find_process_unknown_task(job, task):
    with pytest.raises(errors.UnknownDeviceError, match="is not a worker of this job"):
        devices.find_process(job, task, TASKS)


@pytest.mark.parametrize("process, index, device_id", [(0, 1, 1), (2, 0, 20), (1, 1, 11)])
def test_find_device(process, index, device_id):
    assert devices.find_device(FAKES, process, "cpu", index, "spec").id == device_id


@pytest.mark.parametrize("process, platform, index", [(1, "cpu", 2), (1, "gpu", 0),
                                                      (3, "cpu", 0)])
def test_find_device_missing(process, platform, index):
    with pytest.raises(errors.UnknownDeviceError, match=f"of worker {process}"):
        devices.find_device(FAKES, process, platform, index, "spec")


@pytest.mark.parametrize("spec, index", [
    ("/job:localhost/replica:0/task:0/device:CPU:3", 3), ("CPU:2", 2), ("/cpu:1", 1),
    ("/job:worker/replica:0/task:0/device:CPU:5", 5)])
def test_resolve_any_on_one_process(spec, index):
    assert devices.resolve_any(spec) == jax.devices()[index]
    assert destinations.resolve(spec).devices == (jax.devices()[index],)


def test_resolve_any_names_workers_of_the_cluster(two_workers):
    del two_workers
    assert devices.resolve_any("/job:worker/replica:0/task:0/device:CPU:4") == jax.devices()[4]
    with pytest.raises(errors.UnknownDeviceError, match="cpu device 0 of worker 1, which has 0"):
        destinations.resolve("/job:worker/replica:0/task:1/device:CPU:0")
    with pytest.raises(errors.UnknownDeviceError, match="not a worker of this job"):
        jdist.ReductionToOneDevice(reduce_to_device="/job:worker/task:7/device:CPU:0").reduce(
            jdist.ReduceOp.SUM, per_replica(mirrored(2), [np.ones(1, np.float32)] * 2), "CPU:0")


@pytest.mark.parametrize("spec", ["/job:worker/task:1/device:TPUX:0", "/job:worker/task:1/x"])
def test_resolve_any_bad_names(spec, two_workers):
    del two_workers
    with pytest.raises(errors.UnknownDeviceError):
        devices.resolve_any(spec)


@pytest.mark.parametrize("spec", ["CPU:1", "/job:worker/replica:0/task:0/device:CPU:1"])
def test_another_workers_device_is_a_typed_error(spec, monkeypatch):
    # This process's devices stand for another worker's when it pretends to be worker 1.
    v = per_replica(mirrored(2), [np.ones(1, np.float32)] * 2)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    for call in (lambda: destinations.resolve(spec),
                 lambda: jdist.NcclAllReduce().reduce(jdist.ReduceOp.SUM, v, spec),
                 lambda: jdist.NcclAllReduce().broadcast(np.float32(1), jax.devices()[1])):
        with pytest.raises(errors.InvalidArgumentError, match="results go to this worker's"):
            call()


@pytest.mark.parametrize("n", REPLICA_COUNTS)
def test_a_merge_functions_value_is_a_destination(n):
    # TF takes a tensor as destinations; on one replica merge_fn's value is one (here traced),
    # on several a PerReplica: either stands for the strategy's devices.
    s = mirrored(n)
    comps = [np.float32([1, 2]) * (r + 1) for r in range(n)]
    v = per_replica(s, comps) if n > 1 else comps[0]

    def step(x):
        return jdist.get_replica_context().merge_call(lambda st, v: (
            st.extended.reduce_to("SUM", v, destinations=v),
            st.extended.batch_reduce_to("MEAN", [(v, v), (v, v)])), args=(x,))
    total, means = s.run(step, args=(v,))
    for got in s.experimental_local_results(total):
        np.testing.assert_array_equal(got, np.sum(comps, axis=0))
    for mean in means:
        for got in s.experimental_local_results(mean):
            np.testing.assert_array_equal(got, np.mean(comps, axis=0))
