"""Input at device speed: distributed datasets against batches already on the devices.

Every figure is a ratio of two loops interleaved in rounds, in a new random order each round
(medians of per-round ratios, so load from other processes hits both alike, and no loop always
follows the same one; the slow loader's pair runs in order, as its delay is measured first),
on simulated CPU devices:

* ``prefetched / on-device``: a loader that sleeps one step time per batch (a stand-in for
  decoding) feeds ``experimental_distribute_dataset``; its background thread splits and
  transfers while the step runs. Target >= 0.8 (the slower of loading and step, not their sum).
* ``numpy dataset / on-device``: ``experimental_make_numpy_dataset(...).batch(...)`` with default
  options feeds a dispatch-bound step for epochs of 256 batches (one distributed dataset
  iterated once per round, as a TF loop does), against the same batches placed on the devices
  beforehand, one array per leaf. Its batches are read in place: arrays over the dataset's own
  rows, made by the loop's own thread at the first epoch and kept (`in_place_batches`). Also
  shown: the dataset's elements made beforehand, a numpy dataset's first epoch (its arrays
  made as it goes), the hand-written loop (one ``jax.device_put`` per batch) and the
  dataset shuffled whole and with a buffer of 1024 (tf.data's order, in blocks of 64 batches
  copied each epoch; the shuffle's work is not hidden). Target >= 0.95: feeding costs the step
  nothing. For reference, the same on 60-batch epochs and an epoch's extra cost in ms.
* ``dataset alone / one device_put``: the per-batch cost of iterating the distributed dataset
  (global batch 1024, 8 replicas) against one ``jax.device_put`` of the same global batch with
  the replica sharding (what a hand-written loop does). Target <= 1.5.
* ``1 replica: dataset batch / placed batch``: ``run`` on a batch from the dataset against one
  placed by hand on the strategy's device (a dataset batch must not be placed again per step).
  Target <= 1.05.
* ``1 replica: numpy dataset / on-device`` (reference): the numpy dataset's plain one-replica
  batches, cut out of placed blocks on the device, against the same batches placed beforehand;
  also the hand-written loop (one ``jax.device_put`` per batch).

A missed target prints MISSED; the exit status stays 0. Run with
``python benchmarks/bench_input.py`` (``make bench`` runs all).
"""

import common  # noqa: F401  (first: it requests the simulated devices)

import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jdist  # noqa: E402

REPLICAS = 8
LAYERS = (64, 512, 512, 10)
SMALL_LAYERS = (64, 32, 10)  # The dispatch-bound step.
GLOBAL_BATCH = 256
STEPS = 60  # Batches per loop.
ROUNDS = 7
EPOCH_BATCHES = 256  # The numpy dataset's epoch: several blocks, as in training.
NUMPY_ROUNDS = 41  # Its loops take about 0.3 s each: 15 rounds read 0.83-0.97 in eight runs.
REFERENCE_ROUNDS = 7
SHORT_EPOCH_ROUNDS = 41  # 60-batch loops: 7 rounds read 0.89 and 0.94 in two runs.
LEARNING_RATE = 0.05


def loss_fn(params, x, y):
    h = common.mlp_logits(params, x)
    return -jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(h), y[:, None], axis=1))


def train_step(params, batch):
    grads = jax.grad(loss_fn)(params, batch["x"], batch["y"])
    grads = jdist.get_replica_context().all_reduce("sum", grads)
    return jax.tree_util.tree_map(lambda p, g: p - LEARNING_RATE / GLOBAL_BATCH * g, params, grads)


class SlowLoader:
    """Yields the given global batches, sleeping ``delay`` seconds before each."""

    def __init__(self, batches, delay):
        self.batches, self.delay = batches, delay

    def __iter__(self):
        for batch in self.batches:
            time.sleep(self.delay)
            yield batch


def timed_loop(strategy, params, elements):
    """Seconds per step of ``run(train_step)`` over ``elements``."""
    start, count = time.perf_counter(), 0
    for batch in elements:
        params = strategy.run(train_step, args=(params, batch))
        count += 1
    jax.block_until_ready(params)
    return (time.perf_counter() - start) / count


def make_data(steps, batch, features=LAYERS[0]):
    rng = np.random.default_rng(0)
    return {"x": rng.normal(size=(steps * batch, features)).astype(np.float32),
            "y": rng.integers(0, LAYERS[-1], size=(steps * batch,)).astype(np.int32)}


