"""Combining replicas: reduce and gather rules, cross-device ops, destinations, packing.

`collectives` holds every reduce and gather rule once; `cross_device_ops` the TF classes that
choose how host-side reductions run; `destinations` where results go; `packing` how many values
share one collective; `replica_mesh` the mesh's host-side programs. The core reaches this wing
only through `base.ReduceWing`.
"""
