"""tf.data's shuffle order, reproduced without TensorFlow: the order `NumpyDataset.shuffle` gives.

TF draws it from Philox4x32-10 read one 32-bit sample at a time (`Samples`), seeded by
``get_seed(s)`` (`op_seeds`), through a seed generator per iterator when reshuffling
(`IterationSeeds`), over a ring buffer (`shuffled`). The ring's steps are computed as array
operations for row indices. Checked against TF element by element (``test_numpy_dataset_tf.py``).
"""

import itertools
import sys
from typing import Optional

import numpy as np

from jdist._src import errors

DEFAULT_GRAPH_SEED = 87654321  # TF's graph seed when none is set (``random_seed.py``).
_MAXINT32 = 2**31 - 1
_MASK = np.uint64(0xFFFFFFFF)
_BLOCKS = 256  # Philox blocks computed at once, at least (4 samples each).


def philox_blocks(key: int, counter_hi: int, first_block: int, count: int) -> np.ndarray:
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

    def __init__(self, seed: int, seed2: int):
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
                self._samples = philox_blocks(*self._seeds, self._block, blocks).astype(np.int64)
                self._block, self._next = self._block + blocks, 0
            part = self._samples[self._next:self._next + count]
            parts.append(part)
            self._next, count = self._next + len(part), count - len(part)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


def op_seeds(seed: Optional[int]) -> Optional[tuple]:
    """The ``(seed, seed2)`` TF gives a shuffle with op seed ``seed`` (``random_seed.get_seed``),
    or None for a nondeterministic order. Raises for no seed under TF's global seed."""
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
    """Each new iterator's seeds, from `op_seeds`' (None: random): TF's seed generator."""

    def __init__(self, seeds: Optional[tuple], reshuffle: bool):
        if seeds is None:
            seeds = tuple(int(x) for x in np.random.SeedSequence().generate_state(2, np.uint64))
        self._seeds = seeds
        self._generator = Samples(*seeds) if reshuffle else None
        self._count = 0  # Iterators made: with `_seeds`, the generator's state (`state`).

    def next(self) -> tuple:
        self._count += 1
        if self._generator is None:
            return self._seeds
        return self._generator(), self._generator()

    def state(self) -> list:
        """``[seed, seed2, iterators made]`` for `restore` (``shuffle(seed=None)``'s seeds too)."""
        return [int(self._seeds[0]), int(self._seeds[1]), self._count]

    def restore(self, state) -> None:
        """Continues from `state`: the next iterator gets the seeds it got after that one."""
        seed, seed2, count = (int(x) for x in state)
        self._seeds, self._count = (seed, seed2), count
        if self._generator is not None:
            self._generator = Samples(seed, seed2)
            if count:  # Two samples per iterator made (`next`).
                self._generator.take(2 * count)


_CHUNK = 1024  # Items shuffled per pass of the loops below (their samples drawn at once)...
_MAX_CHUNK = 1 << 16  # ...growing to this many for row indices, shuffled as arrays.


def shuffled(make_items, buffer_size: int, seeds: tuple):
    """The items of ``make_items()`` (called at the first one, as tf.data does) in tf.data's
    shuffle order for one iterator with ``seeds``.

    Example (TF's ``range(6).shuffle(3, seed=5, reshuffle_each_iteration=False)``):
      >>> list(shuffled(lambda: iter(range(6)), 3, (87654321, 5)))
      [1, 3, 2, 5, 4, 0]
    """
    return itertools.chain.from_iterable(
        run.tolist() if isinstance(run, np.ndarray) else run
        for run in shuffled_runs(make_items, buffer_size, seeds))


