"""One worker of `bench_multi_worker.py`: an MLP trained with Adam and timed (jdist, JAX or TF).

    python multi_worker_step.py {jdist,jax,tf} {mlp,deep} STEPS

Run under ``python -m jdist.launch --nproc 2`` (``TF_CONFIG`` names the job), or alone (jdist
then runs ``MirroredStrategy`` over the local devices). Every way trains the same model on the
same global batches of 128 rows from the same initial weights, with each replica's gradient
all-reduced (SUM of per-example losses over the global batch) before Adam; worker 0 prints one
JSON line: steps/s over ``STEPS`` timed steps (after 20 untimed ones) and the last loss.
``mlp`` is the digits-sized 64-256-256-10 network (6 leaves, 85,002 parameters); ``deep`` has 16
dense layers of 64 (32 leaves): the same collective work spread over many small gradients.
"""

import json
import os
import sys
import time

import numpy as np

MODELS = {"mlp": (64, 256, 256, 10), "deep": (64,) * 16 + (10,)}
BATCH, WARMUP, LR = 128, 20, 1e-3


def data(layers, batches=10):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(batches * BATCH, layers[0])).astype(np.float32),
            rng.integers(0, layers[-1], size=batches * BATCH).astype(np.int32))


def init(layers):
    rng = np.random.default_rng(1)
    params = {}
    for i, (a, b) in enumerate(zip(layers[:-1], layers[1:])):
        params[f"w{i:02d}"] = (rng.normal(size=(a, b)) * np.sqrt(2.0 / a)).astype(np.float32)
        params[f"b{i:02d}"] = np.zeros((b,), np.float32)
    return params


def jax_pieces(layers):
    """The loss and the Adam update in JAX (no optax: the TF environment lacks it)."""
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

    def loss(params, x, y):
        for i in range(len(layers) - 1):
            x = x @ params[f"w{i:02d}"] + params[f"b{i:02d}"]
            x = jax.nn.relu(x) if i < len(layers) - 2 else x
        logp = jax.nn.log_softmax(x)
        return -jnp.sum(jnp.take_along_axis(logp, y[:, None], axis=1)) / BATCH

    def adam(params, state, grads):
        m, v, t = state
        t = t + 1
        m = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, m, grads)
        v = jax.tree.map(lambda v, g: 0.999 * v + 0.001 * g * g, v, grads)
        scale = LR * jnp.sqrt(1 - 0.999 ** t) / (1 - 0.9 ** t)
        params = jax.tree.map(lambda p, m, v: p - scale * m / (jnp.sqrt(v) + 1e-7), params, m, v)
        return params, (m, v, t)

    def zeros(params):
        return (jax.tree.map(jnp.zeros_like, params), jax.tree.map(jnp.zeros_like, params),
                jnp.zeros((), jnp.float32))
    return loss, adam, zeros


def run_jdist(layers, steps):
    import jdist  # pylint: disable=import-outside-toplevel
    strategy = jdist.MultiWorkerMirroredStrategy()  # One task: MirroredStrategy.
    import jax  # pylint: disable=import-outside-toplevel
    loss_fn, adam, zeros = jax_pieces(layers)

    def step(params, state, x, y):
        ctx = jdist.get_replica_context()
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        params, state = adam(params, state, ctx.all_reduce("sum", grads))
        return params, state, ctx.all_reduce("sum", loss)

    dataset = strategy.experimental_distribute_dataset(
        strategy.experimental_make_numpy_dataset(data(layers)).batch(BATCH))
    params = jax.tree.map(jax.numpy.asarray, init(layers))
    state = zeros(params)

    def batches():
        while True:
            yield from dataset
    it = batches()
    for _ in range(WARMUP):
        params, state, loss = strategy.run(step, args=(params, state, *next(it)))
    float(strategy.experimental_local_results(loss)[0])
    start = time.perf_counter()
    for _ in range(steps):
        params, state, loss = strategy.run(step, args=(params, state, *next(it)))
    loss = float(strategy.experimental_local_results(loss)[0])
    return time.perf_counter() - start, loss, jax.process_index()


