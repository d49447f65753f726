"""Training throughput against the number of replicas: jdist, the hand-written loop, and TF.

The training step of ``bench_run.py`` (an MLP, Adam, gradients all-reduced) with 16 rows per
replica (weak scaling: the global batch grows with the replicas), on 1, 2, 4 and 8 of the
simulated CPU devices, timed as ``bench_run`` times it: jdist's ``strategy.run`` and the
hand-written ``jit(shard_map)`` loop alternate in blocks, medians of the blocks are reported.
The figure is examples/s; the ratio jdist / hand-written (the median of per-round ratios, over
more rounds for fewer replicas, whose blocks are shorter) is the page's headline per count.
With TensorFlow installed (``make bench`` runs in the TF environment), the same step under
``tf.distribute.MirroredStrategy`` (with ``ReductionToOneDevice``) on as many logical CPU devices
is timed too. Simulated devices share this machine's cores, so throughput does not grow with the
count as it does on real accelerators: what the numbers show is what jdist costs over the
hand-written loop at each count. Run: ``python benchmarks/bench_scaling.py``.
"""

import common  # noqa: F401  (first: it requests the simulated devices)

import importlib.util  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import bench_run  # noqa: E402
import jdist  # noqa: E402

COUNTS = (1, 2, 4, 8)
ROUNDS = 15  # With 5, one run read 0.91 at 8 replicas where bench_run (31 rounds) read 0.97.


def tf_examples_per_second(replicas):
    """Examples/s of the same MLP step under tf.distribute (logical CPU devices)."""
    import time  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    cpu = tf.config.list_physical_devices("CPU")[0]
    if tf.config.get_logical_device_configuration(cpu) is None:  # Before TF initialises.
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * max(COUNTS))
    # ReductionToOneDevice: TF's CPU collectives keep their groups per process, so a second
    # strategy over other devices fails to join them ("joining a group with size 4, but that
    # group has size 2"); it is also the TF all-reduce whose numbers jdist's are.
    strategy = tf.distribute.MirroredStrategy([f"CPU:{i}" for i in range(replicas)],
                                              tf.distribute.ReductionToOneDevice())
    layers = bench_run.LAYERS
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Dense(n, activation="relu")
                                     for n in layers[1:-1]] + [tf.keras.layers.Dense(layers[-1])])
        model.build((None, layers[0]))
        optimizer = tf.keras.optimizers.Adam(1e-3)
        optimizer.build(model.trainable_variables)  # Its slots mirrored, made in the scope.
    batch = replicas * bench_run.PER_REPLICA_BATCH
    rng = np.random.default_rng(0)
    data = tf.data.Dataset.from_tensor_slices((
        rng.normal(size=(batch * 4, layers[0])).astype(np.float32),
        rng.integers(0, layers[-1], size=batch * 4).astype(np.int32))).batch(batch).repeat()
    iterator = iter(strategy.experimental_distribute_dataset(data))

    @tf.function
    def step(x, y):
        def replica(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.keras.losses.sparse_categorical_crossentropy(
                    y, model(x), from_logits=True)) / batch
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
        strategy.run(replica, args=(x, y))

    for _ in range(5):
        step(*next(iterator))
    start = time.perf_counter()
    for _ in range(bench_run.STEPS_PER_BLOCK):
        step(*next(iterator))
    return bench_run.STEPS_PER_BLOCK * batch / (time.perf_counter() - start)


def main():
    has_tf = importlib.util.find_spec("tensorflow") is not None
    for n in COUNTS:
        devices = jax.devices()[:n]
        strategy = jdist.MirroredStrategy(devices)
        # Fewer replicas, shorter blocks: more rounds in about the same time.
        hand, ours, ratio = bench_run.bench_throughput(
            strategy, Mesh(np.array(devices), ("replica",)), rounds=ROUNDS * max(COUNTS) // n)
        examples = n * bench_run.PER_REPLICA_BATCH
        data = {"replicas": n, "hand": hand * examples, "jdist": ours * examples}
        if has_tf:
            data["tf"] = tf_examples_per_second(n)
        detail = ", ".join(f"{k} {v:.0f}" for k, v in data.items() if k != "replicas")
        detail += " examples/s"
        common.record("scaling", f"training throughput, jdist / hand-written, {n} replicas",
                      ratio, "x", f">= {bench_run.THROUGHPUT_TARGET}",
                      ratio >= bench_run.THROUGHPUT_TARGET, detail, **data)
        print(f"scaling: {n} replicas: {detail}, ratio {ratio:.2f}", flush=True)
    if not has_tf:
        print("scaling: TensorFlow is not installed; its curve is left out.")


if __name__ == "__main__":
    main()
