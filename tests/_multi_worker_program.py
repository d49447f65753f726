"""One program, run as 2 workers x 2 CPU devices and as 1 process x 4 devices by
``test_multi_worker.py``: it writes every result it computes to ``<out>.<worker>`` as JSON.

Global results (reduce, gather, Mirrored values) go under ``"global"``; per-replica results under
``"replicas"`` keyed by replica id, since each worker sees only its own replicas. A fault mode
(``--fault die|stall|raise|shapes``) makes worker 1 misbehave for the fault tests, ``chief``
kills worker 0 (which hosts JAX's coordination service).
"""

import json
import os
import signal
import sys
import time


def _replicas(strategy, value):
    ids = strategy.extended._local_replica_ids()
    import numpy as np  # pylint: disable=import-outside-toplevel
    return {str(i): np.asarray(x).tolist()
            for i, x in zip(ids, strategy.experimental_local_results(value))}


def _values_and_run(s, jdist, np):
    ctx = jdist.get_replica_context
    v = s.experimental_distribute_values_from_function(
        lambda c: np.full((2,), c.replica_id_in_sync_group + 1, np.float32))
    # Uneven across workers: ragged, reduced and gathered exactly.
    u = next(iter(s.distribute_datasets_from_function(
        lambda c: [np.arange(c.input_pipeline_id + 1, dtype=np.float32) + 0.5],
        jdist.InputOptions(experimental_replication_mode=jdist.InputReplicationMode.PER_REPLICA))))
    doubled = s.run(lambda x: x * 2 + ctx().replica_id_in_sync_group, args=(v,))
    ids = s.run(lambda: ctx().replica_id_in_sync_group)
    return {
        "values": {"replicas": _replicas(s, v)},
        "uneven": {"replicas": _replicas(s, u)},
        "run": {"replicas": _replicas(s, doubled)},
        "run_ids": {"replicas": _replicas(s, ids)},
        "reduce_sum": {"global": float(s.reduce("sum", v, axis=None)[0])},
        "reduce_mean": {"global": float(s.reduce("mean", v, axis=None)[1])},
        "reduce_sum_axis0": {"global": float(s.reduce("sum", u, axis=0))},
        "reduce_mean_axis0": {"global": float(s.reduce("mean", u, axis=0))},
        "gather_uneven": {"global": np.asarray(s.gather(u, 0)).tolist()},
        "gather": {"global": np.asarray(s.gather(v, 0)).tolist()},
        "replicas_in_sync": {"global": s.num_replicas_in_sync},
    }


def _replica_collectives(s, jdist, np):
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

    def step(x):
        c = jdist.get_replica_context()
        merged = c.merge_call(lambda strategy, y: strategy.reduce("sum", y, axis=None),
                              args=(x * 3,))
        # bfloat16 partial sums that round: a gather and ordered adds across the processes.
        bf16 = c.all_reduce("sum", (x * 1.37 + 0.11).astype(jnp.bfloat16))
        return (c.all_reduce("sum", x), c.all_reduce("mean", x), c.all_gather(x, 0),
                merged + x, bf16)

    v = s.experimental_distribute_values_from_function(
        lambda c: np.arange(3, dtype=np.float32) * (c.replica_id_in_sync_group + 1))
    total, mean, gathered, merged, bf16 = s.run(step, args=(v,))
    twice = jdist.function(lambda x: s.run(step, args=(x,))[0])(v)
    return {
        "all_reduce_sum": {"kind": type(total).__name__,
                           "global": np.asarray(s.reduce("mean", total, axis=None)).tolist()},
        "all_reduce_mean": {"replicas": _replicas(s, mean)},
        "all_gather": {"replicas": _replicas(s, gathered)},
        "merge_call": {"replicas": _replicas(s, merged)},
        "all_reduce_bfloat16": {"replicas": _replicas(s, bf16)},
        "jdist_function": {"replicas": _replicas(s, twice)},
    }


