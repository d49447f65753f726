"""The limit without jdist: JAX's CPU cross-process all-reduce (gloo) costs per operand.

    python -m jdist.launch --nproc 2 --devices-per-proc 1 benchmarks/multi_worker_allreduce.py

Plain JAX only (``jax.distributed`` from the launcher's ``TF_CONFIG``, ``jit(shard_map)`` of
``psum``): worker 0 prints ms per call for a scalar, one 340 KB buffer (the MLP's 85,002
gradients packed), the MLP's 6 gradients as 6 arrays and 32 small arrays. XLA combines a
program's all-reduces into one instruction, but gloo reduces its operands one at a time, so the
cost follows the number of arrays, not the bytes (2026-11-28, 2 loaded cores: scalar 1.5-3 ms,
340 KB packed 1.2-1.6 ms, 6 arrays 10-20 ms, 32 arrays 47-137 ms).
"""

import json
import os
import time

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

MLP = [(64, 256), (256,), (256, 256), (256,), (256, 10), (10,)]
CASES = {"scalar": [()], "1 x 340 KB (packed)": [(85002,)], "6 arrays (MLP)": MLP,
         "32 arrays": [(64, 64), (64,)] * 16}


def ms_per_call(mesh, shapes, calls=100):
    f = jax.jit(jax.shard_map(lambda *xs: [jax.lax.psum(x, "r") for x in xs], mesh=mesh,
                              in_specs=P(), out_specs=P()))
    xs = [jax.device_put(np.ones(s, np.float32), NamedSharding(mesh, P())) for s in shapes]
    for _ in range(5):
        jax.block_until_ready(f(*xs))
    start = time.perf_counter()
    for _ in range(calls):
        jax.block_until_ready(f(*xs))
    return (time.perf_counter() - start) / calls * 1e3


def main():
    config = json.loads(os.environ["TF_CONFIG"])
    workers = config["cluster"]["worker"]
    jax.distributed.initialize(workers[0], len(workers), config["task"]["index"])
    mesh = jax.make_mesh((jax.device_count(),), ("r",))
    for name, shapes in CASES.items():
        ms = ms_per_call(mesh, shapes)
        if jax.process_index() == 0:
            print(f"{name}: {ms:.2f} ms per all-reduce program", flush=True)


if __name__ == "__main__":
    main()
