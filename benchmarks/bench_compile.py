"""Compile once per loop, dispatch cost flat in the model size (issue 12).

On eight simulated CPU devices:

* ``time_to_step_2``: an MLP of 3, 50 and 200 dense layers (6, 100 and 400 parameter leaves)
  trained for two steps, from plain parameters (the first step) to the ``Mirrored`` ones the
  first step returns (the second), by ``strategy.run`` and by the hand-written
  ``jax.jit(jax.shard_map(...))`` step. Reported: seconds to the end of step 2 for each, their
  ratio, how many times jdist traced the step (target: 1) and how many XLA compiles each made
  (the hand-written loop places its parameters on the mesh first, so it compiles once). Three
  rounds of fresh programs, the order alternating, give the median of their ratios: one
  400-leaf compile's time varies by 20% from run to run here.
* ``run_overhead_per_leaf``: ``strategy.run`` of a step over 10, 100 and 1000 parameter leaves
  against the same compiled program called directly (the raw call). Target: under 20 us over the
  raw call at 10 leaves, growing by at most 0.3 us per leaf. Two figures: end to end (each call
  waited on, as the CPU guard waits), and jdist's host-side work alone (the compiled program
  replayed, `common.replayed_launches`). On this 2-core machine the end-to-end one is several
  times the host-side one: the program's eight simulated devices' threads occupy both cores, and
  the code that runs after it finds its caches cold (a ``jax.jit`` call of a program that does
  nothing costs 8 us warm and 23-27 us right after such a program; each `Mirrored` argument adds
  0.6 us there, 0.1 us warm). For scale, a third figure: the same program behind the least any
  such API must do per call (`minimal_wrapper`: wait on the previous call's output, as the CPU
  guard must, and wrap each output), its floor on this machine. A fourth: ``run`` with the CPU
  dispatch guard off (`common.unguarded`), as GPU and TPU run it: the guard's wait on the
  previous program is a C++ call that costs 0.9 us warm and about 10 us right after a program.
  Host side, the floor is timed as jdist is (its Python around a replayed program), and
  ``run``'s cost over it is reported against issue 46's aim: 3 us at 10 leaves, 0.1 us per leaf.
  A call's time varies by hundreds of microseconds here, so each end-to-end figure is the
  median of paired differences (each call minus the raw call made beside it, the four in a
  random order each round) over thousands of calls, with a 95% bootstrap interval. Beside it,
  at 10 leaves, the CPU time the calling thread spends until the call returns (the same
  pairing), which the devices' threads do not move: it varied by 3 us between runs where the
  wall-clock figures moved by 10.

Each model size runs in the same process, hand-written first; the XLA compile cache is
per-program, so neither side reuses the other's compile. Missed targets print MISSED.
"""

import common  # noqa: F401  (first: it requests the simulated devices)

import threading  # noqa: E402
import time  # noqa: E402
import timeit  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jdist  # noqa: E402
from jdist.testing import count_compiles  # noqa: E402

REPLICAS, WIDTH, BATCH, AXIS = 8, 16, 4, "replica"
DEPTHS = (3, 50, 200)
LEAF_COUNTS = (10, 100, 1000)
CALLS = {10: 4000, 100: 2000, 1000: 400}  # Per leaf count: about 5-12 s each.
HOST_ROUNDS = 15
ADAM = optax.adam(1e-3)  # `host_overheads` with an optimizer state, as training has.
STEP_2_ROUNDS = 3
OVERHEAD_AT_10_US, PER_LEAF_US = 20.0, 0.3
OVER_FLOOR_AIM = (3.0, 0.1)  # Issue 46's aim for run's host-side cost over `minimal_wrapper`'s.


def sgd_step(params, x, mean, rate=0.01):
    grads = jax.grad(lambda p: jnp.mean(common.mlp_logits(p, x) ** 2))(params)
    return jax.tree_util.tree_map(lambda p, g: p - rate * g, params, mean(grads))


