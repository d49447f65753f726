"""Input across workers: each worker places its own replicas' rows; PER_WORKER pipelines in step.

For a ``PER_WORKER`` dataset the workers exchange their batches' shapes every step (through the
coordination service, never an XLA collective), so all build the same global arrays; a worker
whose data has ended takes part with empty batches, as in TF, until every worker is out. The
exchange runs on the consumer's thread, in order with the other agreements: a prefetch thread
waiting for a peer could not be stopped.
"""

import itertools
from typing import Any, Callable, Iterator

import jax
import numpy as np

from jdist._src import errors
from jdist._src.input import batches as input_batches
from jdist._src.input import prefetch
from jdist._src.values import PerReplica


class LocalRowsPlacer(input_batches.Placer):
    """Places only THIS worker's replicas' rows of each split batch, as global arrays.

    The global lengths still come from all chunks: views of the batch, or shape-only stand-ins
    for other workers' batches. ``fetch_to_device`` is accepted; the rows always go to devices.
    """

    whole_batches_here = False

    def __init__(self, strategy: Any, fetch_to_device: bool = True):
        super().__init__(strategy, fetch_to_device)
        ids = strategy.extended._local_replica_ids()
        self._lo, self._hi = ids[0], ids[-1] + 1

    def split(self, chunks: list, rows: Any) -> tuple:
        """This worker's chunks stacked (uneven ones are `ragged.RaggedRowsPlacer`'s)."""
        return (np.stack(chunks[self._lo:self._hi]), None, input_batches.STACKED)

    def place(self, leaves: list) -> list:
        """The element's `PerReplica` values, built from this worker's rows."""
        out = []
        for array, lengths, kind in leaves:
            if kind != input_batches.STACKED:
                raise input_batches.unbatched_error(self.n)
            if array.shape[0] == self.n:  # A full batch reshaped whole: keep this worker's rows.
                array = array[self._lo:self._hi]
            out.append(PerReplica._from_stacked(jax.make_array_from_process_local_data(
                self._targets[input_batches.STACKED], array, (self.n,) + array.shape[1:]), lengths))
        return out


def per_worker_feed(extended: Any, source: input_batches.Source,
                    dealer: input_batches.PerReplicaDealer) -> tuple[Iterator, Callable, Callable]:
    """``(groups, transform, finish)`` of a PER_WORKER dataset over several workers.

    ``groups`` yields this worker's groups of per-replica batches (None once its data has ended),
    ``transform`` runs on the prefetch thread, ``finish`` (the lockstep) on the consumer's.
    """
    ids = extended._replica_ids_by_worker()
    me = extended.worker_index
    groups = _local_groups(source.open(), len(ids[me]))
    return groups, _identity, _Lockstep(extended, source, dealer, ids)


def _identity(group):
    return group


def _local_groups(batches, size):
    """Groups of up to ``size`` consecutive batches, then None forever once they have ended."""
    try:
        while True:
            group = list(itertools.islice(batches, size))
            if not group:
                break
            yield group
            if len(group) < size:
                break
        while True:
            yield None
    finally:
        batches.close()


class _Lockstep:
    """One step of a PER_WORKER dataset: exchange what each worker holds, deal the global group.

    Calling it with this worker's group (None once out) returns the element, or `prefetch.END`
    once every worker is out.
    """

    def __init__(self, extended, source, dealer, ids):
        self._agreement = extended.agreement
        self._cluster = extended.cluster
        self._source = source
        self._dealer = dealer
        self._ids = ids
        self._me = extended.worker_index
        self._template = None  # (tree, [(inner shape, dtype)]) of this worker's batches.
        self._first = True

    def __call__(self, group):
        slots = [None] * len(self._ids[self._me])
        if group is not None:
            self._template = _template(group[0])
            for k, batch in enumerate(group):
                slots[k] = [[list(a.shape), str(a.dtype)]
                            for a in jax.tree_util.tree_leaves(batch)]
        template = self._template if group is not None else self._known_template()
        everyone = self._agreement.exchange("distribute_datasets_from_function (PER_WORKER)", {
            "out": group is None, "slots": slots, "rows": self._dealer.rows,
            "tree": None if template is None else str(template[0])})
        if all(p["out"] for p in everyone):
            return prefetch.END
        self._check(everyone)
        if self._first:  # One padded size on every worker: the largest declared full batch.
            self._first = False
            self._dealer.rows = max((p["rows"] for p in everyone if p["rows"] is not None),
                                    default=None)
        return self._dealer(self._global_group(group, everyone, template))

    def _known_template(self):
        if self._template is None:
            first = self._source.first()  # A declared spec, or the first batch (if any).
            if first is None:  # tf.data: TF's dummies from its element spec.
                first = self._source.empty_spec()
            self._template = None if first is None else _template(first)
        return self._template

    def _check(self, everyone):
        """Raises, on every worker alike, unless the workers' batches can form one element."""
        trees = {p["tree"] for p in everyone}
        if None in trees:
            lost = [self._cluster.name(w) for w, p in enumerate(everyone) if p["tree"] is None]
            raise errors.InvalidArgumentError(
                f"the PER_WORKER dataset_fn of {', '.join(lost)} yielded no batch, and its "
                "element structure is unknown, so it cannot take part with empty batches; return "
                "a tf.data.Dataset or a NumpyDataset (they declare their element_spec), or give "
                "every worker at least one batch.")
        if len(trees) != 1:
            raise errors.InvalidArgumentError(
                f"the workers' PER_WORKER datasets yield elements of different structures: "
                f"{sorted(trees)}.")
        leaves = [s for p in everyone for s in p["slots"] if s is not None]
        for j in range(len(leaves[0])):
            kinds = {(tuple(s[j][0][1:]), s[j][1]) for s in leaves}
            if len({d for _, d in kinds}) != 1 or len({i for i, _ in kinds}) != 1:
                raise errors.UnevenValuesError(
                    f"leaf {j} of the workers' PER_WORKER batches differs in dtype or in its "
                    f"non-batch dimensions ({sorted(kinds)}); every replica's batch must share "
                    "them.")

    def _global_group(self, group, everyone, template):
        """N per-replica batches: this worker's own, stand-ins for the others'. A stand-in has
        the batch's shape and dtype (zeros, broadcast: no memory) and is never placed."""
        tree, specs = template
        out = [None] * sum(len(i) for i in self._ids)
        for w, payload in enumerate(everyone):
            for k, replica in enumerate(self._ids[w]):
                if w == self._me:
                    out[replica] = group[k] if group is not None and k < len(group) else None
                elif payload["slots"][k] is not None:
                    out[replica] = jax.tree_util.tree_unflatten(tree, [
                        np.broadcast_to(np.zeros((), dtype), shape)
                        for (shape, _), (_, dtype) in zip(payload["slots"][k], specs)])
        return out


def _template(batch):
    leaves, tree = jax.tree_util.tree_flatten(batch)
    return tree, [(tuple(a.shape[1:]), np.dtype(a.dtype)) for a in leaves]
