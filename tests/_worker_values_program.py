"""Plain (non-distributed) values, and `Mirrored` ones (TF's are plain tensors with one replica
per worker), reduced and gathered across 2 workers x 1 replica, run by
``test_multi_worker.py``: each is this worker's value, as in TF's MultiWorkerMirroredStrategy.
Writes ``<out>.<worker>`` as JSON: per case, this worker's result.

Usage: ``python -m jdist.launch --nproc 2 --devices-per-proc 1 _worker_values_program.py OUT``.
"""

import json
import sys


def main(out):
    import numpy as np  # pylint: disable=import-outside-toplevel
    import jdist  # pylint: disable=import-outside-toplevel
    s = jdist.MultiWorkerMirroredStrategy()
    worker = s.extended.worker_index
    replica = s.experimental_distribute_values_from_function(
        lambda ctx: np.float32([ctx.replica_id_in_sync_group, 5.0]))
    merged = s.run(lambda x: jdist.get_replica_context().merge_call(  # A plain result.
        lambda strategy, y: strategy.reduce("SUM", y, None), args=(x,)), args=(replica,))
    mine = np.float32([1.0 + worker, 10.0])
    values = {"mine": mine, "same": np.float32([3.0, 4.0]), "number": 2.0 + worker,
              "scalar": np.float32(1.0 + worker), "matrix": np.full((2, 2), 1.0 + worker,
                                                                   np.float32),
              "merged": merged, "reduce_to": s.extended.reduce_to("SUM", replica, replica),
              "broadcast": s.extended.broadcast_to(mine, replica)}  # Mirrored, TF's plain.
    results = {}
    for name, value in values.items():
        rank0 = name in ("number", "scalar")
        for op in ("SUM", "MEAN"):
            for axis in (None, 0) if not rank0 else (None,):
                results[f"reduce {op} {name} {axis}"] = np.asarray(
                    s.reduce(op, value, axis=axis)).tolist()
            results[f"reduce_to {op} {name}"] = [np.asarray(v).tolist() for v in (
                s.experimental_local_results(s.extended.reduce_to(op, value, replica)))]
            results[f"batch_reduce_to {op} {name}"] = [np.asarray(v).tolist() for v in (
                s.extended.batch_reduce_to(op, [(value, replica), (value, "CPU:0")]))]
        if not rank0:
            results[f"gather {name}"] = np.asarray(s.gather(value, 0)).tolist()
    # float64 without x64: float32, as jax.jit holds it (TF adds float64: jdist's deviation).
    results["float64 reduce None"] = np.asarray(
        s.reduce("SUM", np.float64([0.1 + worker]), None)).tolist()
    mine = np.array([1 if worker == 0 else 2**20], np.int64)  # Without x64: int32, TF's sum.
    for axis in (None, 0):
        results[f"int64 reduce {2**20} {axis}"] = np.asarray(s.reduce("SUM", mine, axis)).tolist()
    results[f"int64 reduce_to {2**20}"] = np.asarray(s.experimental_local_results(
        s.extended.reduce_to("SUM", mine, replica))[0]).tolist()
    ints = np.array([1 + worker], np.int32)  # An integer MEAN: JAX's default float without x64.
    for axis in (None, 0):
        mean = s.reduce("MEAN", ints, axis)
        results[f"int32 MEAN {axis}"] = [np.asarray(mean).tolist(), str(np.asarray(mean).dtype)]
    mean = s.extended.reduce_to("MEAN", ints, replica)
    results["int32 MEAN reduce_to"] = [np.asarray(s.experimental_local_results(mean)[0]).tolist(),
                                       str(np.asarray(s.experimental_local_results(mean)[0]).dtype)]
    ext = s.extended  # TF's roles: checkpoints and summaries on the chief, init everywhere.
    results["_roles"] = [ext.should_checkpoint, ext.should_save_summary, ext.should_init,
                         ext.experimental_should_init]
    with open(f"{out}.{worker}", "w", encoding="utf-8") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