def hand_to_step_2(mesh, params, x, rate):
    """Seconds to the end of step 2 of the hand-written loop, and its XLA compiles."""
    hand = jax.jit(jax.shard_map(lambda p, x: sgd_step(p, x, lambda g: lax.pmean(g, AXIS), rate),
                                 mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P(),
                                 check_vma=False))
    start = time.perf_counter()
    with count_compiles() as compiles:
        xs = jax.device_put(x, NamedSharding(mesh, P(AXIS)))
        # Placed first: the replicated outputs of step 1 then have the inputs' type (sharding
        # included), so step 2 reuses step 1's compile, as a careful hand-written loop does.
        p = hand(jax.device_put(params, NamedSharding(mesh, P())), xs)
        jax.block_until_ready(hand(p, xs))
    return time.perf_counter() - start, len(compiles)


def jdist_to_step_2(strategy, params, x, rate):
    """Seconds to the end of step 2 of ``strategy.run``'s loop, its XLA compiles and how many
    times it traced the step."""
    traces = []

    def step(p, x):
        traces.append(1)
        return sgd_step(p, x, lambda g: jdist.get_replica_context().all_reduce("mean", g), rate)
    start = time.perf_counter()
    with count_compiles() as compiles:
        xd = strategy.experimental_distribute_values_from_function(
            lambda ctx: x[ctx.replica_id_in_sync_group * BATCH:][:BATCH])
        p = strategy.run(step, args=(params, xd))  # Plain parameters in, Mirrored out.
        jax.block_until_ready(strategy.run(step, args=(p, xd)))
    return time.perf_counter() - start, len(compiles), len(traces)


def time_to_step_2(strategy, mesh, depth):
    """Both loops' time to the end of step 2, in `STEP_2_ROUNDS` rounds of fresh programs (a
    learning rate of their own, so neither reuses a compile), the order alternating; the
    ratio is the median of the rounds' ratios."""
    params = common.init_mlp(jax.random.key(0), (WIDTH,) * (depth + 1))
    x = np.ones((REPLICAS * BATCH, WIDTH), np.float32)
    rounds = []
    for i in range(STEP_2_ROUNDS):
        rate = 0.01 * (1 + i)
        ways = [lambda: hand_to_step_2(mesh, params, x, rate),
                lambda: jdist_to_step_2(strategy, params, x, rate)]
        order = [0, 1] if i % 2 == 0 else [1, 0]
        figures = {k: ways[k]() for k in order}
        rounds.append((figures[0], figures[1]))
    ratio = float(np.median([j[0] / h[0] for h, j in rounds]))
    hand_s, jdist_s = (float(np.median([r[k][0] for r in rounds])) for k in (0, 1))
    traces = max(j[2] for _, j in rounds)
    compiles, hand_compiles = (max(r[k][1] for r in rounds) for k in (1, 0))
    leaves = len(jax.tree_util.tree_leaves(params))
    met = traces == 1 and compiles <= hand_compiles
    print(f"time_to_step_2, {leaves:3d} leaves: hand {hand_s:6.2f} s, jdist {jdist_s:6.2f} s "
          f"(median of {STEP_2_ROUNDS} rounds' ratios {ratio:.2f}x); jdist traced the step "
          f"{traces}x per round (target 1); XLA compiles: jdist {compiles}, hand "
          f"{hand_compiles}{'' if met else '  MISSED'}")
    common.record("compile", f"time to the end of step 2, {leaves} leaves, jdist / hand", ratio,
                  "x", "traced once, compiles <= hand", met,
                  f"medians of {STEP_2_ROUNDS} rounds: hand {hand_s:.2f} s, jdist "
                  f"{jdist_s:.2f} s, {traces} trace(s), XLA compiles jdist {compiles} / hand "
                  f"{hand_compiles}")


class _Wrapped:
    """One output of `minimal_wrapper`: what a `Mirrored` or `PerReplica` is at the least."""
    __slots__ = ("value",)


def minimal_wrapper(program, out_tree, token_index):
    """``program`` (flat outputs) behind the least Python an API like ``strategy.run`` must run
    per call on simulated CPU devices: wait on one output of the previous call before launching
    (as the CPU guard must), wrap each output in an object of its own and rebuild the output
    nest. The floor of `run_overhead`."""
    lock, in_flight, new = threading.Lock(), [()], object.__new__

    def call(*args):
        with lock:
            for array in in_flight[0]:
                array.block_until_ready()
            outputs = program(*args)
            in_flight[0] = (outputs[token_index],)
        wrapped = []
        for leaf in outputs:
            w = new(_Wrapped)
            w.value = leaf
            wrapped.append(w)
        return out_tree.unflatten(wrapped)
    return call