def run_jax(layers, steps):
    """jax.distributed + jit(shard_map) + psum, the batches already on the devices."""
    import jax  # pylint: disable=import-outside-toplevel
    config = json.loads(os.environ.get("TF_CONFIG", "{}"))
    if config:
        workers = config["cluster"]["worker"]
        jax.distributed.initialize(workers[0], len(workers), config["task"]["index"])
    from jax.sharding import NamedSharding  # pylint: disable=import-outside-toplevel
    from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel
    loss_fn, adam, zeros = jax_pieces(layers)
    mesh = jax.make_mesh((jax.device_count(),), ("r",))

    def step(params, state, x, y):
        # Per-replica gradients (JAX would psum those of unvarying parameters itself), summed once.
        varying = jax.tree.map(lambda p: jax.lax.pcast(p, "r", to="varying"), params)
        loss, grads = jax.value_and_grad(loss_fn)(varying, x, y)
        params, state = adam(params, state, jax.lax.psum(grads, "r"))
        return params, state, jax.lax.psum(loss, "r")
    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("r"), P("r")),
                                 out_specs=(P(), P(), P())), donate_argnums=(0, 1))
    x, y = data(layers)
    rows = np.arange(len(x)).reshape(-1, jax.device_count(), BATCH // jax.device_count())
    local = rows[:, jax.process_index() * jax.local_device_count():][:, :jax.local_device_count()]
    shard = NamedSharding(mesh, P("r"))
    xs = [jax.make_array_from_process_local_data(shard, x[r.ravel()], (BATCH, x.shape[1]))
          for r in local]
    ys = [jax.make_array_from_process_local_data(shard, y[r.ravel()], (BATCH,)) for r in local]
    rep = NamedSharding(mesh, P())
    params = jax.device_put(init(layers), rep)
    state = jax.device_put(zeros(init(layers)), rep)
    for i in range(WARMUP):
        params, state, loss = step(params, state, xs[i % len(xs)], ys[i % len(ys)])
    loss.block_until_ready()
    start = time.perf_counter()
    for i in range(steps):
        params, state, loss = step(params, state, xs[i % len(xs)], ys[i % len(ys)])
    loss = float(loss.addressable_data(0))
    return time.perf_counter() - start, loss, jax.process_index()


def run_tf(layers, steps):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    params0 = init(layers)
    with strategy.scope():
        params = {k: tf.Variable(v) for k, v in params0.items()}
        optimizer = tf.keras.optimizers.Adam(LR, epsilon=1e-7)
        optimizer.build(list(params.values()))
    names = sorted(params)
    x, y = data(layers)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).repeat()
    it = iter(strategy.experimental_distribute_dataset(dataset))

    def replica(x, y):
        with tf.GradientTape() as tape:
            h = x
            for i in range(len(layers) - 1):
                h = h @ params[f"w{i:02d}"] + params[f"b{i:02d}"]
                h = tf.nn.relu(h) if i < len(layers) - 2 else h
            loss = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(y, h)) / BATCH
        grads = tape.gradient(loss, [params[k] for k in names])
        optimizer.apply_gradients(zip(grads, [params[k] for k in names]))
        return loss

    @tf.function
    def step(x, y):
        per_replica = strategy.run(replica, args=(x, y))
        return strategy.reduce("sum", per_replica, axis=None)

    for _ in range(WARMUP):
        loss = step(*next(it))
    float(loss)
    start = time.perf_counter()
    for _ in range(steps):
        loss = step(*next(it))
    loss = float(loss)
    return time.perf_counter() - start, loss, strategy.cluster_resolver.task_id or 0


def main():
    way, model, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    runner = {"jdist": run_jdist, "jax": run_jax, "tf": run_tf}[way]
    seconds, loss, index = runner(MODELS[model], steps)
    if index == 0:
        print(json.dumps({"steps_per_s": steps / seconds, "loss": loss}), flush=True)


if __name__ == "__main__":
    main()