def interleaved(loops, rounds=ROUNDS, ordered=False):
    """Runs each ``loops[name]()`` once per round; returns the times by name. The order is a
    new random one each round unless ``ordered``: a loop runs a few percent faster or slower
    after some loops than after others here, which a fixed order turns into a bias."""
    times, rng = {name: [] for name in loops}, np.random.default_rng(0)
    for _ in range(rounds):
        for name in (list(loops) if ordered else rng.permutation(list(loops))):
            times[name].append(loops[name]())
    return times


def report(metric, ratio, target, met, detail):
    verdict = "" if met else "  MISSED"
    common.record("input", metric, ratio, "x", target, met, detail)
    print(f"input: {metric} = {ratio:.2f} (target {target}){verdict}; {detail}")


def bench_slow_loader(strategy):
    data = make_data(STEPS, GLOBAL_BATCH)
    batches = [jax.tree_util.tree_map(lambda a, i=i: a[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH],
                                      data) for i in range(STEPS)]
    params = strategy.run(lambda: common.init_mlp(jax.random.key(0), LAYERS))
    on_device = list(strategy.experimental_distribute_dataset(batches))
    loader = SlowLoader(batches, 0.0)

    def on_device_loop():
        # The loader then sleeps exactly one step time per batch, whatever the machine's load.
        loader.delay = timed_loop(strategy, params, on_device)
        return loader.delay
    loops = {"on_device": on_device_loop, "prefetched": lambda: timed_loop(
        strategy, params, strategy.experimental_distribute_dataset(loader))}
    interleaved(loops, 1, ordered=True)  # Compile and warm up.
    times = interleaved(loops, ordered=True)  # The loader's delay is measured first.
    ratio = common.paired_ratio(times, "on_device", "prefetched")
    report("prefetched / on-device steps/s", ratio, ">= 0.8", ratio >= 0.8,
           f"{REPLICAS} replicas, loader sleep = step time (median "
           f"{statistics.median(times['on_device']) * 1e3:.1f} ms)")


def numpy_dataset_loops(strategy, data, params, with_references):
    """The loops of `bench_numpy_dataset` over ``data``'s batches: on the devices beforehand,
    from the numpy dataset with default options and (``with_references``) its elements made
    beforehand, one ``jax.device_put`` per batch, as a hand-written JAX loop feeds them, and
    the dataset shuffled whole (``shuffle(len(x))``, as training reads it)."""
    rows = strategy.experimental_make_numpy_dataset(data)
    dataset = rows.batch(GLOBAL_BATCH)
    steps = len(data["y"]) // GLOBAL_BATCH
    sharding = jax.sharding.NamedSharding(strategy.extended.mesh, jax.sharding.PartitionSpec(
        strategy.extended.replica_axis))

    def batch(i):  # What a JAX loop does: one device_put per batch.
        rows = {k: v[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH] for k, v in data.items()}
        placed = jax.device_put({k: v.reshape((REPLICAS, -1) + v.shape[1:])
                                for k, v in rows.items()}, sharding)
        return {k: jdist.PerReplica._from_stacked(v) for k, v in placed.items()}
    on_device = [batch(i) for i in range(steps)]  # Placed beforehand, one by one.
    # One distributed dataset, iterated once per loop (an epoch), as a TF loop iterates it.
    distributed = strategy.experimental_distribute_dataset(dataset)
    loops = {"on_device": lambda: timed_loop(strategy, params, on_device),
             "dataset": lambda: timed_loop(strategy, params, distributed)}
    if with_references:
        premade = list(strategy.experimental_distribute_dataset(dataset))
        loops["premade"] = lambda: timed_loop(strategy, params, premade)
        fresh = strategy.experimental_make_numpy_dataset(data).batch(GLOBAL_BATCH)

        def first_epoch():  # What the first pass over a numpy dataset costs: nothing kept.
            fresh.placements.clear()
            return timed_loop(strategy, params, strategy.experimental_distribute_dataset(fresh))
        loops["first_epoch"] = first_epoch
        loops["device_put"] = lambda: timed_loop(strategy, params,
                                                 (batch(i) for i in range(steps)))
        for name, buffer in (("shuffled", len(data["y"])), ("shuffled_1024", 1024)):
            shuffled = strategy.experimental_distribute_dataset(
                rows.shuffle(buffer, seed=1).batch(GLOBAL_BATCH))
            loops[name] = lambda shuffled=shuffled: timed_loop(strategy, params, shuffled)
    return loops


