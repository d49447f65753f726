"""`MultiWorkerMirroredStrategy`: replicas on the devices of several processes.

`strategy` lays one replica axis over ``jax.distributed``'s global devices; `runtime` and
`watchdog` start, agree and end the workers in bounded time; `cluster_resolver` and `slurm`
say who the workers are; `launcher` runs a script as local workers; `input`, `arguments` and
`ragged` are the multi-worker forms of input, host arguments and partial batches.
"""
