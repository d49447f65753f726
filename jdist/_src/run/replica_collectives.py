"""The collectives of a traced replica function, over the replica axis (`base.ReplicaCollectives`
of `MirroredStrategy` and `MultiWorkerMirroredStrategy`)."""

from jdist._src.base import ReplicaCollectives
from jdist._src.reduce import collectives
from jdist._src.reduce_op import ReduceOp
from jdist._src.run import merge


class ReplicaAxisCollectives(ReplicaCollectives):
    """`base.ReplicaCollectives` of a traced replica function: over the replica axis.

    ``all_reduce`` is the strategy's cross-device ops' (a ``psum``, packed or not); while one
    replica of an uneven step is traced (``binding.exact``, `jdist._src.uneven.plan`), ``all_gather``
    and ``merge_call`` are steps of their own, run across replicas between the traced pieces.
    """

    def __init__(self, binding, ops, runner, num_replicas, gradients_through_merge,
                 options=None):
        self._binding = binding
        self._options = options
        self._gradients_through_merge = gradients_through_merge
        self._ops = ops
        self._runner = runner
        self._num_replicas = num_replicas

    def all_reduce(self, op, value, options=None):
        if self._options is not None:
            options = self._options.merge(options)

        def reduce(op, value):
            return self._ops._replica_all_reduce(self._binding.axis_name, self._num_replicas, op,
                                                value, options)
        return collectives.all_reduce_with_tfs_gradient(reduce, op, self._num_replicas, value,
                                                        self._ops._sums_by_psum)

    def all_gather(self, value, axis):
        binding = self._binding
        if binding.exact is not None:
            return binding.exact.all_gather(value, axis, lambda v: self.all_reduce(ReduceOp.SUM, v),
                                            binding.axis_name)
        return collectives.replica_all_gather(binding.axis_name, value, axis)

    def merge_call(self, merge_fn, args, kwargs):
        if not self._gradients_through_merge:
            args, kwargs = merge.without_gradient((args, kwargs))
        if self._binding.exact is not None:
            return self._binding.exact.merge_call(merge_fn, args, kwargs)
        return self._runner.merge_call(self._binding, merge_fn, args, kwargs)
