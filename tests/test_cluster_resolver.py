"""Cluster resolvers: TF_CONFIG read lazily, overrides, SLURM's environment, ClusterSpec."""

import json

import pytest

import jdist
from jdist import cluster_resolver as cr
from jdist.errors import InvalidArgumentError

CLUSTER = {"chief": ["c:1000"], "worker": ["w0:1001", "w1:1002"]}


def _set(monkeypatch, **config):
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))


def test_top_level_exports():
    assert jdist.TFConfigClusterResolver is cr.TFConfigClusterResolver
    assert jdist.cluster_resolver.SlurmClusterResolver is cr.SlurmClusterResolver
    assert jdist.ClusterSpec is cr.ClusterSpec


def test_tf_config_read_at_each_access(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    r = cr.TFConfigClusterResolver()
    assert (r.task_type, r.task_id, r.rpc_layer) == (None, None, None)
    assert r.cluster_spec().as_dict() == {} and not r.cluster_spec()
    assert r.master() == ""
    _set(monkeypatch, cluster=CLUSTER, task={"type": "worker", "index": 1}, rpc_layer="grpc")
    assert (r.task_type, r.task_id, r.rpc_layer) == ("worker", 1, "grpc")
    assert r.cluster_spec() == cr.ClusterSpec(CLUSTER)
    assert r.master() == "grpc://w1:1002"
    assert r.master("chief", 0, rpc_layer="http") == "http://c:1000"
    monkeypatch.setenv("TF_CONFIG", "")
    assert r.task_type is None and r.cluster_spec().jobs == []


def test_tf_config_overrides_and_setters(monkeypatch):
    _set(monkeypatch, cluster=CLUSTER, task={"type": "worker", "index": 1})
    r = cr.TFConfigClusterResolver(task_type="chief", task_id=0, rpc_layer="grpc",
                                   environment="google")
    assert (r.task_type, r.task_id, r.rpc_layer, r.environment) == ("chief", 0, "grpc", "google")
    assert r.master() == "grpc://c:1000"
    r.task_type, r.task_id, r.rpc_layer = "worker", 0, None
    assert r.master() == "w0:1001"


def test_tf_config_session_master_and_single_task(monkeypatch):
    _set(monkeypatch, cluster=CLUSTER, task={"type": "worker", "index": 0},
         session_master="grpc://m:9")
    assert cr.TFConfigClusterResolver().master() == "grpc://m:9"
    _set(monkeypatch, cluster={"worker": ["only:1"]}, task={"type": "worker", "index": 0})
    assert cr.TFConfigClusterResolver().master() == ""
    assert cr.TFConfigClusterResolver().num_accelerators() == {}  # CPU devices are not counted.


def test_tf_config_invalid(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", "{not json")
    with pytest.raises(InvalidArgumentError, match="not valid JSON"):
        cr.TFConfigClusterResolver().cluster_spec()
    monkeypatch.setenv("TF_CONFIG", "[1]")
    with pytest.raises(InvalidArgumentError, match="JSON object"):
        cr.TFConfigClusterResolver().task_type


def test_cluster_spec_surface():
    spec = cr.ClusterSpec({"ps": {1: "p1:1", 3: "p3:1"}, "worker": ("a:1", "b:2")})
    assert spec.jobs == ["ps", "worker"]
    assert spec.num_tasks("ps") == 2 and spec.task_indices("ps") == [1, 3]
    assert spec.job_tasks("ps") == [None, "p1:1", None, "p3:1"]
    assert spec.as_dict() == {"ps": {1: "p1:1", 3: "p3:1"}, "worker": ["a:1", "b:2"]}
    assert cr.ClusterSpec(spec) == spec and spec != cr.ClusterSpec({})
    assert hash(cr.ClusterSpec(spec)) == hash(spec)
    assert cr.ClusterSpec({"w": {"0": "a:1"}}).as_dict() == {"w": ["a:1"]}  # JSON keys
    with pytest.raises(InvalidArgumentError, match="no such job"):
        spec.num_tasks("chief")
    with pytest.raises(InvalidArgumentError, match="no task with index 2"):
        spec.task_address("worker", 2)
    for bad in ({1: ["a"]}, {"w": "a:1"}, {"w": [1]}, {"w": {-1: "a"}}, ["w"]):
        with pytest.raises(InvalidArgumentError):
            cr.ClusterSpec(bad)


def test_simple_cluster_resolver():
    r = cr.SimpleClusterResolver(cr.ClusterSpec(CLUSTER), master="m:1", task_type="worker",
                                 task_id=1, num_accelerators={"GPU": 2}, rpc_layer="grpc")
    assert r.cluster_spec().as_dict() == CLUSTER
    assert r.master() == "grpc://m:1" and r.master("worker", 0) == "grpc://w0:1001"
    assert r.num_accelerators() == {"GPU": 2} and r.environment == ""
    assert cr.SimpleClusterResolver(CLUSTER).num_accelerators() == {}


def _slurm(monkeypatch, procid, ntasks, nodes, per_node, **extra):
    for key in ("SLURM_GPUS_ON_NODE", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SLURM_PROCID", str(procid))
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", str(ntasks))
    monkeypatch.setenv("SLURM_STEP_NODELIST", nodes)
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", per_node)
    for key, value in extra.items():
        monkeypatch.setenv(key, value)


def test_slurm_cluster_resolver(monkeypatch):
    _slurm(monkeypatch, 3, 4, "gpu[07-08]", "2(x2)", SLURM_GPUS_ON_NODE="4")
    r = cr.SlurmClusterResolver(jobs={"chief": 1, "worker": 3}, port_base=9000)
    assert r.cluster_spec().as_dict() == {
        "chief": ["gpu07:9000"], "worker": ["gpu07:9001", "gpu08:9000", "gpu08:9001"]}
    assert r.get_task_info() == ("worker", 2) and (r.task_type, r.task_id) == ("worker", 2)
    assert r.master() == "grpc://gpu08:9001" and r.master("chief", 0, "") == "grpc://gpu07:9000"
    assert r.num_accelerators() == {"GPU": 2}
    import os
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"  # The node's second task: GPUs 2 and 3.


def test_slurm_errors_and_parsing(monkeypatch):
    from jdist._src.multi_worker import slurm
    assert slurm.expand_hostlist("a[1-2]b[3-4],c,d[9]") == ["a1b3", "a1b4", "a2b3", "a2b4", "c",
                                                           "d9"]
    assert slurm.expand_tasks_per_node("3,1(x2)") == [3, 1, 1]
    with pytest.raises(InvalidArgumentError):
        slurm.expand_tasks_per_node("2(y3)")
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    with pytest.raises(InvalidArgumentError, match="SLURM_PROCID is not set"):
        cr.SlurmClusterResolver()
    _slurm(monkeypatch, 0, 2, "n1", "2")
    with pytest.raises(InvalidArgumentError, match="ask for 3 tasks"):
        cr.SlurmClusterResolver(jobs={"worker": 3})
    with pytest.raises(InvalidArgumentError, match="more than the 1 GPUs"):
        cr.SlurmClusterResolver(gpus_per_node=1, gpus_per_task=1)
    r = cr.SlurmClusterResolver(tasks_per_node=2)
    assert r.num_accelerators() == {} and r.cluster_spec().num_tasks("worker") == 2