def shuffled_runs(make_items, buffer_size: int, seeds: tuple):
    """`shuffled`'s items in runs: lists, or int64 arrays of row indices (for a batch to cut).

    TF fills its ring buffer before every output, then outputs the item ``sample % count``
    places after the oldest, which takes its place. While the input lasts, each output lets one
    item in: row indices in chunks of steps at once (`_full_ring_steps`, 8x the list loop's
    speed). Then the buffer drains (`_drain_order`)."""
    samples, take = Samples(*seeds), _taker(make_items())
    buffer = take(min(buffer_size, sys.maxsize))  # Made before the first output.
    size, oldest, count, chunk = buffer_size, 0, len(buffer), _CHUNK
    rows = _are_rows(buffer)
    buffer = np.asarray(buffer, np.int64) if rows else buffer
    while count == size:  # Full: one item in (at the oldest's place) per item out.
        incoming = take(chunk)
        if len(incoming) == 0:
            break
        offsets = samples.take(len(incoming)) % size
        if rows and _are_rows(incoming):
            yield _full_ring_steps(buffer, oldest, offsets, np.asarray(incoming, np.int64))
            chunk = min(2 * chunk, _MAX_CHUNK)
        else:
            buffer, rows = (buffer.tolist() if rows else buffer), False
            yield _ring_steps(buffer, oldest, offsets.tolist(), list(incoming))
        oldest = (oldest + len(incoming)) % size
    if count:  # Drained: the count falls by one per output.
        live = (np.concatenate([buffer[oldest:], buffer[:oldest]]) if rows
                else buffer[oldest:] + buffer[:oldest])  # Oldest first (moved only if full).
        order = _drain_order(samples.take(count) % np.arange(count, 0, -1))
        if rows or _are_rows(live):  # Row indices, the usual items: one gather.
            yield np.asarray(live, np.int64)[order]
        else:
            yield [live[k] for k in order.tolist()]


class Rows:
    """Row indices in order: ``rows`` repeated ``times`` times (None: forever). Iterated, the
    ints; a shuffle reads them as int64 arrays (`take`), a batch in `runs`.

    Example:
      >>> rows = Rows(range(3), 2)
      >>> list(Rows(range(3), 2)), rows.take(4).tolist(), rows.take(4).tolist()
      ([0, 1, 2, 0, 1, 2], [0, 1, 2, 0], [1, 2])
      >>> list(Rows(range(2), 2).repeated(3))
      [0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1]
      >>> list(Rows(range(10)).sliced(slice(2, None, 3))), Rows(range(3), 2).sliced(slice(1))
      ([2, 5, 8], None)
      >>> [run.tolist() for run in Rows(range(5)).runs(2)]
      [[0, 1], [2, 3], [4]]
    """

    def __init__(self, rows: range, times: Optional[int] = 1):
        self._rows, self._times = rows, times
        self._epochs_left, self._next = times, 0  # What `take` has still to read.

    def repeated(self, times: Optional[int]) -> "Rows":
        """These rows ``times`` times over (None: forever), as a ``repeat`` of them reads."""
        return Rows(self._rows, None if times is None or self._times is None
                    else self._times * times)

    def sliced(self, rows: slice) -> Optional["Rows"]:
        """These rows read once, cut by ``rows`` (a take, skip or shard); None if repeated."""
        return Rows(self._rows[rows]) if self._times == 1 else None

    def __iter__(self):
        if not len(self._rows):
            return iter(())
        epochs = itertools.repeat(self._rows, *(() if self._times is None else (self._times,)))
        return itertools.chain.from_iterable(epochs)

    def runs(self, size: int):
        """The rows as int64 arrays of ``size`` (the last one shorter)."""
        while len(run := self.take(size)):
            yield run

    def take(self, count: int) -> np.ndarray:
        """The next ``count`` rows (fewer at the end), continuing where the last call ended."""
        parts = [np.zeros(0, np.int64)]
        while count and len(self._rows) and self._epochs_left != 0:
            part = self._rows[self._next:self._next + count]
            parts.append(np.arange(part.start, part.stop, part.step, dtype=np.int64))
            self._next, count = self._next + len(part), count - len(part)
            if self._next == len(self._rows):  # An epoch read: the next one, if any.
                self._next = 0
                self._epochs_left = None if self._epochs_left is None else self._epochs_left - 1
        return parts[-1] if len(parts) == 2 else np.concatenate(parts)


def _taker(source):
    """A shuffle's input, ``count`` items a call: `Rows` as int64 arrays, others as lists."""
    if isinstance(source, Rows):
        return source.take
    items = iter(source)
    return lambda count: list(itertools.islice(items, count))


def _are_rows(items):
    """Whether ``items`` are row indices (what a shuffle of a numpy dataset's rows reads)."""
    return isinstance(items, np.ndarray) or set(map(type, items)) == {int}


def _ring_steps(buffer, oldest, offsets, incoming):
    """The full ring ``buffer``'s steps, one per ``incoming`` item (any items): their outputs."""
    size, out = len(buffer), []
    for offset, item in zip(offsets, incoming):
        chosen = oldest + offset - (size if oldest + offset >= size else 0)
        out.append(buffer[chosen])
        buffer[chosen], buffer[oldest] = buffer[oldest], item
        oldest = oldest + 1 if oldest + 1 < size else 0
    return out


