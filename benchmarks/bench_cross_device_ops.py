"""What packing buys: a batch of small gradients all-reduced in a few collectives, not one each.

On eight (then four) simulated CPU devices, 200 gradients of 1-10 KB each (float32, 20
distinct sizes so warm-up compiles stay short) are all-reduced by the default cross-device ops
(XLA's all-reduce; `NcclAllReduce` compiles to the same program off GPUs):

* packed: one ``batch_reduce`` with ``CommunicationOptions(bytes_per_pack=256 KiB)`` (5 packs),
  and one with no options (TF's default ``num_packs=1``): one compiled program each, holding one
  all-reduce per pack;
* separate: 200 ``reduce`` calls, one compiled all-reduce program launched per gradient.

What packing saves is the fixed cost of a launch (dispatch, the CPU dispatch guard's wait, waking
every device thread); what it cannot save is the per-buffer cost of 200 inputs and 200 outputs on
every device, which both ways pay. On this 2-core machine eight simulated devices make that
per-buffer cost large and load-sensitive, so four replicas are timed too.

Both run after a warm-up (compilation excluded), alternating in rounds so load from other
processes hits both alike; medians are reported, and the speed-up is the median of the rounds'
ratios. Target: packing at least 5x faster. Then the
number of all-reduce operations of the packed program is read from its lowered StableHLO and its
compiled HLO (XLA may merge further), next to the unpacked program's count, and the same for a
packed ``ReplicaContext.all_reduce`` inside a replica function.

A missed target is printed as MISSED; the exit status stays 0 so ``make bench`` runs every
benchmark. Run it with ``python benchmarks/bench_cross_device_ops.py``.
"""

import common  # noqa: F401  (first: it requests the simulated devices)

import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jdist  # noqa: E402
import jdist.testing  # noqa: E402
from jdist._src.reduce import replica_mesh  # noqa: E402

REPLICAS = 8
TIMED_REPLICAS = (8, 4)
GRADIENTS = 200
DISTINCT_SIZES = 20
BYTES_PER_PACK = 256 << 10
ROUNDS = 11
TARGET = 5.0
SUM = jdist.ReduceOp.SUM


def make_gradients(strategy):
    rng = np.random.default_rng(0)
    sizes = rng.integers(1 << 10, 10 << 10, size=DISTINCT_SIZES, endpoint=True) // 4
    picked = rng.choice(sizes, size=GRADIENTS)
    return [strategy.experimental_distribute_values_from_function(
        lambda ctx, k=k: rng.normal(size=k).astype(np.float32)) for k in picked]


def timed(fn):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def time_packing(replicas):
    """Times packed batch_reduce against separate reduce calls on ``replicas`` devices."""
    strategy = jdist.MirroredStrategy(jax.devices()[:replicas])
    ops = strategy.extended._cross_device_ops
    grads = make_gradients(strategy)
    options = jdist.CommunicationOptions(bytes_per_pack=BYTES_PER_PACK)
    pairs = [(g, g) for g in grads]
    total_kb = sum(g.stacked.nbytes // replicas for g in grads) / 1024

    variants = {  # name -> a function running the 200 all-reduces.
        f"batch_reduce, bytes_per_pack={BYTES_PER_PACK >> 10} KiB":
            lambda: [r.value for r in ops.batch_reduce(SUM, pairs, options)],
        "batch_reduce, no options (num_packs=1)":
            lambda: [r.value for r in ops.batch_reduce(SUM, pairs)],
        f"{GRADIENTS} separate reduce calls": lambda: [ops.reduce(SUM, g, g).value for g in grads],
    }
    # Warm-up (compiles) and a correctness check of the packed results.
    expected = variants[f"{GRADIENTS} separate reduce calls"]()
    for name, fn in variants.items():
        for got, want in zip(fn(), expected):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)
    times = {name: [] for name in variants}
    for _ in range(ROUNDS):
        for name, fn in variants.items():
            times[name].append(timed(fn))
    separate = times.pop(f"{GRADIENTS} separate reduce calls")
    print(f"cross_device_ops: {GRADIENTS} gradients, {total_kb:.0f} KB in all, {replicas} "
          f"replicas ({type(ops).__name__}), median of {ROUNDS} rounds")
    label = f"{GRADIENTS} separate reduce calls"
    print(f"  {label:42s}{statistics.median(separate) * 1e3:8.2f} ms")
    for name, packed in times.items():
        # Each round times every variant back to back: its ratio is what load changes least.
        ratio = statistics.median(b / a for a, b in zip(packed, separate))
        verdict = "ok" if ratio >= TARGET else "MISSED"
        common.record("cross_device_ops", f"{name}, {replicas} replicas: speed-up over separate "
                      "reduce calls", ratio, "x", f">= {TARGET:.0f}x", ratio >= TARGET,
                      f"{statistics.median(packed) * 1e3:.2f} ms vs "
                      f"{statistics.median(separate) * 1e3:.2f} ms")
        print(f"  {name:42s}{statistics.median(packed) * 1e3:8.2f} ms: {ratio:4.1f}x faster "
              f"(target >= {TARGET:.0f}x): {verdict}")