def bench_numpy_dataset(strategy):
    params = strategy.run(lambda: common.init_mlp(jax.random.key(0), SMALL_LAYERS))
    data = make_data(EPOCH_BATCHES, GLOBAL_BATCH, SMALL_LAYERS[0])
    loops = numpy_dataset_loops(strategy, data, params, with_references=True)
    interleaved(loops, 1)
    # The target's pair alone: after the references' loops (hundreds of buffers placed and
    # freed), the next loop ran 3-5% slower here, whichever it was.
    pair = interleaved({k: loops[k] for k in ("on_device", "dataset")}, NUMPY_ROUNDS)
    refs = interleaved({k: loops[k] for k in ("on_device", "premade", "first_epoch",
                                              "device_put", "shuffled", "shuffled_1024")},
                       REFERENCE_ROUNDS)
    ratio = common.paired_ratio(pair, "on_device", "dataset")
    us = {k: f"{statistics.median(v) * 1e6:.0f}" for k, v in {**refs, **pair}.items()}
    report(f"numpy dataset / on-device steps/s (dispatch-bound step, {EPOCH_BATCHES}-batch "
           "epochs)", ratio, ">= 0.95", ratio >= 0.95,
           f"{REPLICAS} replicas, us per step: on device {us['on_device']}, dataset "
           f"{us['dataset']}; its elements made beforehand "
           f"{common.paired_ratio(refs, 'on_device', 'premade'):.2f} ({us['premade']} us), "
           f"a numpy dataset's first epoch "
           f"{common.paired_ratio(refs, 'on_device', 'first_epoch'):.2f} "
           f"({us['first_epoch']} us), "
           f"hand-written device_put "
           f"{common.paired_ratio(refs, 'on_device', 'device_put'):.2f} ({us['device_put']} us), "
           f"the dataset shuffled whole {common.paired_ratio(refs, 'on_device', 'shuffled'):.2f} "
           f"({us['shuffled']} us), with a buffer of 1024 "
           f"{common.paired_ratio(refs, 'on_device', 'shuffled_1024'):.2f} "
           f"({us['shuffled_1024']} us)")
    bench_short_epochs(strategy, params)


def bench_short_epochs(strategy, params):
    """The numpy dataset on 60-batch epochs (reference): one block of elements, made before
    the first step, so the epoch's start weighs four times as much as on 256-batch epochs."""
    loops = numpy_dataset_loops(strategy, make_data(STEPS, GLOBAL_BATCH, SMALL_LAYERS[0]),
                                params, with_references=False)
    times = interleaved(loops, SHORT_EPOCH_ROUNDS)
    ratio = common.paired_ratio(times, "on_device", "dataset")
    extra_ms = (statistics.median(times["dataset"])
                - statistics.median(times["on_device"])) * STEPS * 1e3
    common.record("input", f"the same, {STEPS}-batch epochs (reference)", ratio, "x",
                  detail=f"an epoch takes {extra_ms:+.1f} ms against on-device batches "
                  "(medians; its elements are made, their arrays were at the first epoch)")
    print(f"input: the same on {STEPS}-batch epochs = {ratio:.2f} (reference): an epoch takes "
          f"{extra_ms:+.1f} ms against on-device batches")


def bench_dataset_alone(strategy, global_batch=1024):
    data = make_data(STEPS, global_batch)
    dataset = strategy.experimental_make_numpy_dataset(data).batch(global_batch)
    sharding = jax.sharding.NamedSharding(strategy.extended.mesh, jax.sharding.PartitionSpec(
        strategy.extended.replica_axis))

    def dataset_loop():
        start = time.perf_counter()
        for element in strategy.experimental_distribute_dataset(dataset):
            last = element
        jax.block_until_ready(jax.tree_util.tree_leaves(last))
        return (time.perf_counter() - start) / STEPS

    def device_put_loop():
        start = time.perf_counter()
        for i in range(STEPS):
            rows = slice(i * global_batch, (i + 1) * global_batch)
            last = jax.device_put({k: v[rows].reshape((REPLICAS, -1) + v.shape[1:])
                                   for k, v in data.items()}, sharding)
        jax.block_until_ready(last)
        return (time.perf_counter() - start) / STEPS
    loops = {"dataset": dataset_loop, "device_put": device_put_loop}
    interleaved(loops, 1)
    times = interleaved(loops)
    ratio = common.paired_ratio(times, "dataset", "device_put")
    us = {k: f"{statistics.median(v) * 1e6:.0f}" for k, v in times.items()}
    report("distributed dataset alone / one device_put, per batch", ratio, "<= 1.5",
           ratio <= 1.5, f"global batch {global_batch}, {REPLICAS} replicas: "
           f"{us['dataset']} us vs {us['device_put']} us")


