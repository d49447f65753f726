"""One program run as TF's ``MultiWorkerMirroredStrategy`` (``tf``) and as jdist's (``jdist``),
2 workers x 1 CPU replica each, by ``test_multi_worker_tf.py``: every distributed dataset below
read to its end with ``get_next_as_optional``, writing per step this worker's replicas' values,
each leaf's all-reduced sum, the gathered global batch, and the dataset's cardinality, to
``<out>.<worker>`` as JSON.

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
    for name, dataset in datasets(tf, files).items():
        distributed = strategy.experimental_distribute_dataset(dataset)
        iterator, steps = iter(distributed), []
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
        results[name] = {"cardinality": int(distributed.cardinality), "steps": steps}
    with open(f"{out}.{worker}", "w", encoding="utf-8") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
