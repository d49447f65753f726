"""Cluster resolvers (``tf.distribute.cluster_resolver``); see :mod:`jdist._src.multi_worker.cluster_resolver`."""

from jdist._src.multi_worker.cluster_resolver import ClusterResolver
from jdist._src.multi_worker.cluster_resolver import ClusterSpec
from jdist._src.multi_worker.cluster_resolver import SimpleClusterResolver
from jdist._src.multi_worker.cluster_resolver import TFConfigClusterResolver
from jdist._src.multi_worker.slurm import SlurmClusterResolver

__all__ = (
    "ClusterResolver",
    "ClusterSpec",
    "SimpleClusterResolver",
    "SlurmClusterResolver",
    "TFConfigClusterResolver",
)
