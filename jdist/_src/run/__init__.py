"""Compiling ``strategy.run``: a replica function as one SPMD program over the replicas.

`spmd.ReplicatedRunner` traces the function once under ``jax.shard_map``, `invariance` finds the
outputs every replica computes alike (`Mirrored`), `staged_outputs` builds the program from that
one trace, and `merge` runs a ``merge_call`` inside it. The core reaches this wing only through
`base.RunWing`.
"""