def bench_one_replica():
    strategy = jdist.MirroredStrategy(jax.devices()[:1])
    data = make_data(1, GLOBAL_BATCH, SMALL_LAYERS[0])
    from_dataset = next(iter(strategy.experimental_distribute_dataset(
        strategy.experimental_make_numpy_dataset(data).batch(GLOBAL_BATCH))))
    placed = jax.device_put(data, jax.sharding.NamedSharding(strategy.extended.mesh,
                                                             jax.sharding.PartitionSpec()))
    params = strategy.run(lambda: common.init_mlp(jax.random.key(0), SMALL_LAYERS))
    # A step takes ~100 us: loops of 10 x STEPS steps, so one hiccup does not decide a round.
    loops = {name: lambda batch=batch: timed_loop(strategy, params, [batch] * (10 * STEPS))
             for name, batch in (("placed", placed), ("dataset", from_dataset))}
    interleaved(loops, 1)
    times = interleaved(loops, 2 * ROUNDS + 1)
    ratio = common.paired_ratio(times, "dataset", "placed")
    report("1 replica: step on a dataset batch / on a placed batch", ratio, "<= 1.05",
           ratio <= 1.05, f"{statistics.median(times['dataset']) * 1e6:.0f} us vs "
           f"{statistics.median(times['placed']) * 1e6:.0f} us per step")


def bench_one_replica_dataset():
    """The numpy dataset on one replica (reference): full batches as plain arrays, each one's
    buffer its rows of the dataset's memory (`host_values.aliased`), made as the loop asks for
    them, against the same arrays placed beforehand, and the hand-written loop's `device_put`
    per batch."""
    strategy = jdist.MirroredStrategy(jax.devices()[:1])
    params = strategy.run(lambda: common.init_mlp(jax.random.key(0), SMALL_LAYERS))
    data = make_data(EPOCH_BATCHES, GLOBAL_BATCH, SMALL_LAYERS[0])
    dataset = strategy.experimental_make_numpy_dataset(data).batch(GLOBAL_BATCH)
    replicated = jax.sharding.NamedSharding(strategy.extended.mesh, jax.sharding.PartitionSpec())

    def batch(i):
        return jax.device_put({k: v[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH]
                               for k, v in data.items()}, replicated)
    on_device = [batch(i) for i in range(EPOCH_BATCHES)]
    distributed = strategy.experimental_distribute_dataset(dataset)
    loops = {"on_device": lambda: timed_loop(strategy, params, on_device),
             "dataset": lambda: timed_loop(strategy, params, distributed),
             "device_put": lambda: timed_loop(strategy, params,
                                              (batch(i) for i in range(EPOCH_BATCHES)))}
    interleaved(loops, 1)
    times = interleaved(loops, REFERENCE_ROUNDS)
    ratio = common.paired_ratio(times, "on_device", "dataset")
    us = {k: f"{statistics.median(v) * 1e6:.0f}" for k, v in times.items()}
    detail = (f"us per step: on device {us['on_device']}, dataset {us['dataset']}, hand-written "
              f"device_put {common.paired_ratio(times, 'on_device', 'device_put'):.2f} "
              f"({us['device_put']} us)")
    common.record("input", "1 replica: numpy dataset / on-device steps/s (reference)", ratio,
                  "x", detail=detail)
    print(f"input: 1 replica: numpy dataset / on-device = {ratio:.2f} (reference); {detail}")


def main():
    strategy = jdist.MirroredStrategy(jax.devices()[:REPLICAS])
    bench_slow_loader(strategy)
    bench_numpy_dataset(strategy)
    bench_dataset_alone(strategy)
    bench_one_replica()
    bench_one_replica_dataset()


if __name__ == "__main__":
    main()