def count_collectives():
    """Prints the all-reduce ops of packed programs, read from their HLO text."""
    devices = jax.devices()[:REPLICAS]
    strategy = jdist.MirroredStrategy(devices)
    ops = strategy.extended._cross_device_ops
    grads = make_gradients(strategy)
    options = jdist.CommunicationOptions(bytes_per_pack=BYTES_PER_PACK)
    programs = replica_mesh.for_devices(devices)
    stacked = [g.stacked for g in grads]
    print(f"all-reduce ops per program on {REPLICAS} replicas, {GRADIENTS} gradients "
          "(lowered StableHLO / compiled HLO):")
    for label, cross_ops, opts in (
            (f"bytes_per_pack={BYTES_PER_PACK >> 10} KiB", ops, options),
            ("num_packs=1 (TF's default)", jdist.NcclAllReduce(num_packs=1), None),
            ("num_packs=0 (unpacked)", jdist.NcclAllReduce(num_packs=0), None)):
        lowered, plan = cross_ops._lower_packed_all_reduce(programs, SUM, stacked, opts)
        count = jdist.testing.count_all_reduces(lowered.as_text())
        compiled = jdist.testing.count_all_reduces(lowered.compile().as_text())
        common.record("cross_device_ops", f"all-reduce ops in the program, {label}", count, "ops",
                      detail=f"{compiled} after XLA compilation; plan: {plan.num_packs} packs")
        print(f"  batch_reduce, {label:28s} {count:4d} / {compiled:4d}   "
              f"(plan: {plan.num_packs} packs)")

    # The same packing inside a replica function: ReplicaContext.all_reduce(options=...).
    def replica_fn(*leaves):
        return ops._replica_all_reduce(strategy.extended.replica_axis, REPLICAS, SUM,
                                       list(leaves), options)

    leaves = [jnp.zeros(g.stacked.shape[1:], g.stacked.dtype) for g in grads]
    program = jax.jit(jax.shard_map(replica_fn, mesh=strategy.extended.mesh, in_specs=P(),
                                    out_specs=P(), check_vma=False))
    lowered = program.lower(*leaves)
    print(f"  ReplicaContext.all_reduce of {GRADIENTS} leaves, bytes_per_pack="
          f"{BYTES_PER_PACK >> 10} KiB: {jdist.testing.count_all_reduces(lowered.as_text()):4d} / "
          f"{jdist.testing.count_all_reduces(lowered.compile().as_text()):4d}")


def main():
    for replicas in TIMED_REPLICAS:
        time_packing(replicas)
    count_collectives()


if __name__ == "__main__":
    main()
