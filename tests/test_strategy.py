"""Strategies: construction, devices, the default strategy and the TF1 names of the seeds."""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdist
from jdist import errors
from jdist.testing import mirrored, per_replica


def test_mirrored_defaults_to_all_local_devices():
    s = jdist.MirroredStrategy()
    assert s.num_replicas_in_sync == len(jax.local_devices()) == 8
    assert s.extended.worker_devices == tuple(jax.local_devices())
    assert s.cluster_resolver is None


@pytest.mark.parametrize("names, ids", [
    (["CPU:0", "CPU:1"], [0, 1]),
    (["/cpu:2", "/device:CPU:3"], [2, 3]),
    (["/job:localhost/replica:0/task:0/device:CPU:5"], [5]),
    ("cpu:4", [4]),
])
def test_devices_by_tf_style_name(names, ids):
    s = jdist.MirroredStrategy(names)
    assert [d.id for d in s.extended.worker_devices] == ids


def test_devices_as_jax_devices_keep_their_order():
    devices = [jax.devices()[3], jax.devices()[1]]
    s = jdist.MirroredStrategy(devices)
    assert s.extended.worker_devices == tuple(devices)
    assert s.extended.mesh.axis_names == ("replica",) and s.extended.replica_axis == "replica"


@pytest.mark.parametrize("devices, error, match", [
    (["cpu:0", "/cpu:0"], errors.InvalidArgumentError, "must not repeat"),
    (["gpu:0"], errors.UnknownDeviceError, "gpu device"),
    (["cpu:99"], errors.UnknownDeviceError, "xla_force_host_platform_device_count"),
    (["abacus:0"], errors.UnknownDeviceError, "unknown device type"),
    (["nonsense"], errors.UnknownDeviceError, "cannot parse"),
    ([], errors.InvalidArgumentError, "at least one"),
    (3.0, errors.InvalidArgumentError, "a list of devices"),
])
def test_bad_devices_are_rejected_with_a_fix(devices, error, match):
    with pytest.raises(error, match=match):
        jdist.MirroredStrategy(devices)


def test_one_device_strategy():
    s = jdist.OneDeviceStrategy("/cpu:2")
    assert s.num_replicas_in_sync == 1 and s.extended.worker_devices == (jax.devices()[2],)
    out = s.run(lambda x: x * 2, args=(jnp.ones(2),))
    assert isinstance(out, jax.Array) and next(iter(out.devices())) == jax.devices()[2]
    assert float(s.reduce("sum", out, axis=0)) == 4.0
    assert s.experimental_local_results(out) == (out,)


def test_default_strategy_is_one_replica_on_the_first_device():
    s = jdist.get_strategy()
    assert s.num_replicas_in_sync == 1
    assert s.extended.worker_devices == (jax.local_devices()[0],)
    assert s.gather(jnp.ones(2), axis=0).shape == (2,)


@pytest.mark.parametrize("n", [2, 4])
def test_extended_reduce_to_and_broadcast_to(n):
    s = mirrored(n)
    v = per_replica(s, [np.float32(i) for i in range(n)])
    mirrored_result = s.extended.reduce_to("sum", v, destinations=v)
    assert isinstance(mirrored_result, jdist.Mirrored)
    assert float(mirrored_result) == n * (n - 1) / 2
    on_device = s.extended.reduce_to("mean", v, destinations="/cpu:1")
    assert next(iter(on_device.devices())) == jax.devices()[1]
    assert float(on_device) == pytest.approx((n - 1) / 2)
    both = s.extended.batch_reduce_to("sum", [(v, v), (v, "cpu:0")])
    assert [float(x) for x in both] == [n * (n - 1) / 2] * 2
    b = s.extended.broadcast_to(jnp.ones(2), destinations=v)
    assert isinstance(b, jdist.Mirrored) and len(s.experimental_local_results(b)) == n


@pytest.mark.parametrize("n", [1, 2, 3])
def test_reduce_to_of_a_value_that_is_not_per_replica_is_tfs(n):
    # TF's reduce_non_distributed_value: a MEAN hands the value back as it is (wherever the
    # destinations are, even none); SUM on N > 1 raises, zeros too (TF gives zeros back).
    s = mirrored(n)
    assert s.extended.reduce_to("mean", 0.1, "") == 0.1  # A Python number, not float32 0.1.
    plain = np.float32([3.0, 4.0])
    assert s.extended.reduce_to("mean", plain, "cpu:0") is plain
    mirrored_value = s.extended.broadcast_to(plain, per_replica(s, [np.ones(1, np.float32)] * n))
    assert s.extended.reduce_to("mean", mirrored_value, "cpu:0") is mirrored_value
    zeros = np.zeros((2,), np.int32)
    assert s.extended.reduce_to("mean", zeros, "cpu:0") is zeros
    if n > 1:
        for value in (plain, zeros):
            with pytest.raises(errors.InvalidArgumentError, match="non-DistributedValues"):
                s.extended.reduce_to("sum", value, "cpu:0")
    else:
        assert s.extended.reduce_to("sum", plain, "cpu:0") is plain


@pytest.mark.parametrize("n", [1, 2, 3])
def test_batch_reduce_to_sums_a_plain_value_once_and_a_mirrored_one_per_copy(n):
    # TF's batch_reduce_to hands every pair to its cross-device ops: a plain value is one
    # replica's value, a Mirrored one a value on each replica.
    s = mirrored(n)
    v = per_replica(s, [np.float32([i, 1.0]) for i in range(n)])
    plain = np.float32([3.0, 4.0])
    mirrored_value = s.extended.broadcast_to(plain, v)
    got = s.extended.batch_reduce_to("sum", [(plain, v), (mirrored_value, v), (v, "cpu:0")])
    expected = [plain, n * plain, np.sum([[i, 1.0] for i in range(n)], axis=0)]
    for result, want in zip(got, expected):
        for local in s.experimental_local_results(result):
            np.testing.assert_array_equal(local, want)


