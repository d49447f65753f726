"""The digits training of ``train_digits.py``, with checkpoints, mid-epoch resume and a progress bar.

Every ``--save-every`` steps (and at the end) the parameters, the optimizer state and the
position of the data iterator are saved with orbax (``jdist.checkpoint.CheckpointManager``,
chief only, atomic). Started again with the same ``--checkpoint-dir``, the script restores the
latest checkpoint and continues at the next step, in the middle of an epoch if it stopped
there: the iterator hands out the global batches the stopped run would have, split for this
run's replica count, and the later epochs get the shuffle orders they would have had. So a
run that is stopped and resumed, on the same or another number of replicas, ends with the
parameters of a run that never stopped. Try it:

    python examples/train_digits_resumable.py --epochs 30 --stop-at-step 100    # stops there
    python examples/train_digits_resumable.py --epochs 30 --replicas 3         # resumes at 101

``--stop-at-step`` stands in for a job that is killed; ``--fresh`` deletes the checkpoints
first. The model, data and step come from ``train_digits.py``. Exits with status 1 when the
final test accuracy is below 95%.
"""

import train_digits  # noqa: I001  (first: it requests the simulated devices before JAX starts)

import argparse  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402

import jdist  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-dir", default="checkpoints/digits")
    parser.add_argument("--save-every", type=int, default=10, help="checkpoint every N steps")
    parser.add_argument("--stop-at-step", type=int, default=None,
                        help="stop after this step (as if the job were killed)")
    parser.add_argument("--fresh", action="store_true", help="delete old checkpoints first")
    return parser.parse_args(argv)


def evaluate(strategy, params, x_test, y_test, batch_size):
    """Exact test accuracy: correct predictions summed over replicas and batches."""
    test = strategy.experimental_distribute_dataset(
        strategy.experimental_make_numpy_dataset((x_test, y_test)).batch(batch_size))
    correct = sum(int(strategy.reduce("sum", strategy.run(train_digits.count_correct,
                                                          args=(params, x, y)), axis=None))
                  for x, y in test)
    return correct / len(x_test)


def train(args):
    """Trains (resuming from ``args.checkpoint_dir``); returns (last step, params, accuracy)."""
    devices = jax.local_devices()[:args.replicas]
    strategy = jdist.MirroredStrategy(devices)
    x_train, y_train, x_test, y_test = train_digits.load_data(args.seed)
    optimizer = optax.adam(args.learning_rate)
    params = train_digits.init_params(jax.random.key(args.seed))
    state = jdist.mirror({"params": params, "opt_state": optimizer.init(params)}, strategy)
    train_step = train_digits.make_train_step(optimizer)
    if args.fresh:
        shutil.rmtree(args.checkpoint_dir, ignore_errors=True)
    # One dataset for the whole run: each epoch's iterator reshuffles, in TF's order for the seed.
    batches = strategy.experimental_distribute_dataset(
        strategy.experimental_make_numpy_dataset((x_train, y_train)).shuffle(
            len(x_train), seed=args.seed).batch(args.batch_size))
    per_epoch, total = batches.cardinality, batches.cardinality * args.epochs
    last = total if args.stop_at_step is None else min(total, args.stop_at_step)
    with jdist.checkpoint.CheckpointManager(args.checkpoint_dir, strategy) as manager:
        step, it = manager.latest_step or 0, None
        if step:  # The iterator of the epoch the step is in, where the step left it.
            state, it = manager.restore(state, iterator=batches)
            jdist.print_once(f"resumed after step {step} ({manager.directory})")
        for epoch in range(max(step - 1, 0) // per_epoch, args.epochs):
            # Read to its end even when the step ended its epoch: the next epoch's shuffle
            # order follows from the iterators read before it, as in the run that stopped.
            it = iter(batches) if it is None else it
            with jdist.ProgressBar(it, strategy, total=per_epoch * (epoch + 1) - step,
                                   desc=f"epoch {epoch + 1}/{args.epochs}",
                                   examples_per_step=args.batch_size) as bar:
                for x, y in bar:
                    params, opt_state, loss = strategy.run(
                        train_step, args=(state["params"], state["opt_state"], x, y))
                    state, step = {"params": params, "opt_state": opt_state}, step + 1
                    bar.set_loss(loss)
                    if step % args.save_every == 0 or step == last:
                        manager.save(step, state, iterator=it)
                    if step == last:
                        break
            if step == last:
                break
            it = None
    accuracy = evaluate(strategy, state["params"], x_test, y_test, args.batch_size)
    return step, state["params"], accuracy


def main(argv=None):
    args = parse_args(argv)
    step, _, accuracy = train(args)
    if args.stop_at_step is not None and step == args.stop_at_step:
        jdist.print_once(f"stopped after step {step}: test accuracy {accuracy:.4f}; run again "
                         "without --stop-at-step to resume")
        return 0
    ok = accuracy >= train_digits.TARGET_ACCURACY
    jdist.print_once(f"test accuracy {accuracy:.4f} after {args.epochs} epochs ({step} steps): "
                     f"{'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
