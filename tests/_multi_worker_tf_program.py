"""One program run as TF's ``MultiWorkerMirroredStrategy`` (``tf``) and as jdist's (``jdist``),
2 workers x 1 CPU replica each, by ``test_multi_worker_tf.py``: every distributed dataset below
(and a ``distribute_datasets_from_function`` one) read to its end with ``get_next_as_optional``,
writing per step this worker's replicas' values, each leaf's all-reduced sum, the gathered global
batch, and the dataset's cardinality, to ``<out>.<worker>`` as JSON; then values from a function,
of a different length per replica, gathers along a negative axis (TF's collective ops raise for
every dtype), plain values reduced and gathered across workers (each worker's own), and TF's
custom training loop over a partial last batch (``_training``, to within float rounding: TF's
matmul and XLA's may round differently).

Usage: ``python _multi_worker_tf_program.py tf|jdist OUT FILE...`` (``tf`` reads ``TF_CONFIG``;
``jdist`` is started by ``python -m jdist.launch``).
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def datasets(tf, files):
    """The pipelines both strategies distribute (TF's default AUTO unless a policy is set)."""
    def parsed(record):
        return tf.ensure_shape(tf.io.parse_tensor(record, tf.int64), [])

    def with_policy(dataset, policy):
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = policy
        return dataset.with_options(options)
    records = tf.data.TFRecordDataset(files).map(parsed)
    policy = tf.data.experimental.AutoShardPolicy
    return {"range": tf.data.Dataset.range(18).batch(7),  # No files: DATA.
            "range_off": with_policy(tf.data.Dataset.range(18).batch(7), policy.OFF),
            "dict": tf.data.Dataset.from_tensor_slices(
                {"x": tf.range(22, dtype=tf.float32), "y": tf.range(22) % 3}).batch(6),
            "files": records.batch(4),  # FILE: worker 1 reads one file of three, ends first.
            "files_data": with_policy(records.batch(4), policy.DATA),
            # Only file 1's rows pass: worker 0's pipeline (files 0 and 2) yields no batch.
            "files_one_worker_empty": records.filter(lambda r: r // 100 == 1).batch(2),
            "static": tf.data.Dataset.range(20).batch(6, drop_remainder=True)}


def training_data(tf, np):
    """13 rows in batches of 6: the last batch's one row goes to worker 0, worker 1 gets none."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(13, 3)), rng.normal(size=(13, 1))
    return tf.data.Dataset.from_tensor_slices((x.astype(np.float32), y.astype(np.float32))).batch(6)


def tf_training(tf, strategy, np):
    """TF's custom loop: per-example loss averaged over the global batch size, gradients
    all-reduced, SGD on a mirrored variable; two epochs. Returns the losses and weights."""
    with strategy.scope():
        w = tf.Variable(tf.zeros((3, 1)), aggregation=tf.VariableAggregation.MEAN)

    def step(x, y):
        with tf.GradientTape() as tape:
            per_example = tf.reduce_sum((tf.matmul(x, w) - y) ** 2, axis=1)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=6)
        grad = tf.distribute.get_replica_context().all_reduce("sum", tape.gradient(loss, w))
        w.assign_sub(0.1 * grad)
        return loss

    @tf.function
    def train_step(batch):
        return strategy.reduce("sum", strategy.run(step, args=batch), axis=None)
    losses = [float(train_step(batch)) for _ in range(2)
              for batch in strategy.experimental_distribute_dataset(training_data(tf, np))]
    return {"losses": losses, "w": w.numpy().ravel().tolist()}


def jdist_training(tf, strategy, np):
    """`tf_training` ported to jdist: the same loop with jax.grad and arrays, its
    ``train_step`` a `jdist.function` as TF's is a ``tf.function`` (the partial batch runs it as
    Python, with another worker's replicas held as shapes)."""
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    import jdist  # pylint: disable=import-outside-toplevel

    def step(w, x, y):
        def loss_fn(w):
            per_example = jnp.sum((x @ w - y) ** 2, axis=1)
            return jdist.nn.compute_average_loss(per_example, global_batch_size=6)
        loss, grad = jax.value_and_grad(loss_fn)(w)
        return w - 0.1 * jdist.get_replica_context().all_reduce("sum", grad), loss
    @jdist.function
    def train_step(w, batch):
        w, loss = strategy.run(step, args=(w, *batch))
        return w, strategy.reduce("sum", loss, axis=None)
    w, losses = jnp.zeros((3, 1)), []
    for _ in range(2):
        for batch in strategy.experimental_distribute_dataset(training_data(tf, np)):
            w, loss = train_step(w, batch)
            losses.append(float(loss))
    return {"losses": losses, "w": np.asarray(w).ravel().tolist()}


def negative_axis_gathers(strategy, context, compiled, np):
    """``gather`` and ``all_gather`` along axis -1 of int32 and float32 values: TF's collective
    ops (every dtype, across workers) raise; the other axes' results for comparison."""
    results = {}
    for dtype in ("int32", "float32"):
        value = strategy.experimental_distribute_values_from_function(
            lambda ctx, dtype=dtype: np.arange(6, dtype=dtype).reshape(2, 3)
            + ctx.replica_id_in_sync_group)
        for axis in (-1, 1):
            gathered = compiled(lambda v, axis=axis: strategy.run(
                lambda v: context().all_gather(v + 0, axis), args=(v,)))  # TF: not an input.
            calls = {"gather": lambda: strategy.gather(value, axis),
                     "all_gather": lambda: strategy.experimental_local_results(gathered(value))}
            for name, call in calls.items():
                try:
                    results[f"{name} {dtype} {axis}"] = np.asarray(call()).tolist()
                except Exception:  # noqa: BLE001 - whether it raises is what is compared.
                    results[f"{name} {dtype} {axis}"] = "raises"
    return results


def collective_dtypes(strategy, context, compiled, np):
    """int8 and bfloat16 values reduced, all-reduced, gathered and all-gathered: TF's collective
    ops (every value, across workers) take bfloat16 to reduce only, and int8 to nothing."""
    import ml_dtypes  # pylint: disable=import-outside-toplevel
    results = {}
    for dtype in ("int8", "bfloat16"):
        value = strategy.experimental_distribute_values_from_function(
            lambda ctx, dtype=dtype: (np.arange(3) + ctx.replica_id_in_sync_group).astype(
                ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype))
        calls = {
            "reduce": lambda v: strategy.reduce("SUM", v, axis=None),
            "gather": lambda v: strategy.gather(v, 0),
            "all_reduce": lambda v: strategy.experimental_local_results(compiled(
                lambda v: strategy.run(lambda x: context().all_reduce("SUM", x + 0),
                                       args=(v,)))(v)),
            "all_gather": lambda v: strategy.experimental_local_results(compiled(
                lambda v: strategy.run(lambda x: context().all_gather(x + 0, 0),
                                       args=(v,)))(v))}
        for name, call in calls.items():
            try:
                results[f"{name} {dtype}"] = np.asarray(call(value)).astype(np.float32).tolist()
            except Exception:  # noqa: BLE001 - whether it raises is what is compared.
                results[f"{name} {dtype}"] = "raises"
    return results


def plain_values(strategy, context, compiled, np, worker):
    """A plain (non-distributed) array that differs between workers, one that does not, the
    plain result of a merge_call, an all-reduced result of run, a reduce_to result and a
    broadcast_to of a worker's own array, and arrays of rank 0 and 2, reduced (SUM / MEAN, axis
    None / 0; reduce_to, batch_reduce_to) and gathered in the cross-replica context: TF takes
    each as this worker's one replica value."""
    mine, same = np.float32([1.0 + worker, 10.0]), np.float32([3.0, 4.0])
    replica = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.float32([ctx.replica_id_in_sync_group, 5.0]))
    merged = compiled(lambda v: strategy.run(lambda x: context().merge_call(
        lambda s, y: s.reduce("SUM", y, None), args=(x + 0,)), args=(v,)))(replica)
    results, values = {}, {
        "mine": mine, "same": same, "merged": merged,
        "reduce_to": strategy.extended.reduce_to("SUM", replica, replica),
        "all_reduced": compiled(lambda v: strategy.run(
            lambda x: context().all_reduce("SUM", x * 1.5), args=(v,)))(replica),
        "broadcast": strategy.extended.broadcast_to(mine, replica)}
    for rank in (0, 2):  # Each result keeps the value's shape (no leading axis of one).
        values[f"rank {rank}"] = np.full((2,) * rank, 1.0 + worker, np.float32)
    ext = strategy.extended
    for name, value in values.items():
        for op in ("SUM", "MEAN"):
            for axis in (None, 0) if name != "rank 0" else (None,):
                results[f"{op} {name} {axis}"] = np.asarray(
                    strategy.reduce(op, value, axis=axis)).tolist()
            results[f"reduce_to {op} {name}"] = [np.asarray(v).tolist() for v in (
                strategy.experimental_local_results(ext.reduce_to(op, value, replica)))]
            results[f"batch_reduce_to {op} {name}"] = [np.asarray(v).tolist() for v in (
                ext.batch_reduce_to(op, [(value, replica), (value, ext.worker_devices[0])]))]
        if name != "rank 0":
            results[f"gather {name}"] = np.asarray(strategy.gather(value, 0)).tolist()
    return results


def main():
    mode, out, files = sys.argv[1], sys.argv[2], sys.argv[3:]
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    if mode == "tf":
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        context, total = tf.distribute.get_replica_context, tf.reduce_sum
        worker = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    else:
        import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
        import jdist  # pylint: disable=import-outside-toplevel
        strategy = jdist.MultiWorkerMirroredStrategy()
        context, total = jdist.get_replica_context, jnp.sum
        worker = strategy.extended._input_pipeline()[1]

    def host(value):
        return np.asarray(value).tolist()

    def step(batch):
        return [context().all_reduce("sum", total(v)) for v in tf.nest.flatten(batch)]

    results = {}
    distributed = {name: strategy.experimental_distribute_dataset(dataset)
                   for name, dataset in datasets(tf, files).items()}
    # Each worker's own pipeline (PER_WORKER): worker 0's 5 rows end a step before worker 1's 8.
    distributed["from_function"] = strategy.distribute_datasets_from_function(
        lambda ctx: tf.data.Dataset.range(5 + 3 * ctx.input_pipeline_id).batch(2))
    for name, dataset in distributed.items():
        iterator, steps = iter(dataset), []
        while True:
            optional = iterator.get_next_as_optional()
            if not optional.has_value():
                break
            batch = optional.get_value()
            summed = strategy.run(step, args=(batch,))
            steps.append({
                "local": [tf.nest.map_structure(host, v)
                          for v in strategy.experimental_local_results(batch)],
                "sums": [float(np.asarray(strategy.experimental_local_results(v)[0]))
                         for v in summed],
                "gather": tf.nest.map_structure(lambda v: host(strategy.gather(v, 0)), batch)})
        results[name] = {"cardinality": int(dataset.cardinality), "steps": steps}
    # TF's replica-context all_gather across workers needs a tf.function (eagerly it fails).
    compiled = tf.function if mode == "tf" else (lambda f: f)
    gathered = compiled(lambda v: strategy.run(lambda v: context().all_gather(v * 2.0, 0),
                                               args=(v,)))
    ragged = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.arange(ctx.replica_id_in_sync_group + 2, dtype=np.float32) * 1.5)
    results["values_from_function"] = {
        "local": [host(v) for v in strategy.experimental_local_results(ragged)],
        "sums": [float(np.asarray(strategy.experimental_local_results(v)[0]))
                 for v in strategy.run(step, args=(ragged,))],
        "gather": host(strategy.gather(ragged, 0)),
        "reduce": host(strategy.reduce("sum", ragged, axis=0)),
        "reduce_mean": host(strategy.reduce("mean", ragged, axis=0)),
        "all_gather": [host(v) for v in strategy.experimental_local_results(gathered(ragged))]}
    results["negative_axis"] = negative_axis_gathers(strategy, context, compiled, np)
    results["plain_values"] = plain_values(strategy, context, compiled, np, worker)
    results["collective_dtypes"] = collective_dtypes(strategy, context, compiled, np)
    results["_training"] = (tf_training if mode == "tf" else jdist_training)(tf, strategy, np)
    ext, resolver = strategy.extended, strategy.cluster_resolver
    results["surface"] = {
        "num_replicas_in_sync": strategy.num_replicas_in_sync,
        "worker_devices": len(ext.worker_devices), "parameter_devices": len(
            ext.parameter_devices), "should_checkpoint": ext.should_checkpoint,
        "should_save_summary": ext.should_save_summary,
        "should_init": [ext.experimental_should_init,  # TF has no plain should_init.
                        getattr(ext, "should_init", ext.experimental_should_init)],
        "between_graph": ext.experimental_between_graph,
        "task": [resolver.task_type, resolver.task_id],
        "cluster": {job: len(tasks) for job, tasks in  # The launchers pick other ports.
                    resolver.cluster_spec().as_dict().items()}}
    with open(f"{out}.{worker}", "w", encoding="utf-8") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
