"""A training loop under `jdist.experimental.PreemptionCheckpointHandler`, for
test_preemption.py: ``python _preemption_program.py DIRECTORY REPLICAS DELAY``.

Prints ``step K IDS`` after each step (IDS: the example ids of its global batch), resumes from
DIRECTORY's latest checkpoint, and prints ``done`` and the final parameters as JSON at the end;
SIGTERM makes it save and exit with status 75 at the next step boundary. With ``TF_CONFIG`` it
is one worker of a `MultiWorkerMirroredStrategy` over all its local devices (REPLICAS is
ignored; peers silent for 5 s end it), the workers agree on stopping every 2 steps, and only
worker 0 pauses DELAY seconds after each step: the other waits inside the next step's
collective, where the test's signal reaches it. For the watchdog's tests, ``JDIST_TEST_TIMEOUT``
sets the workers' timeout (default 5 s), ``JDIST_TEST_SLOW_SAVE`` makes the chief's wait for its
first checkpoint write that many seconds longer, and ``JDIST_TEST_SAVE_AT`` saves (and waits)
after that step besides. ``JDIST_TEST_STOP_AT=K`` preempts worker 1 of the first start
(``JDIST_RESTART`` 0) after K steps, as its ``termination_watcher_fn``.
"""

import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jdist

ROWS, BATCH, EPOCHS = 200, 24, 2
PER_EPOCH = -(-ROWS // BATCH)


def dataset(strategy):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 8)).astype(np.float32)
    data = (x, (x.sum(axis=1) > 0).astype(np.int32), np.arange(ROWS, dtype=np.int32))
    return strategy.experimental_distribute_dataset(
        strategy.experimental_make_numpy_dataset(data).shuffle(ROWS, seed=5).batch(BATCH))


def init_params():
    rng = np.random.default_rng(1)
    return {"w": rng.normal(size=(8, 2)).astype(np.float32) / 3, "b": np.zeros(2, np.float32)}


def make_step(strategy, seen):
    def replica_step(params, x, y):
        ctx = jdist.get_replica_context()
        rows = ctx.all_reduce("sum", x.shape[0])

        def loss(p):
            logp = jax.nn.log_softmax(jnp.tanh(x @ p["w"] + p["b"]))
            return -jnp.sum(logp[jnp.arange(x.shape[0]), y]) / rows
        grads = ctx.all_reduce("sum", jax.grad(loss)(params))
        return jax.tree_util.tree_map(lambda p, g: p - 0.5 * g, params, grads)

    def train_step(params, iterator):
        x, y, ids = next(iterator)
        seen.append(np.asarray(strategy.gather(ids, axis=0)).tolist())
        return strategy.run(replica_step, args=(params, x, y))
    return train_step


def slow_first_wait(seconds):
    """Makes the chief's first wait for a write ``seconds`` longer (a slow file system)."""
    import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
    wait, waited = ocp.CheckpointManager.wait_until_finished, []

    def slow(self):
        if not waited and jax.process_index() == 0:
            waited.append(time.sleep(seconds))
        return wait(self)
    ocp.CheckpointManager.wait_until_finished = slow


def train(directory, replicas, delay=0.0, report=lambda step, ids: None):
    """Trains EPOCHS epochs from DIRECTORY's latest checkpoint; returns the host parameters."""
    slow_first_wait(float(os.environ.get("JDIST_TEST_SLOW_SAVE", 0)))
    save_at = int(os.environ.get("JDIST_TEST_SAVE_AT", 0))
    if "TF_CONFIG" in os.environ:
        timeout = float(os.environ.get("JDIST_TEST_TIMEOUT", 5))
        strategy = jdist.MultiWorkerMirroredStrategy(
            communication_options=jdist.CommunicationOptions(timeout_seconds=timeout))
        delay *= strategy.extended.worker_index == 0
    else:
        strategy = jdist.MirroredStrategy(jax.local_devices()[:replicas])
    dist, seen = dataset(strategy), []
    params = jdist.mirror(init_params(), strategy)
    stop_at = int(os.environ.get("JDIST_TEST_STOP_AT", 0)) * (os.environ.get("JDIST_RESTART")
                                                               == "0")
    config = jdist.experimental.TerminationConfig(
        exit_code=75, check_every=2,
        termination_watcher_fn=lambda: 0 < stop_at <= len(seen) and jax.process_index() == 1)
    with jdist.checkpoint.CheckpointManager(directory, strategy) as manager:
        handler = jdist.experimental.PreemptionCheckpointHandler(None, manager,
                                                                 termination_config=config)
        start, it = handler.total_run_calls, None
        if start:
            params, it = manager.restore(params, iterator=dist)
        step = make_step(strategy, seen)
        with handler.watch_preemption_scope():
            for epoch in range(max(start - 1, 0) // PER_EPOCH, EPOCHS):
                it = iter(dist) if it is None else it
                while handler.total_run_calls < (epoch + 1) * PER_EPOCH:
                    params = handler.run(step, params, it)
                    report(handler.total_run_calls, seen[-1])
                    if handler.total_run_calls == save_at:
                        manager.save(save_at, params, iterator=it)
                        manager.wait_until_finished()
                    time.sleep(delay)
                assert next(it, None) is None  # Read to its end: the next epoch reshuffles.
                it = None
    return jdist.to_host(params)


def main():
    def report(step, ids):
        print(f"step {step} {json.dumps(ids)}", flush=True)
    params = train(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), report)
    print("done " + json.dumps({k: v.tolist() for k, v in params.items()}), flush=True)


if __name__ == "__main__":
    main()
