"""Compiling ``strategy.run``: a replica function as one SPMD program over the replicas.

`spmd.ReplicatedRunner` traces the function once under ``jax.shard_map``, `invariance` finds the
outputs every replica computes alike (`Mirrored`), `staged_outputs` builds the program from that
one trace, and `merge` runs a ``merge_call`` inside it. The core reaches this wing only through
`base.RunWing`.
"""

import sys

from jdist._src import base
from jdist._src.run.replica_collectives import ReplicaAxisCollectives as replica_axis_collectives
from jdist._src.run.spmd import ReplicatedRunner

__all__ = ["replica_axis_collectives", "ReplicatedRunner"]

base.register_wing("run", sys.modules[__name__])  # As `base.RunWing`.
