"""What an exact partial last batch costs: one epoch in exact mode against drop_remainder.

A data-parallel MLP (the digits-sized model of ``bench_run``) trains one epoch of 8 global
batches of 128 rows plus a partial batch of 37 rows on eight simulated CPU devices (37 rows split
5, 5, 5, 5, 5, 5, 5, 2: every replica a different shape from a full batch). Two ways:

* ``exact`` (jdist's default, TF's numbers): the partial batch runs replica by replica
  (``jdist/_src/uneven/plan.py``), the step written with no mask;
* ``drop_remainder``: the partial batch is dropped (37 fewer examples).

Each epoch is timed after a first warm epoch (so compiles are excluded; the first epoch's time
and its XLA compile count are reported separately: exact mode compiles each piece of the step
once per device, `docs/design.md` section 10), the two alternate over rounds and the median is
reported, as a ratio to ``drop_remainder``. No target: the figures say what exactness costs.
"""

import common  # noqa: F401  (first: it requests the simulated devices)

import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jdist  # noqa: E402
from jdist.testing import count_compiles  # noqa: E402

LAYERS, BATCH, ROWS, ROUNDS = (64, 256, 256, 10), 128, 8 * 128 + 37, 7
OPTIMIZER = optax.sgd(0.1)


def make_step():
    def step(params, opt_state, x, y):
        ctx = jdist.get_replica_context()

        def loss_sum(p):
            losses = optax.softmax_cross_entropy_with_integer_labels(
                common.mlp_logits(p, x), y)
            return jnp.sum(losses)
        loss, grads = jax.value_and_grad(loss_sum)(params)
        rows = ctx.all_reduce("sum", jnp.float32(x.shape[0]))
        grads = jax.tree_util.tree_map(lambda g: g / rows, ctx.all_reduce("sum", grads))
        updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return step


def epoch(strategy, dist, step, params, opt_state):
    start = time.perf_counter()
    for x, y in dist:
        params, opt_state, loss = strategy.run(step, args=(params, opt_state, x, y))
    jax.block_until_ready((params, loss))
    return time.perf_counter() - start, params, opt_state


def main():
    strategy = jdist.MirroredStrategy(jax.devices()[:8])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, LAYERS[0])).astype(np.float32)
    y = rng.integers(0, LAYERS[-1], size=ROWS).astype(np.int32)
    data = strategy.experimental_make_numpy_dataset((x, y))
    ways = {
        "exact": (strategy.experimental_distribute_dataset(data.batch(BATCH)), make_step()),
        "drop_remainder": (strategy.experimental_distribute_dataset(
            data.batch(BATCH, drop_remainder=True)), make_step()),
    }
    params = common.init_mlp(jax.random.key(0), LAYERS)
    state = {name: (params, OPTIMIZER.init(params)) for name in ways}
    first, compiles = {}, {}
    for name, (dist, step) in ways.items():  # Warm-up epoch: every program compiles here.
        with count_compiles() as compiled:
            first[name], *state[name] = epoch(strategy, dist, step, *state[name])
        compiles[name] = len(compiled)
    times = {name: [] for name in ways}
    for _ in range(ROUNDS):
        for name, (dist, step) in ways.items():
            seconds, *state[name] = epoch(strategy, dist, step, *state[name])
            times[name].append(seconds)
    median = {name: statistics.median(t) for name, t in times.items()}
    base = median["drop_remainder"]
    print(f"uneven_epoch: 8 x {BATCH} rows + a partial batch of {ROWS % BATCH} on 8 replicas, "
          f"median of {ROUNDS} epochs")
    for name in ways:
        ratio = median[name] / base
        print(f"  {name:15s} {median[name] * 1e3:8.1f} ms/epoch  {ratio:5.2f}x drop_remainder; "
              f"first epoch (compiles included) {first[name]:.2f} s, {compiles[name]} XLA "
              "compiles")
        common.record("uneven", f"epoch time, {name} / drop_remainder", ratio, "x",
                      detail=f"{median[name] * 1e3:.1f} ms/epoch; first epoch {first[name]:.2f} s, "
                      f"{compiles[name]} XLA compiles")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