def run_overhead(strategy, mesh, leaves):
    """``strategy.run``'s end-to-end cost over the raw call of the same hand-written program,
    and that program's behind `minimal_wrapper`: for each, `paired_overhead`'s figures."""
    params = strategy.run(lambda: {f"p{i}": jnp.zeros((2,)) for i in range(leaves)})
    x = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.ones((2,), np.float32))

    def step(p, x):
        return jax.tree_util.tree_map(lambda v: v + 1.0, p), x * 2

    def body(p, x):
        return step(p, x[0])[0], step(p, x[0])[1][None]

    raw = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(AXIS)),
                                out_specs=(P(), P(AXIS)), check_vma=False))
    plain, stacked = jdist.unwrap_mirrored(params), replica_stacked(x)
    out_tree = jax.tree_util.tree_structure(raw(plain, stacked))
    flat = jax.jit(jax.shard_map(lambda p, x: tuple(jax.tree_util.tree_leaves(body(p, x))),
                                 mesh=mesh, in_specs=(P(), P(AXIS)),
                                 out_specs=tuple([P()] * leaves + [P(AXIS)]),
                                 check_vma=False))
    wrapper = minimal_wrapper(flat, out_tree, leaves)
    calls = {"raw": lambda: raw(plain, stacked)[1],
             "floor": lambda: wrapper(plain, stacked)[1].value,
             "jdist": lambda: array_of(strategy.run(step, args=(params, x))[1]),
             "unguarded": lambda: common.unguarded(
                 strategy, lambda: array_of(strategy.run(step, args=(params, x))[1]))}
    samples, order = {name: [] for name in calls}, np.random.default_rng(leaves)
    cpu = {name: [] for name in calls}
    for _ in range(CALLS[leaves]):
        # A random order each round: a call made right after the same call runs its program
        # hot (about 10 us less here), so a fixed or alternating order favours some ways.
        for name in order.permutation(list(calls)):
            start, start_cpu = time.perf_counter(), time.thread_time()
            output = calls[name]()
            cpu[name].append(time.thread_time() - start_cpu)
            output.block_until_ready()  # One output, as the CPU guard waits on one.
            samples[name].append(time.perf_counter() - start)
    raw, raw_cpu = np.asarray(samples["raw"]), np.asarray(cpu["raw"])
    figures = {name: paired_overhead(np.asarray(samples[name]) - raw)
               for name in ("jdist", "floor", "unguarded")}
    figures["cpu"] = {name: float(np.median(np.asarray(cpu[name]) - raw_cpu)) * 1e6
                      for name in ("jdist", "floor", "unguarded")}
    return figures


def replica_stacked(value):
    """A per-replica argument's array with the replica axis first: one replica's value is a
    plain array (as in TF), which gets the axis here, once, outside the timed calls."""
    return value.stacked if isinstance(value, jdist.PerReplica) else value[None]


def array_of(value):
    """The array of one per-replica output, to wait on (no new array: timed calls use it)."""
    return value.stacked if isinstance(value, jdist.PerReplica) else value


def paired_overhead(differences, rounds=1000):
    """``(median, low, high)`` in us of per-call differences from the raw call made beside each
    call, with a 95% bootstrap interval: pairing cancels the machine's slow drifts, which the
    difference of two medians does not."""
    rng = np.random.default_rng(0)
    draws = [np.median(rng.choice(differences, differences.size)) for _ in range(rounds)]
    low, high = np.percentile(draws, [2.5, 97.5]) * 1e6
    return float(np.median(differences)) * 1e6, float(low), float(high)


