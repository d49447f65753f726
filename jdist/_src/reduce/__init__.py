"""Combining replicas: reduce and gather rules, cross-device ops, destinations, packing.

`collectives` holds every reduce and gather rule once; `cross_device_ops` the TF classes that
choose how host-side reductions run; `destinations` where results go; `packing` how many values
share one collective; `replica_mesh` the mesh's host-side programs. The core reaches this wing
only through `base.ReduceWing`.
"""

import sys

from jdist._src import base
from jdist._src.reduce.collectives import finish
from jdist._src.reduce.collectives import gather_axis
from jdist._src.reduce.collectives import normalize_axis
from jdist._src.reduce.collectives import ragged_gather
from jdist._src.reduce.collectives import ragged_partials
from jdist._src.reduce.collectives import replicated_reduce
from jdist._src.reduce.collectives import stacked_gather
from jdist._src.reduce.collectives import stacked_reduce
from jdist._src.reduce.collectives import strip_padding
from jdist._src.reduce.cross_device_ops import check_pairs
from jdist._src.reduce.cross_device_ops import resolve as resolve_ops
from jdist._src.reduce.destinations import mirrored_on
from jdist._src.reduce.destinations import place
from jdist._src.reduce.destinations import resolve as resolve_destinations
from jdist._src.reduce.packing import as_options
from jdist._src.reduce.replica_mesh import ReplicaMesh
from jdist._src.reduce.replica_mesh import register as register_mesh

__all__ = [
    "finish", "gather_axis", "normalize_axis", "ragged_gather", "ragged_partials",
    "replicated_reduce", "stacked_gather", "stacked_reduce", "strip_padding", "check_pairs",
    "resolve_ops", "mirrored_on", "place", "resolve_destinations", "as_options",
    "ReplicaMesh", "register_mesh"]

base.register_wing("reduce", sys.modules[__name__])  # As `base.ReduceWing`.
