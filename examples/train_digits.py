"""Data-parallel training of an MLP on scikit-learn's digits with jdist.MirroredStrategy.

The same loop a tf.distribute user would write: a distributed dataset splits every global batch
over the replicas (shuffled each epoch), the gradients are all-reduced inside ``strategy.run``,
and the test accuracy is aggregated with ``strategy.reduce``. The last batch of each epoch is
partial: as in tf.distribute each replica gets exactly its rows (some none), the step needs no
mask, and both the loss and the accuracy are exact. By default it runs on eight simulated CPU
devices, so it needs no accelerator; set ``XLA_FLAGS`` / ``JAX_PLATFORMS`` yourself to run
elsewhere.

    python examples/train_digits.py [--replicas N] [--epochs E] [--batch-size B] [--drop-remainder]
    python -m jdist.launch --nproc 2 --devices-per-proc 2 examples/train_digits.py

Exits with status 1 when the test accuracy is below 95%, so ``make example`` fails loudly.
"""

import os

# JAX reads these when its backend starts, so they must be set before `import jax`. A value the
# caller already chose wins.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402
from tqdm import tqdm  # noqa: E402

import jdist  # noqa: E402

LAYERS = (64, 256, 256, 10)
TARGET_ACCURACY = 0.95


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=None,
                        help="number of devices to replicate over (default: all local devices)")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=128,
                        help="global batch size, split over the replicas as tf.distribute does")
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--drop-remainder", action="store_true",
                        help="drop each epoch's partial last training batch")
    return parser.parse_args()


def load_data(seed):
    """Standardised digits features, split 80/20 (stratified, so both splits see every class)."""
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x.astype(np.float32), y.astype(np.int32), test_size=0.2, random_state=seed, stratify=y)
    mean = x_train.mean(axis=0)
    std = x_train.std(axis=0) + 1e-6  # Some border pixels are constant (std 0) in training.
    return (x_train - mean) / std, y_train, (x_test - mean) / std, y_test


def init_params(key):
    """He-initialised dense layers as a plain dict, so no neural-network library is needed."""
    params = {}
    for i, (fan_in, fan_out) in enumerate(zip(LAYERS[:-1], LAYERS[1:])):
        key, sub = jax.random.split(key)
        params[f"w{i}"] = jax.random.normal(sub, (fan_in, fan_out)) * jnp.sqrt(2.0 / fan_in)
        params[f"b{i}"] = jnp.zeros((fan_out,))
    return params


def logits_fn(params, x):
    for i in range(len(LAYERS) - 1):
        x = x @ params[f"w{i}"] + params[f"b{i}"]
        if i < len(LAYERS) - 2:
            x = jax.nn.relu(x)
    return x


def loss_fn(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits_fn(params, x), y).mean()


def make_train_step(optimizer):
    """The replica function: the global batch's mean loss, its gradient, one Adam update.

    The loss is ``jdist.nn.compute_average_loss`` (TF's ``tf.nn.compute_average_loss``): each
    replica sums its rows' losses and divides by the global batch's row count, the all-reduced
    sum of the replicas' rows, so the all-reduced SUM of the gradients is the gradient of the
    global mean, exact for the partial last batch too (a mean of per-replica means would weigh
    a replica's rows by its batch size). Every replica applies the same update, so the
    parameters stay Mirrored.
    """
    def train_step(params, opt_state, x, y):
        ctx = jdist.get_replica_context()
        rows = ctx.all_reduce("sum", x.shape[0])

        def loss_fn(p):
            per_example = optax.softmax_cross_entropy_with_integer_labels(logits_fn(p, x), y)
            return jdist.nn.compute_average_loss(per_example, global_batch_size=rows)
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(ctx.all_reduce("sum", grads), opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, ctx.all_reduce("sum", loss)
    return train_step


def count_correct(params, x, y):
    """Correct predictions among this replica's rows."""
    return jnp.sum(jnp.argmax(logits_fn(params, x), axis=-1) == y)


def main():
    args = parse_args()
    if os.environ.get("TF_CONFIG"):  # One worker of a job (python -m jdist.launch, SLURM, ...).
        strategy = jdist.MultiWorkerMirroredStrategy()  # Before anything else uses JAX.
        replicas = strategy.num_replicas_in_sync
    else:
        devices = jax.local_devices()
        replicas = args.replicas or len(devices)
        if not 1 <= replicas <= len(devices):
            sys.exit(f"--replicas must be in [1, {len(devices)}], got {replicas}.")
        strategy = jdist.MirroredStrategy(devices[:replicas])
    chief = getattr(strategy.extended, "should_checkpoint", True)  # Only the chief prints.
    log = print if chief else (lambda *a, **k: None)
    log(f"{type(strategy).__name__} ({jax.default_backend()}), global batch {args.batch_size} "
        f"over {replicas} replicas")

    x_train, y_train, x_test, y_test = load_data(args.seed)
    test_rows = len(x_test)
    train_data = strategy.experimental_make_numpy_dataset((x_train, y_train))
    drop = args.drop_remainder
    train_dist = strategy.experimental_distribute_dataset(
        train_data.shuffle(len(x_train), seed=args.seed).batch(args.batch_size,
                                                               drop_remainder=drop))
    test_dist = strategy.experimental_distribute_dataset(
        strategy.experimental_make_numpy_dataset((x_test, y_test)).batch(args.batch_size))
    optimizer = optax.adam(args.learning_rate)
    params = init_params(jax.random.key(args.seed))
    opt_state = optimizer.init(params)
    train_step = make_train_step(optimizer)

    start = time.perf_counter()
    # tqdm redraws one line in a terminal; in CI logs (no TTY) it is off and only the per-epoch
    # lines are printed.
    epochs = tqdm(range(1, args.epochs + 1), unit="epoch", disable=not sys.stdout.isatty(),
                  leave=False)
    epoch_loss = float("nan")
    for epoch in epochs:
        losses = []
        for x, y in train_dist:  # Reshuffled every epoch; a partial last batch is kept (not drop).
            params, opt_state, loss = strategy.run(train_step, args=(params, opt_state, x, y))
            losses.append(loss)
        epoch_loss = float(np.mean([float(loss) for loss in losses]))
        if chief:  # Through tqdm, so a progress bar in a terminal is not broken.
            epochs.write(f"epoch {epoch:3d}  loss {epoch_loss:.4f}  "
                         f"({time.perf_counter() - start:.1f} s elapsed)")

    log(f"final training loss {epoch_loss:.10g}")  # Enough digits to compare runs to 1e-6.
    correct = []
    for x, y in test_dist:
        correct.append(strategy.reduce("sum", strategy.run(count_correct, args=(params, x, y)),
                                       axis=None))
    accuracy = sum(int(c) for c in correct) / test_rows
    status = "ok" if accuracy >= TARGET_ACCURACY else f"FAILED (target {TARGET_ACCURACY:.0%})"
    log(f"test accuracy {accuracy:.4f} on {test_rows} examples: {status}; "
          f"trained {args.epochs} epochs in {time.perf_counter() - start:.1f} s")
    return 0 if accuracy >= TARGET_ACCURACY else 1


if __name__ == "__main__":
    sys.exit(main())