def host_overheads(strategy, adam=False):
    """Host-side cost ``strategy.run`` adds on the step of `run_overhead`, per leaf count: its
    Python work, timed with every launch replaying the program's first outputs (no device
    work), plus what the compiled call's C++ dispatch spends on jdist's call beyond the raw
    call's: the `Mirrored` nodes it flattens (timed on a program that does nothing), and the
    outputs it returns as they come (a flat tuple, which ``run`` itself wraps and nests) where
    the raw call nests them as the step returns them (each timed as JAX's dispatch builds it:
    the program's output tree unflattened). Beside it, the same for `minimal_wrapper` (its
    Python around a replayed flat program, and the flat tuple the program returns, built as
    JAX's dispatch builds it; it takes the raw call's plain arrays): the floor. CPU work timed
    as ``timeit`` times it: the fastest of several rounds, each the mean of many calls; the
    leaf counts take turns in every round, so the machine's slow spells (this one's speed
    drifts by a third over minutes) reach all of them alike. With ``adam``, the step also
    updates ``optax.adam``'s state of the parameters (two more leaves each, and an int32 step
    count). Per leaf count: ``{"jdist": us, "floor": us}``."""
    with common.replayed_launches(strategy) as replayed:
        calls = {n: _host_calls(strategy, n, adam, replayed) for n in LEAF_COUNTS}
        rounds = {n: {name: [] for name in calls[n]} for n in LEAF_COUNTS}
        for _ in range(HOST_ROUNDS):
            for n in LEAF_COUNTS:
                number = max(10, 20000 // n // (3 if adam else 1))
                for name, call in calls[n].items():
                    rounds[n][name].append(timeit.timeit(call, number=number) / number)
    best = {n: {name: min(times) for name, times in r.items()} for n, r in rounds.items()}
    return {n: {"jdist": (b["python"] + b["jdist_dispatch"] - b["raw_dispatch"]
                          + b["jdist_outputs"] - b["raw_outputs"]) * 1e6,
                "floor": (b["floor_python"] + b["floor_outputs"] - b["raw_outputs"]) * 1e6}
            for n, b in best.items()}


def _host_calls(strategy, leaves, adam, replayed):
    """`host_overheads`' calls over ``leaves`` parameters (inside its replayed launches)."""
    params = strategy.run(lambda: {f"p{i}": jnp.zeros((2,)) for i in range(leaves)})
    x = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.ones((2,), np.float32))
    state = (strategy.run(lambda: ADAM.init(jdist.unwrap_mirrored(params))),) if adam else ()

    def step(p, *args):
        *state, x = args
        new = (ADAM.update(p, state[0], p)[1],) if state else ()
        return (jax.tree_util.tree_map(lambda v: v + 1.0, p), *new, x * 2)
    nothing = jax.jit(lambda *args: None)
    plain = jdist.unwrap_mirrored((params, *state))
    stacked = replica_stacked(x)
    outputs = jax.tree_util.tree_leaves((*plain, stacked))  # As many as the step returns.
    raw_nest = jax.tree_util.tree_structure((*plain, stacked))  # The raw step's outputs.
    args = (params, *state, x)
    strategy.run(step, args=args)
    direct = jax.tree_util.tree_structure(replayed[-1])  # What the jdist program returns.
    flat_outputs = tuple(outputs)
    flat = jax.tree_util.tree_structure(flat_outputs)  # The floor program's outputs.
    floor = minimal_wrapper(lambda *_: flat_outputs, raw_nest, len(outputs) - 1)
    return {"floor_python": lambda: floor(*plain, stacked),
            "floor_outputs": lambda: flat.unflatten(outputs),
            "jdist_dispatch": lambda: nothing(args, {}),
            "raw_dispatch": lambda: nothing(*plain, stacked),
            "python": lambda: strategy.run(step, args=args),
            "raw_outputs": lambda: raw_nest.unflatten(outputs),
            "jdist_outputs": lambda: direct.unflatten(outputs)}