def _in_tf_layout(s, np, data, batch):
    """``data`` (a nest of arrays) with the rows of each global batch of ``batch`` rows
    arranged so that TF's DATA sharding over several workers (the default AUTO on a
    NumpyDataset: replica ``g`` gets chunk ``chunk_order[g]``) hands replica ``g`` the rows one
    process hands it: the comparisons with 1 process x 4 devices stay one to one. The rule
    itself is checked against TF in ``test_auto_shard.py`` and by ``_auto_shard``."""
    from jdist._src.input import auto_shard  # pylint: disable=import-outside-toplevel
    workers = s.extended._input_pipeline()[0]
    order = auto_shard.chunk_order(workers, s.num_replicas_in_sync // workers)
    if order is None:
        return data

    def arranged(a):
        out = a.copy()
        for start in range(0, len(a), batch):
            rows = a[start:start + batch]
            per = -(-len(rows) // len(order))
            chunks = [rows[j * per:(j + 1) * per] for j in range(len(order))]
            placed = [None] * len(order)
            for g, j in enumerate(order):
                assert len(chunks[j]) == len(chunks[g]), "chunks of one size only"
                placed[j] = chunks[g]
            out[start:start + batch] = np.concatenate(placed)
        return out
    return tuple(map(arranged, data)) if isinstance(data, tuple) else arranged(data)


def _dataset(s, jdist, np):
    x = np.arange(26, dtype=np.float32).reshape(13, 2)
    dataset = s.experimental_make_numpy_dataset(_in_tf_layout(s, np, x, 6)).batch(6)  # 6, 6, 1.

    def step(batch):
        c = jdist.get_replica_context()
        return c.all_reduce("sum", batch.sum()), batch * 2

    out = {}
    for i, batch in enumerate(s.experimental_distribute_dataset(dataset)):
        total, doubled = s.run(step, args=(batch,))
        out[f"batch{i}_sum"] = {"global": float(s.reduce("mean", total, axis=None))}
        out[f"batch{i}_gather"] = {"global": np.asarray(s.gather(doubled, 0)).tolist()}
        out[f"batch{i}_mean0"] = {"global": np.asarray(s.reduce("mean", batch, axis=0)).tolist()}
        out[f"batch{i}_local"] = {"replicas": _replicas(s, batch)}
        nests = s.experimental_local_results({"b": batch, "k": 1})  # One per local replica.
        out[f"batch{i}_nest"] = {"replicas": {str(r): [np.asarray(v["b"]).tolist(), v["k"]]
                                              for r, v in zip(s.extended._local_replica_ids(),
                                                              nests, strict=True)}}
    contexts = []
    s.distribute_datasets_from_function(lambda c: contexts.append(c) or [np.zeros((1,))])
    per_replica = jdist.InputOptions(
        experimental_replication_mode=jdist.InputReplicationMode.PER_REPLICA)
    fed = s.distribute_datasets_from_function(
        lambda c: [np.arange(c.input_pipeline_id + 1, dtype=np.float32)] * 2, per_replica)
    for i, batch in enumerate(fed):
        out[f"per_replica_input{i}"] = {"global": np.asarray(s.gather(batch, 0)).tolist()}
    out["input_context"] = {"replicas": {str(s.extended._local_replica_ids()[0]): [
        contexts[0].num_input_pipelines, contexts[0].input_pipeline_id,
        contexts[0].num_replicas_in_sync]}}
    return out


def _training(s, jdist, np):
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    import jax  # pylint: disable=import-outside-toplevel
    rng = np.random.default_rng(0)
    x, w_true = rng.normal(size=(64, 3)).astype(np.float32), np.array([[1.], [-2.], [.5]])
    y = (x @ w_true).astype(np.float32)
    dataset = s.experimental_make_numpy_dataset(_in_tf_layout(s, np, (x, y), 20)).batch(20)

    def step(w, batch):
        c = jdist.get_replica_context()
        bx, by = batch
        loss, grad = jax.value_and_grad(lambda w: jnp.sum((bx @ w - by) ** 2))(w)
        count = c.all_reduce("sum", jnp.float32(bx.shape[0]))
        return w - 0.05 * c.all_reduce("sum", grad) / count, c.all_reduce("sum", loss) / count

    w = jnp.zeros((3, 1), jnp.float32)
    for _ in range(3):
        for batch in s.experimental_distribute_dataset(dataset):
            w, loss = s.run(step, args=(w, batch))
    return {"train_w": {"global": np.asarray(w).ravel().tolist(), "tolerance": 1e-6},
            "train_loss": {"global": float(s.reduce("mean", loss, axis=None)),
                           "tolerance": 1e-6}}


def _int64(s, jdist, np):
    """int64 host numbers, held as int32 without x64 (JAX's dtypes): every worker gives TF's
    sum, which fits."""
    import jax  # pylint: disable=import-outside-toplevel

    def outcome(compute):
        try:
            return {"global": np.asarray(compute()).tolist()}
        except jdist.errors.X64RequiredError:
            return {"global": 0, "kind": "X64RequiredError"}

    def summed(value):
        total = s.run(lambda v: jdist.get_replica_context().all_reduce("sum", v), args=(value,))
        return s.experimental_local_results(total)[0]

    def per_pipeline(rows):  # Replica r gets rows[r], whichever worker reads it.
        def dataset_fn(c):
            k = len(rows) // c.num_input_pipelines
            return [rows[i:i + 1] for i in range((c.input_pipeline_id + 1) * k)[-k:]]
        return dataset_fn
    out = {}
    for scale in (2**20,):
        rows = np.array([1, 1, scale, scale], np.int64)
        values = {
            "dataset": next(iter(s.experimental_distribute_dataset(
                s.experimental_make_numpy_dataset(_in_tf_layout(s, np, rows, 4)).batch(4)))),
            "values_from_function": s.experimental_distribute_values_from_function(
                lambda c: rows[c.replica_id_in_sync_group:][:1]),
            "per_worker": next(iter(s.distribute_datasets_from_function(per_pipeline(rows)))),
            "ragged": s.experimental_distribute_values_from_function(  # r + 1 rows each.
                lambda c: np.repeat(rows[c.replica_id_in_sync_group:][:1],
                                    c.replica_id_in_sync_group + 1)),
        }
        for name, value in values.items():
            if name == "ragged":  # Rebuilt by a pytree function: it keeps its record.
                out[f"int64_{name}_{scale}_reduce"] = outcome(lambda: s.reduce(
                    "sum", jax.tree_util.tree_map(lambda a: a, value), axis=0))
                continue
            out[f"int64_{name}_{scale}_all_reduce"] = outcome(lambda: summed(value))
            out[f"int64_{name}_{scale}_reduce"] = outcome(
                lambda: s.reduce("sum", value, axis=None))
    return out


def _record(s, jdist, np, result):
    """What one worker sees of a reduce_to / broadcast_to result: its kind, where it lies (local
    device indices, "all": Mirrored) and its value."""
    import jax  # pylint: disable=import-outside-toplevel
    if isinstance(result, jdist.Mirrored):
        return {"kind": "Mirrored", "on": "all", "value": np.asarray(
            s.experimental_local_results(result)[0]).tolist()}
    on = sorted(jax.local_devices().index(d) for d in result.devices())
    return {"kind": type(result).__name__, "on": on, "value": np.asarray(result).tolist()}


def _destinations(s, jdist, np):
    """reduce_to / batch_reduce_to / broadcast_to and CrossDeviceOps towards this worker's devices
    (TF names, its own task's name, jax.Devices) and the strategy's; towards the other worker's
    device (2 x 2 only) each worker gets InvalidArgumentError, before anything runs."""
    import functools  # pylint: disable=import-outside-toplevel
    import jax  # pylint: disable=import-outside-toplevel
    ext, names, devs = s.extended, s.extended.device_names, s.extended.replica_devices
    me, local = jax.process_index(), jax.local_devices()
    own = [n for n, d in zip(names, devs) if d.process_index == me]
    v = s.experimental_distribute_values_from_function(
        lambda c: np.arange(3, dtype=np.float32) * (c.replica_id_in_sync_group + 1) - 1)
    ordered = lambda xs: functools.reduce(lambda a, b: a * 2 + b, xs)  # noqa: E731
    to_one = jdist.ReductionToOneDevice(reduce_to_device=names[3], accumulation_fn=ordered)
    nccl, seven = jdist.NcclAllReduce(), np.full((2,), 7, np.int32)
    SUM, MEAN = jdist.ReduceOp.SUM, jdist.ReduceOp.MEAN  # pylint: disable=invalid-name
    here = ext.reduce_to("sum", v, "CPU:0")
    mirrored = ext.broadcast_to(here, v)
    results = {
        "reduce_to_name": ext.reduce_to("sum", v, "CPU:1"),
        "reduce_to_device": ext.reduce_to("mean", v, local[0]),
        "reduce_to_own_task": ext.reduce_to("sum", v, own[1]),
        "batch_reduce_to": ext.batch_reduce_to("sum", [(v, "CPU:0"), (v, v)])[0],
        "broadcast_back": mirrored,
        "broadcast_to_local": ext.broadcast_to(mirrored, "CPU:1"),
        "broadcast_host": ext.broadcast_to(seven, "CPU:1"),
        "ops_reduce": nccl.reduce(SUM, v, "CPU:1"),
        "ops_batch": nccl.batch_reduce(MEAN, [(v, "CPU:1"), (v, local[0])])[0],
        "ops_broadcast": nccl.broadcast(seven, local[1]),
        "to_one_mirrored": to_one.reduce(SUM, v, v),
        "to_one_mean": to_one.reduce(MEAN, v, "CPU:1"),
        "to_one_batch": to_one.batch_reduce(SUM, [(v, "CPU:0"), (v, "CPU:1")])[1],
        "to_one_default": jdist.ReductionToOneDevice().reduce(SUM, v, "CPU:1"),
    }
    out = {k: _record(s, jdist, np, r) for k, r in results.items()}
    other = [i for i, d in enumerate(devs) if d.process_index != me][:1]
    for i in other:  # Another worker's device: the typed error on every worker.
        for case, call in {"remote_name": lambda: ext.reduce_to("sum", v, names[i]),
                           "remote_device": lambda: nccl.broadcast(seven, devs[i]),
                           "remote_batch": lambda: ext.batch_reduce_to(
                               "sum", [(v, v), (v, names[i])])}.items():
            try:
                out[case] = {"kind": type(call()).__name__}
            except jdist.errors.JdistError as e:
                out[case] = {"error": type(e).__name__, "message": str(e)}
    return {"_destinations": out}


def _auto_shard(s, jdist, np):
    """experimental_distribute_dataset of 18 rows in batches of 7 (7, 7, 4) under each policy:
    per step, this worker's replicas' rows (the workers' steps differ)."""
    out = {}
    dataset = s.experimental_make_numpy_dataset(np.arange(18, dtype=np.float32)).batch(7)
    for policy in ("OFF", "DATA", "AUTO", None):  # None: TF's default, AUTO.
        options = jdist.InputOptions(auto_shard_policy=policy)
        steps = [_replicas(s, batch) for batch in s.experimental_distribute_dataset(dataset, options)]
        out[str(policy)] = steps
    try:
        s.experimental_distribute_dataset(dataset, jdist.InputOptions(auto_shard_policy="FILE"))
        out["FILE"] = None
    except jdist.errors.JdistError as e:
        out["FILE"] = type(e).__name__
    return {"_auto_shard": out}


def _tf_step(jdist, global_batch, traces):
    """TF's custom training step: per-example loss summed / GLOBAL batch size, jax.grad,
    all_reduce SUM of the grads, SGD; a metric through merge_call; ragged outputs."""
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

    def step(params, xb, yb):
        traces.append(xb.shape)
        c = jdist.get_replica_context()

        def loss_fn(p):
            logits = xb @ p["w"] + p["b"]
            per = -jnp.take_along_axis(jax.nn.log_softmax(logits), yb[:, None], 1)[:, 0]
            return jnp.sum(per) / global_batch
        loss, grads = jax.value_and_grad(loss_fn)(params)
        grads = c.all_reduce("sum", grads)
        params = jax.tree_util.tree_map(lambda p, g: p - 0.5 * g, params, grads)
        logits = xb @ params["w"] + params["b"]
        correct = jnp.sum(jnp.argmax(logits, -1) == yb).astype(jnp.float32)
        # merge_fn sees every replica's value on every worker (as in an even step): 4 here.
        total = c.merge_call(lambda st, v: st.reduce("sum", v, axis=None) * 100 + len(
            st.experimental_local_results(v)), args=(correct,))
        mean = jnp.mean(xb, keepdims=True)[0, :1]  # NaN on a replica without rows (TF's).
        return params, loss, total, logits, c.all_gather(yb, 0), mean
    return step


def _record_step(s, np, out, name, params, outputs, xb):
    loss, total, logits, gathered, mean = outputs
    tol = {"tolerance": 1e-6}
    out[f"{name}_w"] = {"global": np.asarray(params["w"]).ravel().tolist(), **tol}
    out[f"{name}_b"] = {"global": np.asarray(params["b"]).tolist(), **tol}
    out[f"{name}_loss"] = {"global": float(s.reduce("sum", loss, axis=None)), **tol}
    out[f"{name}_loss_mean"] = {"global": float(s.reduce("mean", loss, axis=None)), **tol}
    # The merge's result returned as it is: the same on every replica (Mirrored).
    out[f"{name}_correct"] = {"global": sorted({float(np.asarray(v)) for v in
                                                s.experimental_local_results(total)}),
                              "kind": type(total).__name__}
    out[f"{name}_logits"] = {"global": np.asarray(s.gather(logits, 0)).tolist(), **tol}
    out[f"{name}_all_gather"] = {"replicas": _replicas(s, gathered)}
    out[f"{name}_mean"] = {"global": np.asarray(s.gather(mean, 0)).tolist(), **tol}
    out[f"{name}_x"] = {"global": np.asarray(s.gather(xb, 0)).tolist()}
    out[f"{name}_x_mean0"] = {"global": np.asarray(s.reduce("mean", xb, axis=0)).tolist(),
                              **tol}


def _exact_uneven(s, jdist, np):
    """Exact ragged steps across workers: a partial last batch (19 rows in batches of 8: the
    last gives the replicas 1, 1, 1, 0 rows), two epochs (the second traces nothing), errors."""
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    rng = np.random.default_rng(1)
    x = rng.normal(size=(19, 3)).astype(np.float32)
    y = rng.integers(0, 3, size=19).astype(np.int32)
    traces, out, counts, ctx = [], {}, [], jdist.get_replica_context
    step = _tf_step(jdist, 8, traces)
    params = {"w": jnp.zeros((3, 3)), "b": jnp.zeros((3,))}
    dataset = s.experimental_distribute_dataset(
        s.experimental_make_numpy_dataset(_in_tf_layout(s, np, (x, y), 8)).batch(8))
    for epoch in range(2):
        for i, (xb, yb) in enumerate(dataset):
            params, *outputs = s.run(step, args=(params, xb, yb))
            _record_step(s, np, out, f"exact{epoch}_{i}", params, outputs, xb)
        counts.append(len(traces))
    out["exact_epoch2_traces"] = {"global": counts[1] - counts[0]}  # Plans are cached.
    # The last (partial) batch: Python numbers that differ by replica come back PerReplica; a
    # ragged output of one step is an input of the next.
    out["exact_rows"] = {"replicas": _replicas(s, s.run(lambda b: b.shape[0], args=(xb,)))}
    out["exact_feed_back"] = {"global": np.asarray(s.gather(s.run(
        lambda logits: logits * 2 + ctx().all_reduce("sum", logits.sum()),
        args=(outputs[2],)), 0)).tolist(), "tolerance": 1e-6}
    errors = {}
    for name, fn in [("all_reduce", lambda b: ctx().all_reduce("sum", b)),
                     ("loop", lambda b: jax.lax.fori_loop(
                         0, 2, lambda i, v: v + ctx().all_reduce("sum", v.sum()), b))]:
        try:
            s.run(fn, args=(xb,))
            errors[name] = None
        except jdist.errors.JdistError as e:
            errors[name] = type(e).__name__
    ragged = s.experimental_distribute_values_from_function(
        lambda c: np.arange(c.replica_id_in_sync_group, dtype=np.float32))
    nonempty = s.experimental_distribute_values_from_function(
        lambda c: np.arange(c.replica_id_in_sync_group + 1, dtype=np.float32))
    try:  # Replicas of different shapes, none empty: TF's shape error, before any collective.
        s.run(lambda v: ctx().all_reduce("sum", v), args=(nonempty,))
        errors["all_reduce_shapes"] = None
    except jdist.errors.JdistError as e:
        errors["all_reduce_shapes"] = type(e).__name__
    out["exact_values_gather"] = {"global": np.asarray(s.gather(ragged, 0)).tolist()}
    out["exact_values_run"] = {"global": np.asarray(s.gather(s.run(
        lambda v: v * 2 + ctx().all_reduce("sum", v.sum()), args=(ragged,)), 0)).tolist()}
    out["exact_errors"] = {"replicas": {str(i): errors for i in s.extended._local_replica_ids()}}
    per_replica = next(iter(s.distribute_datasets_from_function(  # Rows 1, 2, 3, 4.
        lambda c: [np.arange(c.input_pipeline_id + 1, dtype=np.float32) + 0.5],
        jdist.InputOptions(experimental_replication_mode=jdist.InputReplicationMode.PER_REPLICA))))
    out["exact_per_replica_input"] = {"global": np.asarray(s.gather(s.run(
        lambda v: v * 2 + ctx().all_reduce("sum", v.sum()), args=(per_replica,)), 0)).tolist()}
    # TF's loop with its step in a tf.function: the full batches compiled, the partial one run
    # as Python (jdist.function's arguments then hold ragged values, other workers' as shapes).
    compiled = jdist.function(lambda p, x, y: s.run(step, args=(p, x, y)))
    params = {"w": jnp.zeros((3, 3)), "b": jnp.zeros((3,))}
    for i, (xb, yb) in enumerate(dataset):
        params, *outputs = compiled(params, xb, yb)
        _record_step(s, np, out, f"compiled0_{i}", params, outputs, xb)
    out.update(_per_worker_exact(s, jdist, np))
    return out


def _per_worker_exact(s, jdist, np):
    """PER_WORKER pipelines where worker 1's data ends first: 2 steps, the second with
    replicas of 2, 1, 0, 0 rows; one pipeline (1x4) deals the same batches in replica order."""
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    rows = [[2, 2], [2, 1], [2], [2]]  # Per replica: its batches' rows.
    rng = np.random.default_rng(2)
    batches = [[(rng.normal(size=(n, 3)).astype(np.float32),
                 rng.integers(0, 3, size=n).astype(np.int32)) for n in r] for r in rows]

    def dataset_fn(c):
        mine = range(4) if c.num_input_pipelines == 1 else (
            [0, 1] if c.input_pipeline_id == 0 else [2, 3])
        return [batches[r][t] for t in range(2) for r in mine if t < len(batches[r])]

    traces, out = [], {}
    step = _tf_step(jdist, 8, traces)
    params = {"w": jnp.zeros((3, 3)), "b": jnp.zeros((3,))}
    for i, (xb, yb) in enumerate(s.distribute_datasets_from_function(dataset_fn)):
        params, *outputs = s.run(step, args=(params, xb, yb))
        _record_step(s, np, out, f"per_worker_exact{i}", params, outputs, xb)
    out["per_worker_exact_steps"] = {"global": i + 1}
    return out


def _disagreeing(s, worker):
    """A ragged value whose replica shapes the workers see differently (made by hand: the
    public ways to make one agree on the shapes), which run must refuse on both workers."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    from jdist._src.multi_worker import ragged as uneven_multi_worker  # pylint: disable=import-outside-toplevel
    ids = s.extended._local_replica_ids()
    shapes = [(1,), (2,), (3,), (4 + worker,)]
    return uneven_multi_worker.ragged_from_local(
        s.extended.replica_devices, ids, [np.zeros(shapes[i], np.float32) for i in ids], shapes,
        np.float32)


def _plain_refused(s, jdist, np, worker):
    """A plain value of rank 0, 1 or 2 at every cross-replica entry point on two replicas per
    worker: the error each raises (TF takes it as this worker's one replica value)."""
    ext, refused = s.extended, set()
    for rank in (0, 1, 2):
        x = np.full((2,) * rank, 1.0 + worker, np.float32)
        for call in (lambda: s.reduce("sum", x, None), lambda: s.reduce("sum", x, 0),
                     lambda: s.gather(x, 0), lambda: ext.reduce_to("sum", x, "CPU:0"),
                     lambda: ext.batch_reduce_to("sum", [(x, "CPU:0"), (x, "CPU:0")])):
            try:
                call()
                refused.add(None)
            except jdist.errors.JdistError as e:
                refused.add(type(e).__name__ + (": several replicas per worker" if
                                                "several replicas per worker" in str(e) else ""))
    return sorted(refused, key=str)


def _per_worker(s, jdist, np):
    """PER_WORKER pipelines of different lengths (worker 0: 3 batches, worker 1: 5), host values
    that differ between workers, and workers out of step; only meaningful on 2 workers."""
    if s.extended.num_workers == 1:
        return {"_per_worker": None}
    worker = s.extended.worker_index

    def dataset_fn(c):
        count = 3 + 2 * c.input_pipeline_id
        return [np.arange(2, dtype=np.float32) + 10 * c.input_pipeline_id + 2 * i
                for i in range(count)]

    out = {"steps": [], "errors": []}
    step = lambda x: jdist.get_replica_context().all_reduce("sum", x.sum())  # noqa: E731
    for batch in s.distribute_datasets_from_function(dataset_fn):
        total = s.reduce("mean", s.run(step, args=(batch,)), axis=None)
        rows = [c.shape[0] for c in batch._components] if batch.ragged else []  # Every worker's.
        out["steps"].append([np.asarray(s.gather(batch, 0)).tolist(), rows, float(total)])
    attempts = [
        lambda: out.setdefault("exact_steps", [  # Ragged across workers: exact, no error.
            np.asarray(s.gather(b, 0)).tolist() for b in s.distribute_datasets_from_function(
                dataset_fn)]),
        lambda: s.run(lambda x: x + 1, args=(np.full((3,), worker, np.float32),)),
        lambda: s.run(lambda x, y: x * y, args=(np.ones(2, np.float32), 0.5 + worker)),
        lambda: s.run(lambda x: x * 2, args=(_disagreeing(s, worker),)),
        # TF takes a plain value as this worker's; on two replicas per worker: refused.
        lambda: s.reduce("mean", np.float32(worker), axis=None),
        (lambda: s.run(lambda x: x - 1, args=(np.ones(4, np.float32),))) if worker == 0 else
        (lambda: next(iter(s.distribute_datasets_from_function(dataset_fn)))),
    ]
    for attempt in attempts:
        try:
            attempt()
            out["errors"].append(None)
        except jdist.errors.JdistError as e:
            out["errors"].append([type(e).__name__, str(e)])
    out["plain_refused"] = _plain_refused(s, jdist, np, worker)
    out["equal_host_values"] = float(s.reduce("sum", s.run(
        lambda x, y: x * y, args=(np.ones(2, np.float32), 0.5)), axis=None)[0])
    return {"_per_worker": out}


def _fault(s, jdist, np, fault):
    """Worker 1 dies, stalls, raises or disagrees on shapes; the others must fail in bounded
    time."""
    worker = s.extended.worker_index
    step = lambda x: jdist.get_replica_context().all_reduce("sum", x)  # noqa: E731
    size = 3 if (worker == 1 and fault in ("shapes", "uncaught")) else 2
    v = s.experimental_distribute_values_from_function(lambda c: np.ones((2, size), np.float32))
    for _ in range(3):
        s.run(step, args=(v,))
    if worker == 1 and fault in ("die", "stall", "raise"):
        print(f"fault at {time.time()}", flush=True)
    if worker == 1 and fault == "raise":  # Uncaught: the main thread ends with it.
        raise RuntimeError("worker 1's own bug")
    if worker == 1 and fault == "die":
        os._exit(3)
    if worker == 1 and fault == "stall":
        time.sleep(120)
    if worker == 0 and fault == "chief":  # SIGKILL: the coordination service dies with it.
        print(f"fault at {time.time()}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    print("survived", float(s.reduce("sum", s.run(step, args=(v,)), axis=None)[0, 0]), flush=True)


def main(out_path, fault=None):
    t0 = time.time()
    import jax  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    import jdist  # pylint: disable=import-outside-toplevel
    options = jdist.CommunicationOptions(timeout_seconds=8) if fault else None
    s = jdist.MultiWorkerMirroredStrategy(communication_options=options)
    if fault:
        try:
            _fault(s, jdist, np, fault)
        except jdist.errors.JdistError as e:
            print(f"typed error {type(e).__name__}: {e}", flush=True)
            if fault == "uncaught":  # sys.excepthook prints it; exit status 1. Worker 1 later:
                time.sleep(0.5 * s.extended.worker_index)  # the chief must not end first.
                raise
            sys.exit(5)
        return
    results = {}
    for part in (_values_and_run, _replica_collectives, _dataset, _training, _destinations,
                 _auto_shard, _exact_uneven, _per_worker, _int64):
        results.update(part(s, jdist, np))
    results["_seconds"] = time.time() - t0
    results["_devices"] = [jax.process_count(), jax.local_device_count()]
    ext = s.extended  # TF's worker_devices / parameter_devices: this worker's; jdist's all.
    results["_worker_devices"] = [[d.id for d in ext.worker_devices],
                                  [d.id for d in ext.parameter_devices],
                                  [d.id for d in ext.replica_devices]]
    with open(f"{out_path}.{jax.process_index()}", "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
