"""What ``strategy.run`` costs over a hand-written ``jax.jit(jax.shard_map(...))`` program.

Two measurements on eight simulated CPU devices:

* ``run_throughput``: a data-parallel MLP training step (Adam, gradients all-reduced), written
  once by hand as ``jit(shard_map)`` and once as a replica function for ``strategy.run``; same
  model, same data already on the devices, same number of steps, and checked to end with the
  same parameters. The two loops alternate in blocks, so load from other processes on the
  machine hits both alike; the median block time of each is reported, and the ratio is the
  median over rounds of the two blocks' ratio in the round. The hand-written loop waits on one
  output of each step exactly where jdist's CPU guard does (several CPU devices), and
  dispatches ahead where it does not (one device).
  Target: jdist reaches at least 95% of the hand-written steps/s.
* ``run_overhead``: the host-side cost ``strategy.run`` adds per call (argument classification,
  the program cache lookup, wrapping outputs), measured on a step too small to hide it
  (``x + 1`` on a (8, 4) PerReplica), against the same program called directly. The two
  alternate call by call and the medians of the single-call times are compared. Target: under
  50 µs per call.

A missed target is printed as MISSED; the exit status stays 0 so ``make bench`` runs every
benchmark. Run it with ``python benchmarks/bench_run.py`` (``make bench`` runs all of them).
"""

import common  # noqa: F401  (first: it requests the simulated devices)

import statistics  # noqa: E402
import time  # noqa: E402
from typing import NamedTuple  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jdist  # noqa: E402

REPLICAS = 8
LAYERS = (64, 256, 256, 10)
PER_REPLICA_BATCH = 16
NUM_BATCHES = 4  # Distinct batches cycled through, so no step sees constant inputs.
ROUNDS = 31  # About 10 s a side on 8 CPU devices: rounds vary by 5-10% here.
STEPS_PER_BLOCK = 50
OVERHEAD_WARMUP = 100
OVERHEAD_CALLS = 3000
THROUGHPUT_TARGET = 0.95
OVERHEAD_TARGET_US = 50.0
AXIS = "replica"


def init_params(key):
    return common.init_mlp(key, LAYERS)