def report_overheads(name, overheads, targets=(OVERHEAD_AT_10_US, PER_LEAF_US)):
    """Prints and records one set of per-leaf overheads against ``targets`` (us at 10 leaves, us
    per leaf): per leaf count a figure in us, or `paired_overhead`'s ``(median, low, high)``."""
    at_10, per_leaf = targets
    figures = {n: o if isinstance(o, tuple) else (o,) for n, o in overheads.items()}
    at = {n: f[0] for n, f in figures.items()}
    slope = (at[LEAF_COUNTS[-1]] - at[LEAF_COUNTS[0]]) / (LEAF_COUNTS[-1] - LEAF_COUNTS[0])
    met = at[10] < at_10 and slope <= per_leaf
    detail = ", ".join(f"{n} leaves +{f[0]:.1f} us" + (
        f" [{f[1]:+.1f}, {f[2]:+.1f}]" if len(f) == 3 else "") for n, f in figures.items())
    print(f"{name}: {detail}; {slope:.3f} us per leaf (targets < {at_10:g} us at "
          f"10, <= {per_leaf} us per leaf){'' if met else '  MISSED'}")
    common.record("compile", f"{name}: growth per leaf", slope, "us", f"<= {per_leaf} us",
                  slope <= per_leaf, detail)  # Each row its own target; the line above both.
    common.record("compile", f"{name}: at 10 leaves", at[10], "us", f"< {at_10:g} us",
                  at[10] < at_10)


def main():
    devices = jax.devices()[:REPLICAS]
    strategy = jdist.MirroredStrategy(devices)
    mesh = Mesh(np.array(devices), (AXIS,))
    for depth in DEPTHS:
        time_to_step_2(strategy, mesh, depth)
    end_to_end = {n: run_overhead(strategy, mesh, n) for n in LEAF_COUNTS}
    print(f"  end to end: medians of paired differences, 95% intervals in brackets "
          f"({', '.join(f'{c} calls at {n} leaves' for n, c in CALLS.items())})")
    report_overheads("run overhead, end to end",
                     {n: figures["jdist"] for n, figures in end_to_end.items()})
    report_overheads("floor of any wrapper, end to end (reference)",
                     {n: figures["floor"] for n, figures in end_to_end.items()})
    report_overheads("run overhead, end to end, CPU guard off as on GPU/TPU (reference)",
                     {n: figures["unguarded"] for n, figures in end_to_end.items()})
    above = end_to_end[LEAF_COUNTS[0]]["jdist"][0] - end_to_end[LEAF_COUNTS[0]]["floor"][0]
    common.record("compile", f"run overhead over the floor, end to end, at {LEAF_COUNTS[0]} "
                  "leaves", above, "us", detail="what jdist adds to the least any wrapper does")
    cpu = end_to_end[LEAF_COUNTS[0]]["cpu"]
    detail = ", ".join(f"{name} +{us:.1f} us" for name, us in cpu.items())
    print(f"  the calling thread's CPU until the call returns, over the raw call's: {detail}")
    common.record("compile", f"run overhead, calling thread's CPU until run returns, at "
                  f"{LEAF_COUNTS[0]} leaves (reference)", cpu["jdist"], "us", detail=(
                      detail + "; medians of paired differences: steadier than wall time, "
                      "which the devices' threads move by hundreds of us"))
    host = host_overheads(strategy)
    report_overheads("run overhead, host side", {n: h["jdist"] for n, h in host.items()})
    report_overheads("floor of any wrapper, host side (reference)",
                     {n: h["floor"] for n, h in host.items()})
    report_overheads("run overhead over the floor, host side",
                     {n: h["jdist"] - h["floor"] for n, h in host.items()}, OVER_FLOOR_AIM)
    with_adam = {n: h["jdist"] for n, h in host_overheads(strategy, adam=True).items()}
    per_leaf = (with_adam[LEAF_COUNTS[-1]] - with_adam[LEAF_COUNTS[0]]) / (
        3 * (LEAF_COUNTS[-1] - LEAF_COUNTS[0]))
    detail = ", ".join(f"{n} parameters +{o:.1f} us" for n, o in with_adam.items())
    print(f"run overhead, host side, with optax.adam's state (reference): {detail}; "
          f"{per_leaf:.2f} us per leaf (3 leaves per parameter)")
    common.record("compile", "run overhead, host side, with optax.adam's state (reference): "
                  "growth per leaf", per_leaf, "us", detail=detail)


if __name__ == "__main__":
    main()
