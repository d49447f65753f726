"""One program run as TF's ``MultiWorkerMirroredStrategy`` (``tf``) and as jdist's (``jdist``),
2 workers x 1 CPU replica each, by ``test_multi_worker_tf.py``: every distributed dataset below
(and a ``distribute_datasets_from_function`` one) read to its end with ``get_next_as_optional``, writing per step this worker's replicas' values,
each leaf's all-reduced sum, the gathered global batch, and the dataset's cardinality, to
``<out>.<worker>`` as JSON; then values from a function, of a different length per replica.

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
            "static": tf.data.Dataset.range(20).batch(6, drop_remainder=True)}


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
        worker = strategy.extended.input_pipeline()[1]

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
    ragged = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.arange(ctx.replica_id_in_sync_group + 2, dtype=np.float32) * 1.5)
    results["values_from_function"] = {
        "local": [host(v) for v in strategy.experimental_local_results(ragged)],
        "sums": [float(np.asarray(strategy.experimental_local_results(v)[0]))
                 for v in strategy.run(step, args=(ragged,))],
        "gather": host(strategy.gather(ragged, 0)),
        "reduce": host(strategy.reduce("sum", ragged, axis=0))}
    with open(f"{out}.{worker}", "w", encoding="utf-8") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
