"""tf.data's shuffle order, reproduced without TensorFlow: the order `NumpyDataset.shuffle` gives.

``tf.data.Dataset.shuffle(buffer_size, seed=s)`` draws its order from TF's Philox4x32-10 stream
(``random::PhiloxRandom`` read one 32-bit sample at a time, ``SingleSampleAdapter``):

* the op's seeds are ``tf.compat.v1.random.get_seed(s)``: ``(87654321, s % (2**31 - 1))`` when no
  global seed is set (`op_seeds`);
* with ``reshuffle_each_iteration=True`` a seed generator seeded with them hands each new iterator
  two samples as its seeds (`IterationSeeds`); otherwise every iterator uses the op's seeds;
* the iterator keeps a ring buffer of ``buffer_size`` elements, filled before each output, and
  outputs the element ``sample % count`` places after the buffer's oldest, which takes its place
  (`shuffled`).

Checked against TF 2.21 element by element (``tests/test_numpy_dataset_tf.py``).
"""

import itertools
import sys

import numpy as np

from jdist._src import errors

DEFAULT_GRAPH_SEED = 87654321  # TF's graph seed when none is set (``random_seed.py``).
_MAXINT32 = 2**31 - 1
_MASK = np.uint64(0xFFFFFFFF)
_BLOCKS = 256  # Philox blocks computed at once, at least (4 samples each).


