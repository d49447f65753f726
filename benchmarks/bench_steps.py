"""Steps per execution: K steps in one program against K separate ``strategy.run`` calls.

The digits-sized MLP of ``bench_uneven`` (64-256-256-10, SGD) trains one epoch of 64 global
batches of 128 rows on eight simulated CPU devices, two ways that compute the same numbers:

* ``run``: ``for x, y in iterator: strategy.run(step, ...)``, one program per step;
* ``steps``: ``iterator.get_next_steps(K)`` and one ``strategy.run`` whose replica function scans
  the K steps (``lax.scan``), one program per K steps.

Epochs alternate over rounds after a warm one; the median epoch time of ``steps`` over ``run``
is reported for K = 4 and 16 (below 1: fewer launches pay). No target: the figure says what
the form buys here.
"""

import common  # noqa: F401  (first: it requests the simulated devices)

import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402

import jdist  # noqa: E402

LAYERS, BATCH, BATCHES, ROUNDS = (64, 256, 256, 10), 128, 64, 7
OPTIMIZER = optax.sgd(0.1)


def step(params, opt_state, x, y):
    ctx = jdist.get_replica_context()

    def loss(p):
        losses = optax.softmax_cross_entropy_with_integer_labels(common.mlp_logits(p, x), y)
        return jdist.nn.compute_average_loss(losses, global_batch_size=BATCH)
    grads = ctx.all_reduce("sum", jax.grad(loss)(params))
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def k_steps(params, opt_state, xs, ys):
    return lax.scan(lambda carry, b: (step(*carry, *b), None), (params, opt_state), (xs, ys))[0]


def epoch(strategy, dataset, state, k):
    start = time.perf_counter()
    iterator = iter(strategy.experimental_distribute_dataset(dataset))
    if k is None:
        for x, y in iterator:
            state = strategy.run(step, args=(*state, x, y))
    else:
        for _ in range(BATCHES // k):
            state = strategy.run(k_steps, args=(*state, *iterator.get_next_steps(k)))
    jax.block_until_ready(state)
    return time.perf_counter() - start, state


def main():
    strategy = jdist.MirroredStrategy(jax.devices()[:8])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * BATCHES, LAYERS[0])).astype(np.float32)
    y = rng.integers(0, LAYERS[-1], size=BATCH * BATCHES).astype(np.int32)
    dataset = strategy.experimental_make_numpy_dataset((x, y)).batch(BATCH)
    params = common.init_mlp(jax.random.key(0), LAYERS)
    ways = {"run": None, "steps K=4": 4, "steps K=16": 16}
    state = {name: jdist.mirror((params, OPTIMIZER.init(params)), strategy) for name in ways}
    for name, k in ways.items():  # Warm-up epoch: every program compiles here.
        _, state[name] = epoch(strategy, dataset, state[name], k)
    times = {name: [] for name in ways}
    for _ in range(ROUNDS):
        for name, k in ways.items():
            seconds, state[name] = epoch(strategy, dataset, state[name], k)
            times[name].append(seconds)
    print(f"steps_per_execution: {BATCHES} batches of {BATCH} rows on 8 replicas, median of "
          f"{ROUNDS} epochs")
    base = statistics.median(times["run"])
    for name in ways:
        ratio = statistics.median(a / b for a, b in zip(times[name], times["run"]))
        median = statistics.median(times[name])
        print(f"  {name:11s} {median * 1e3:8.1f} ms/epoch  {ratio:5.2f}x run")
        if name != "run":
            common.record("steps", f"epoch time, {name} / one run per step", ratio, "x",
                          detail=f"{median * 1e3:.1f} ms/epoch against {base * 1e3:.1f}")
    for name in ways:  # The same numbers every way (scan and unrolled calls: float rounding).
        np.testing.assert_allclose(np.asarray(state[name][0]["w0"]),
                                   np.asarray(state["run"][0]["w0"]), rtol=1e-4, atol=1e-5)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