def _full_ring_steps(buffer, oldest, offsets, incoming):
    """`_ring_steps` at once for row indices (``buffer`` an int64 array, updated).

    A move at step ``j`` lands where step ``j + offsets[j]`` (its target) puts its incoming
    item, so step ``t``'s oldest holds what the last move targeting ``t`` brought, else what
    came in a lap before, else the ring's own; it takes what the move before it with its target
    brought, else what came in there, else the ring's own. Moves bring what their step's oldest
    held: references to earlier steps, followed by pointer jumping."""
    size, n = len(buffer), len(offsets)
    steps = np.arange(n)
    pool = np.concatenate([buffer, incoming])  # Items named by index: the ring's, then n in.
    oldest_at = (oldest + steps) % size
    earlier_move, last_move, after_end = _moves_by_target(offsets, n)
    came_in = steps - size  # The step whose item came in at ``oldest_at`` a lap before.
    found = np.where(came_in >= 0, size + came_in, oldest_at)  # What each step's oldest holds.
    _follow(found, last_move)
    came_in = steps + offsets - size  # Where step t takes from, the last item came in then.
    taken = np.where(came_in >= 0, size + came_in, (oldest_at + offsets) % size)
    after_a_move = np.flatnonzero(earlier_move >= 0)  # Its target's earlier move brought it.
    taken[after_a_move] = found[earlier_move[after_a_move]]
    taken[offsets == 0] = found[offsets == 0]  # It takes its oldest.
    last_lap = steps[max(0, n - size):]  # Each position's last incoming item, then the moves
    buffer[oldest_at[last_lap]] = pool[size + last_lap]  # made after it (targets past n).
    buffer[(oldest + after_end + offsets[after_end]) % size] = pool[found[after_end]]
    return pool[taken]


def _follow(found, reference):
    """``found[k] = found[reference[k]]`` where ``reference[k] >= 0``, by pointer jumping."""
    pending = np.flatnonzero(reference >= 0)
    while pending.size:
        to = reference[pending]
        found[pending], reference[pending] = found[to], reference[to]
        pending = pending[reference[pending] >= 0]


def _moves_by_target(offsets, n):
    """`_full_ring_steps`' moves (nonzero offsets) by target step: the move before each in its
    group, the last move targeting each step (-1: none), the last ones targeting steps past n."""
    moves = np.flatnonzero(offsets)
    moves, targets, earlier, last = _by_target(moves, moves + offsets[moves], n)
    last_move = np.full(n, -1)
    inside = last & (targets < n)
    last_move[targets[inside]] = moves[inside]
    return earlier, last_move, moves[last & (targets >= n)]


def _by_target(steps, targets, n):
    """``steps`` (increasing) and ``targets`` sorted by target, then step; per step the one
    before it with its target (-1: none); whether each sorted step is its target's last."""
    order = (np.argsort(targets * n + steps) if n < 2**31  # Unique keys sort three times
             else np.argsort(targets, kind="stable"))  # as fast as a stable sort.
    steps, targets = steps[order], targets[order]
    same = targets[1:] == targets[:-1]
    earlier = np.full(n, -1)
    earlier[steps[1:][same]] = steps[:-1][same]
    last = np.ones(len(steps), bool)
    last[:-1] = ~same
    return steps, targets, earlier, last


def _drain_order(offsets: np.ndarray) -> np.ndarray:
    """Which of the buffer's ``n`` items (oldest first) each output of a draining shuffle takes:
    output ``i`` takes position ``j = i + offsets[i]``, whose item moves to ``i`` (Fisher-Yates).

    Position ``j`` holds at step ``i`` its own item unless an earlier step ``k`` (the last)
    targeted it, which left there what position ``k`` held at step ``k``: chains back to an
    item never moved, followed by pointer jumping (about log2(n) passes, not n).

    Example:
      >>> _drain_order(np.array([2, 0, 0])).tolist()  # Take 2; then 1; then 0, moved to 2.
      [2, 1, 0]
    """
    n = len(offsets)
    steps = np.arange(n)
    targets = steps + offsets
    order, grouped, earlier, ends = _by_target(steps, targets, n)
    last = np.full(n, -1)  # The last step to target each position.
    last[grouped[ends]] = order[ends]
    # What a position held at its own step came from the last EARLIER step to target it.
    before_own = np.where(last == steps, earlier, last)
    root = steps.copy()
    _follow(root, before_own)  # Each chain followed to the item never moved.
    return np.where(earlier < 0, targets, root[np.maximum(earlier, 0)])