def philox_blocks(key, counter_hi, first_block, count):
    """``count`` consecutive outputs of TF's ``PhiloxRandom(key, counter_hi)`` from block
    ``first_block``, flattened to 4 uint32 samples each (as uint64 holding 32 bits)."""
    k0, k1 = np.uint64(key & 0xFFFFFFFF), np.uint64((key >> 32) & 0xFFFFFFFF)
    block = np.arange(first_block, first_block + count, dtype=np.uint64)
    c0, c1 = block & _MASK, block >> np.uint64(32)
    c2 = np.full(count, counter_hi & 0xFFFFFFFF, np.uint64)
    c3 = np.full(count, (counter_hi >> 32) & 0xFFFFFFFF, np.uint64)
    for _ in range(10):  # Philox4x32's 10 rounds, the key raised after each.
        p0, p1 = np.uint64(0xD2511F53) * c0, np.uint64(0xCD9E8D57) * c2
        c0, c1, c2, c3 = ((p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & _MASK,
                          (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & _MASK)
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & _MASK, (k1 + np.uint64(0xBB67AE85)) & _MASK
    return np.stack([c0, c1, c2, c3], axis=1).reshape(-1)


class Samples:
    """TF's ``SingleSampleAdapter<PhiloxRandom>(seed, seed2)``: its 32-bit samples in order."""

    def __init__(self, seed, seed2):
        self._seeds, self._block = (int(seed), int(seed2)), 0
        self._samples, self._next = np.zeros(0, np.int64), 0

    def __call__(self) -> int:
        return int(self.take(1)[0])

    def take(self, count: int) -> np.ndarray:
        """The next ``count`` samples, as int64 (each below 2**32)."""
        parts = []
        while count:
            if self._next == len(self._samples):  # Every block this call needs, at once.
                blocks = max(_BLOCKS, -(-count // 4))
                self._samples = philox_blocks(*self._seeds, self._block, blocks).astype(
                    np.int64)
                self._block, self._next = self._block + blocks, 0
            part = self._samples[self._next:self._next + count]
            parts.append(part)
            self._next, count = self._next + len(part), count - len(part)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


def op_seeds(seed):
    """The ``(seed, seed2)`` TF gives a shuffle created with op seed ``seed`` now
    (``random_seed.get_seed``), or None for a nondeterministic order.

    Raises:
      InvalidArgumentError: ``seed`` is None while TensorFlow (imported by the program) has a
        global seed: TF then derives the op seed from its own op counter, which jdist cannot
        follow.
    """
    if seed is not None and not isinstance(seed, (int, np.integer)):
        raise errors.InvalidArgumentError(
            f"shuffle's seed must be an int or None, got {type(seed).__name__} {seed!r} (TF "
            "refuses it too).")
    global_seed = _tf_global_seed()
    if seed is None:
        if global_seed is not None:
            raise errors.InvalidArgumentError(
                "shuffle() without a seed while tf.random.set_seed is in effect: TF derives "
                "this shuffle's seed from its global seed and a count of the ops it has made, "
                "which jdist cannot reproduce, so its order would not be TF's. Pass "
                "shuffle(..., seed=s) (the same in the TF program gives the same order).")
        return None
    seeds = (DEFAULT_GRAPH_SEED if global_seed is None else global_seed % _MAXINT32,
             int(seed) % _MAXINT32)
    return (0, _MAXINT32) if seeds == (0, 0) else seeds


def _tf_global_seed():
    """``tf.random.set_seed``'s value if the program imported TensorFlow and set one."""
    if "tensorflow" not in sys.modules:
        return None
    try:
        from tensorflow.python.eager import context  # pylint: disable=import-outside-toplevel
        return context.global_seed()
    except (ImportError, AttributeError):
        return None


class IterationSeeds:
    """The seeds of each new iterator of one shuffled dataset (TF's seed generator resource).

    Args:
      seeds: `op_seeds`' result (None: random seeds, as TF's for seed 0, 0).
      reshuffle: ``reshuffle_each_iteration``.
    """

    def __init__(self, seeds, reshuffle):
        if seeds is None:
            seeds = tuple(int(x) for x in np.random.SeedSequence().generate_state(2, np.uint64))
        self._seeds = seeds
        self._generator = Samples(*seeds) if reshuffle else None

    def next(self):
        """The seeds of the next iterator."""
        if self._generator is None:
            return self._seeds
        return self._generator(), self._generator()


_CHUNK = 1024  # Items shuffled per pass of the loops below (their samples drawn at once).


def shuffled(make_items, buffer_size, seeds):
    """The items of ``make_items()`` (called at the first one, as tf.data makes a shuffle's
    input) in tf.data's shuffle order for one iterator with ``seeds``.

    Example (TF's ``range(6).shuffle(3, seed=5, reshuffle_each_iteration=False)``):
      >>> list(shuffled(lambda: iter(range(6)), 3, (87654321, 5)))
      [1, 3, 2, 5, 4, 0]
    """
    return itertools.chain.from_iterable(
        run.tolist() if isinstance(run, np.ndarray) else run
        for run in shuffled_runs(make_items, buffer_size, seeds))


def shuffled_runs(make_items, buffer_size, seeds):
    """`shuffled`'s items in runs: lists, and row indices (ints) the drain outputs as one
    int64 array (so a batch right after the shuffle cuts them without a Python int each).

    TF fills its ring buffer before every output, then outputs the item ``sample % count``
    places after the oldest, which takes its place. While the input lasts the buffer is full,
    so each output is followed by one item in, at the oldest's place: the samples of ``_CHUNK``
    outputs are drawn and reduced at once, and each item costs a few list operations. Then the
    buffer drains, its order computed at once (`_drain_order`). A generator per output cost
    0.58-0.65 us per row (2026-11-27)."""
    samples, items = Samples(*seeds), iter(make_items())
    buffer = list(itertools.islice(items, min(buffer_size, sys.maxsize)))  # Before output 1.
    size, oldest, count = buffer_size, 0, len(buffer)
    while count == size:  # Full: one item in (at the oldest's place) per item out.
        incoming = list(itertools.islice(items, _CHUNK))
        if not incoming:
            break
        out = []
        for offset, item in zip((samples.take(len(incoming)) % size).tolist(), incoming):
            chosen = oldest + offset - (size if oldest + offset >= size else 0)
            out.append(buffer[chosen])
            buffer[chosen], buffer[oldest] = buffer[oldest], item
            oldest = oldest + 1 if oldest + 1 < size else 0
        yield out
    if count:  # Drained: the count falls by one per output.
        live = buffer[oldest:] + buffer[:oldest]  # Oldest first (the ring moved only if full).
        order = _drain_order(samples.take(count) % np.arange(count, 0, -1))
        if set(map(type, live)) == {int}:  # Row indices, the usual items: one gather.
            yield np.asarray(live, np.int64)[order]
        else:
            yield [live[k] for k in order.tolist()]


def _drain_order(offsets: np.ndarray) -> np.ndarray:
    """Which of the buffer's ``n`` items (oldest first) each output of a draining shuffle takes,
    computed at once: output ``i`` takes position ``j = i + offsets[i]``, whose item then moves
    to position ``i`` (a Fisher-Yates shuffle).

    Position ``j`` holds, at step ``i``, its own item unless an earlier step ``k`` (the last)
    targeted it, which left there what position ``k`` held at step ``k``; and what a position
    ``k`` holds at its own step follows the same rule back to an item never moved. Those chains
    are followed by pointer jumping, so the loop runs about log2(n) times, not n.

    Example:
      >>> _drain_order(np.array([2, 0, 0])).tolist()  # Take 2; then 1; then 0, moved to 2.
      [2, 1, 0]
    """
    n = len(offsets)
    steps = np.arange(n)
    targets = steps + offsets
    order = (np.argsort(targets * n + steps) if n < 2**31  # By target, then step: unique
             else np.argsort(targets, kind="stable"))  # keys sort three times as fast.
    grouped = targets[order]
    same = np.zeros(n, bool)
    same[1:] = grouped[1:] == grouped[:-1]
    earlier = np.full(n, -1)  # The previous step to target the same position.
    earlier[order[same]] = order[np.flatnonzero(same) - 1]
    ends = np.append(~same[1:], True)
    last = np.full(n, -1)  # The last step to target each position.
    last[grouped[ends]] = order[ends]
    # What a position held at its own step came from the last EARLIER step to target it.
    before_own = np.where(last == steps, earlier, last)
    root = np.where(before_own < 0, steps, before_own)
    while True:  # Follow each chain to the item never moved (``root[k] == k``).
        jumped = root[root]
        if np.array_equal(jumped, root):
            break
        root = jumped
    return np.where(earlier < 0, targets, root[np.maximum(earlier, 0)])
