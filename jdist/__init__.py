"""jdist: TensorFlow's tf.distribute API for JAX.

Strategies (`MirroredStrategy`, `OneDeviceStrategy`) replicate a step function over devices as
one compiled SPMD program; distributed values (`PerReplica`, `Mirrored`) are thin wrappers around
sharded ``jax.Array`` s; ``reduce`` / ``all_reduce`` lower to ``lax.psum`` / ``lax.pmean``.

Example:
  >>> import jax.numpy as jnp, jdist
  >>> strategy = jdist.MirroredStrategy(["cpu:0"])
  >>> def step(x):
  ...   return jdist.get_replica_context().all_reduce("sum", x * 2)
  >>> float(strategy.run(step, args=(jnp.float32(1.5),)))
  3.0
"""

from jdist import checkpoint
from jdist import cluster_resolver
from jdist import errors
from jdist import experimental
from jdist import nn
from jdist._src.input.auto_shard import AutoShardPolicy
from jdist._src.multi_worker.cluster_resolver import (ClusterResolver, ClusterSpec,
                                                      SimpleClusterResolver,
                                                      TFConfigClusterResolver)
from jdist._src.context import (experimental_set_strategy, get_replica_context, get_strategy,
                                has_strategy, in_cross_replica_context, ReplicaContext,
                                ValueContext)
from jdist._src.reduce.cross_device_ops import (CrossDeviceOps, HierarchicalCopyAllReduce,
                                                NcclAllReduce, ReductionToOneDevice)
from jdist._src.dispatch import function
from jdist._src.input.datasets import DistributedDataset, DistributedIterator, Optional
from jdist._src.input.options import InputContext, InputOptions, InputReplicationMode
from jdist._src.mirrored import MirroredStrategy, OneDeviceStrategy
from jdist._src.multi_worker.strategy import MultiWorkerMirroredStrategy
from jdist._src.input.numpy_dataset import NumpyDataset
from jdist._src.reduce.packing import CommunicationImplementation, CommunicationOptions
from jdist._src.training.progress import ProgressBar, is_chief, log_once, print_once
from jdist._src.reduce_op import ReduceOp
from jdist._src.training.state import (mirror, replica_key, replicated_sharding, to_host,
                                       unwrap_mirrored)
from jdist._src.multi_worker.slurm import SlurmClusterResolver
from jdist._src.strategy import Strategy
from jdist._src.strategy_extended import StrategyExtended
from jdist._src.values import DistributedValues, Mirrored, PerReplica

__version__ = "0.1.0"

__all__ = (
    "AutoShardPolicy", "ClusterResolver", "ClusterSpec", "CommunicationImplementation",
    "CommunicationOptions", "CrossDeviceOps", "DistributedDataset", "DistributedIterator",
    "DistributedValues", "HierarchicalCopyAllReduce", "InputContext", "InputOptions",
    "InputReplicationMode", "Mirrored", "MirroredStrategy", "MultiWorkerMirroredStrategy",
    "NcclAllReduce", "NumpyDataset", "OneDeviceStrategy", "Optional", "PerReplica", "ProgressBar",
    "ReduceOp", "ReductionToOneDevice", "ReplicaContext", "SimpleClusterResolver",
    "SlurmClusterResolver", "Strategy", "StrategyExtended", "TFConfigClusterResolver",
    "ValueContext", "checkpoint", "cluster_resolver", "errors", "experimental",
    "experimental_set_strategy", "function", "get_replica_context", "get_strategy", "has_strategy",
    "in_cross_replica_context", "is_chief", "log_once", "mirror", "nn", "print_once", "replica_key",
    "replicated_sharding", "to_host", "unwrap_mirrored",
)