def loss_fn(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(common.mlp_logits(params, x), y).mean()


OPTIMIZER = optax.adam(1e-3)


def train_step(params, opt_state, x, y, all_reduce_mean):
    """One replica's training step; the two variants differ only in how they all-reduce."""
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    grads = all_reduce_mean(grads)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, all_reduce_mean(loss)


def hand_step(params, opt_state, x, y):
    return train_step(params, opt_state, x, y, lambda t: lax.pmean(t, AXIS))


def jdist_step(params, opt_state, x, y):
    ctx = jdist.get_replica_context()
    return train_step(params, opt_state, x, y, lambda t: ctx.all_reduce("mean", t))


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_throughput(strategy, mesh, rounds=ROUNDS):
    """Median steps/s of the hand-written loop and of jdist's, on ``strategy``'s replicas."""
    replicas = strategy.num_replicas_in_sync
    rng = np.random.default_rng(0)
    per_replica = NamedSharding(mesh, P(AXIS))
    replicated = NamedSharding(mesh, P())
    global_batch = replicas * PER_REPLICA_BATCH
    xs = [rng.normal(size=(global_batch, LAYERS[0])).astype(np.float32)
          for _ in range(NUM_BATCHES)]
    ys = [rng.integers(0, LAYERS[-1], size=global_batch).astype(np.int32)
          for _ in range(NUM_BATCHES)]

    # Hand-written: the global batch sharded along its rows, one block per device. check_vma=False
    # as pmap does: with it on, the gradient with respect to the replicated parameters would
    # already be summed over the replicas (an extra all-reduce, and num_replicas times the
    # gradient once pmean runs on top).
    hand = jax.jit(jax.shard_map(hand_step, mesh=mesh, in_specs=(P(), P(), P(AXIS), P(AXIS)),
                                 out_specs=(P(), P(), P()), check_vma=False))
    hand_batches = [(jax.device_put(x, per_replica), jax.device_put(y, per_replica))
                    for x, y in zip(xs, ys)]
    params = jax.device_put(init_params(jax.random.key(0)), replicated)
    hand_state = [params, jax.device_put(OPTIMIZER.init(params), replicated)]

    # jdist: the same rows as PerReplica values, one slice per replica.
    def distribute(x, y):
        def value_fn(ctx):
            rows = slice(ctx.replica_id_in_sync_group * PER_REPLICA_BATCH,
                         (ctx.replica_id_in_sync_group + 1) * PER_REPLICA_BATCH)
            return x[rows], y[rows]
        return strategy.experimental_distribute_values_from_function(value_fn)
    jdist_batches = [distribute(x, y) for x, y in zip(xs, ys)]
    params = init_params(jax.random.key(0))
    jdist_state = [params, OPTIMIZER.init(params)]

    waits = common.guard_waits(strategy)

    def hand_block():
        p, o = hand_state
        outputs = ()
        for i in range(STEPS_PER_BLOCK):
            # The CPU runtime can deadlock when a collective program is dispatched while the
            # previous one still runs on some simulated devices (docs/cpu_devices.md). jdist
            # waits on ONE output of the previous step before each dispatch on several CPU
            # devices (a device finishes all its outputs at once); the hand-written loop does
            # the same, and where jdist does not wait (one device), neither does it.
            if outputs and waits:
                outputs[2].block_until_ready()
            x, y = hand_batches[i % NUM_BATCHES]
            outputs = p, o, _ = hand(p, o, x, y)
        jax.block_until_ready(outputs)
        hand_state[:] = p, o

    def jdist_block():
        p, o = jdist_state
        outputs = ()
        for i in range(STEPS_PER_BLOCK):
            x, y = jdist_batches[i % NUM_BATCHES]
            outputs = p, o, _ = strategy.run(jdist_step, args=(p, o, x, y))
        jax.block_until_ready(outputs)
        jdist_state[:] = p, o

    # Both loops compute the same thing: one step from the same state agrees, to rounding (if
    # not, the comparison means nothing). Hundreds of steps would not: XLA folds pmean's 1 / n
    # into the optimizer's constants, jdist divides as TF does, and Adam amplifies the
    # last-bit differences of tiny gradients.
    one_hand = hand(*hand_state, *hand_batches[0])
    one_jdist = strategy.run(jdist_step, args=(*jdist_state, *jdist_batches[0]))
    for hand_leaf, jdist_leaf in zip(jax.tree.leaves(one_hand), jax.tree.leaves(one_jdist)):
        np.testing.assert_allclose(np.asarray(jdist_leaf), np.asarray(hand_leaf), rtol=1e-5,
                                   atol=1e-7)
    hand_block()  # Compile and warm up both before timing.
    jdist_block()
    hand_times, jdist_times = [], []
    for i in range(rounds):  # Alternating which goes first, so drift hits both alike.
        pairs = ((hand_block, hand_times), (jdist_block, jdist_times))
        for block, times in pairs[::1 - 2 * (i % 2)]:
            times.append(timed(block))
    return Throughput(STEPS_PER_BLOCK / statistics.median(hand_times),
                      STEPS_PER_BLOCK / statistics.median(jdist_times),
                      common.paired_ratio({"hand": hand_times, "jdist": jdist_times},
                                          "hand", "jdist"))


class Throughput(NamedTuple):
    """`bench_throughput`'s figures: the median steps/s of each loop, and ``ratio``, the median
    over rounds of jdist's steps/s over the hand-written loop's in the same round (pairing
    cancels the drifts of the machine's load, which block times here vary by 20-30% with)."""
    hand: float
    jdist: float
    ratio: float


def report_throughput(hand_rate, jdist_rate, ratio):
    verdict = "" if ratio >= THROUGHPUT_TARGET else "  MISSED"
    common.record("run", f"training throughput, jdist / hand-written, {REPLICAS} replicas", ratio,
                  "x", f">= {THROUGHPUT_TARGET}", ratio >= THROUGHPUT_TARGET,
                  f"hand {hand_rate:.0f}, jdist {jdist_rate:.0f} steps/s")
    print(f"run_throughput: hand={hand_rate:.0f} steps/s, jdist={jdist_rate:.0f} steps/s, "
          f"ratio={ratio:.2f} (target >= {THROUGHPUT_TARGET}){verdict}")


def plus_one(x):
    return x + 1


def bench_overhead(strategy, mesh):
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.zeros(4, np.float32))
    stacked = value.stacked  # The (8, 4) array sharded over the replicas that run unpacks.
    # The same program strategy.run compiles: each replica sees its (4,) row.
    raw = jax.jit(jax.shard_map(lambda block: plus_one(block[0])[None], mesh=mesh,
                                in_specs=(P(AXIS),), out_specs=P(AXIS), check_vma=False))
    calls = {
        "raw": lambda: raw(stacked).block_until_ready(),
        "jdist": lambda: strategy.run(plus_one, args=(value,)).stacked.block_until_ready(),
    }
    for call in calls.values():
        for _ in range(OVERHEAD_WARMUP):
            call()
    # Calls alternate one by one (in alternating order) and each is timed alone: a ~30 us
    # difference between ~150 us calls is otherwise lost in the load of other processes on a
    # two-core machine; the median per call ignores the calls that got preempted.
    samples = {name: [] for name in calls}
    for i in range(OVERHEAD_CALLS):
        for name in (("raw", "jdist") if i % 2 else ("jdist", "raw")):
            start = time.perf_counter()
            calls[name]()
            samples[name].append(time.perf_counter() - start)
    raw_us = statistics.median(samples["raw"]) * 1e6
    jdist_us = statistics.median(samples["jdist"]) * 1e6
    overhead = jdist_us - raw_us
    verdict = "" if overhead < OVERHEAD_TARGET_US else "  MISSED"
    common.record("run", "strategy.run overhead per call", overhead, "us",
                  f"< {OVERHEAD_TARGET_US:.0f} us", overhead < OVERHEAD_TARGET_US,
                  f"raw {raw_us:.1f} us, jdist {jdist_us:.1f} us")
    print(f"run_overhead: raw={raw_us:.1f} us, jdist={jdist_us:.1f} us, "
          f"overhead={overhead:.1f} us (target < {OVERHEAD_TARGET_US:.0f} us){verdict}")


def main():
    devices = jax.devices()[:REPLICAS]
    if len(devices) < REPLICAS:
        raise SystemExit(f"bench_run needs {REPLICAS} devices, found {len(devices)}.")
    strategy = jdist.MirroredStrategy(devices)
    mesh = Mesh(np.array(devices), (AXIS,))
    report_throughput(*bench_throughput(strategy, mesh))
    bench_overhead(strategy, mesh)


if __name__ == "__main__":
    main()