def test_a_copy_of_a_strategy_is_the_strategy():
    s = mirrored(2)  # It owns devices and compiled programs, as in TF.
    assert copy.deepcopy(s) is s


# ------------------------------------------------- issue 9: local results of plain values
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_local_results_of_a_plain_nest_are_one_copy_per_replica(n):
    # TF: a nest gives num_replicas_in_sync copies; a plain array or number gives a 1-tuple.
    s = mirrored(n)
    nest = {"a": 1, "b": (2.0, "x"), "c": [None]}
    assert s.experimental_local_results(nest) == (nest,) * n
    assert s.experimental_local_results([1, 2]) == ([1, 2],) * n
    x = jnp.arange(3.0)
    results = s.experimental_local_results(x)
    assert len(results) == 1 and results[0] is x
    assert s.experimental_local_results(7) == (7,)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_local_results_of_a_mixed_nest_unpack_each_replica(n):
    s = mirrored(n)
    v = per_replica(s, [np.float32(i) for i in range(n)])
    results = s.experimental_local_results({"v": v, "k": 5})
    assert [(float(r["v"]), r["k"]) for r in results] == [(float(i), 5) for i in range(n)]


def test_local_results_of_a_nest_of_another_strategys_values_raises():
    v = per_replica(mirrored(2), [np.float32(0), np.float32(1)])
    with pytest.raises(errors.InvalidArgumentError, match="replicas"):
        mirrored(4).experimental_local_results([v])


@pytest.mark.parametrize("make", [lambda: jdist.MirroredStrategy(jax.devices()[3:4]),
                                  lambda: jdist.OneDeviceStrategy("cpu:3")],
                         ids=["mirrored", "one_device"])
def test_one_replica_values_from_function_are_placed_on_its_device(make):
    # As TF's: OneDeviceStrategy hands the value back as it is, MirroredStrategy wraps it in
    # a PerReplica of one (arithmetic on it outside run raises; a MEAN of ints is float64);
    # either way on the replica's device, where run takes it, and a Python number's local
    # result is the number.
    s = make()
    v = s.experimental_distribute_values_from_function(
        lambda ctx: {"x": np.arange(3, dtype=np.float32), "k": 2})
    wrapped = isinstance(s, jdist.MirroredStrategy)
    assert isinstance(v["x"], jdist.PerReplica) == wrapped == isinstance(v["k"], jdist.PerReplica)
    (x,) = s.experimental_local_results(v["x"])
    assert x.devices() == {jax.devices()[3]}
    np.testing.assert_array_equal(x, [0., 1., 2.])
    assert s.experimental_local_results(v["k"]) == (2,)
    np.testing.assert_array_equal(s.run(lambda x: x * 2, args=(v["x"],)), [0., 2., 4.])
    if wrapped:
        with pytest.raises(errors.CrossReplicaArithmeticError):
            v["x"] + 1


_ENTRY_POINTS = {
    "reduce": lambda s, v: s.reduce("sum", v, axis=None),
    "reduce_mean": lambda s, v: s.reduce("mean", v, axis=None),
    "gather": lambda s, v: s.gather(v, axis=0),
    "run": lambda s, v: s.run(lambda x: x * 2, args=(v,)),
    "run_in_function": lambda s, v: jdist.function(lambda x: s.run(lambda y: y * 2, args=(x,)))(v),
    "reduce_to": lambda s, v: s.extended.reduce_to("sum", v, "cpu:0"),
    "batch_reduce_to": lambda s, v: s.extended.batch_reduce_to("sum", [(v, "cpu:0")]),
}


@pytest.mark.parametrize("made_on, used_on", [(2, 3), (3, 2), (1, 4), (8, 4)])
@pytest.mark.parametrize("kind", ["step_output", "mirror", "per_replica"])
@pytest.mark.parametrize("entry", sorted(_ENTRY_POINTS))
def test_a_value_of_another_strategy_raises_at_every_entry_point(made_on, used_on, kind, entry):
    # Issue 50: s3.reduce("sum", m) of a 2-replica Mirrored gave 15.0 (TF: 10.0, the sum of its
    # own 2 copies; TF's s3.run raises IndexError). No number of s3 is right: jdist raises.
    made = mirrored(made_on)
    value = {"step_output": lambda: made.run(lambda: jnp.float32([5.0])),
             "mirror": lambda: jdist.mirror(np.float32([5.0]), made),
             "per_replica": lambda: jdist.testing.per_replica(
                 made, [np.float32([i]) for i in range(made_on)])}[kind]()
    if made_on == 1 and kind != "mirror":
        value = jdist.Mirrored([np.float32([5.0])])  # One replica's outputs are plain arrays.
    if made_on == 1 and kind != "mirror" and entry == "run_in_function":
        # jax.jit rebuilds a Mirrored without its count; a host value takes the strategy's.
        out = _ENTRY_POINTS[entry](mirrored(used_on), value)
        np.testing.assert_array_equal(np.stack(out.values), [[10.0]] * used_on)
        return
    with pytest.raises(jdist.errors.InvalidArgumentError,
                       match=f"of {made_on} replicas on a strategy of {used_on}"):
        _ENTRY_POINTS[entry](mirrored(used_on), value)
