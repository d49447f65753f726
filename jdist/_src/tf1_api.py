"""Names from the TF 1.x ``Strategy`` API, as a base class of `Strategy`.

TF1 code ran strategies in sessions; here each name does what it means without one (see
``docs/api.md``): iterators are Python iterators, grouping waits for the computation, and
configuration that JAX fixes before it starts is checked or returned unchanged.
"""

import copy

import jax

from jdist._src import errors
from jdist._src.values import DistributedValues


class TF1Methods:
    """The TF1 names of a `Strategy`, written with its public methods."""

    def make_dataset_iterator(self, dataset):
        """TF1 API: ``iter(experimental_distribute_dataset(dataset))``."""
        return iter(self.experimental_distribute_dataset(dataset))

    def make_input_fn_iterator(self, input_fn, replication_mode=None):
        """TF1 API: an iterator over ``distribute_datasets_from_function(input_fn)`` (PER_WORKER only)."""
        from jdist._src.input import datasets as input_lib  # pylint: disable=import-outside-toplevel
        if replication_mode is None:
            replication_mode = input_lib.InputReplicationMode.PER_WORKER
        return input_lib.make_input_fn_iterator(self, input_fn, replication_mode)

    def experimental_run(self, fn, input_iterator=None):
        """TF1 API: ``run(fn, args=(input_iterator.get_next(),))`` (no arguments without an iterator)."""
        from jdist._src.input import datasets as input_lib  # pylint: disable=import-outside-toplevel
        return input_lib.experimental_run(self, fn, input_iterator)

    def unwrap(self, value):
        """TF1 name of `experimental_local_results`: the local components of ``value``."""
        return self.experimental_local_results(value)

    def group(self, value, name=None):
        """Waits until every local component of ``value`` is computed, then returns ``value``.

        TF1 grouped the components into one op to run in a session; in JAX the equivalent of
        running that op is waiting for the asynchronous computation (``jax.block_until_ready``).
        """
        return jax.block_until_ready(value)

    def colocate_vars_with(self, colocate_with_variable):
        """Returns a context manager for creating state next to ``colocate_with_variable``.

        jdist has no variables: state is explicit arrays, placed by the step's outputs (Mirrored
        on every replica's device). The context manager only checks that the value belongs to
        this strategy.
        """
        if isinstance(colocate_with_variable, DistributedValues) and (
                colocate_with_variable.num_replicas != self.num_replicas_in_sync):
            raise errors.InvalidArgumentError(
                "colocate_vars_with got a value of another strategy "
                f"({colocate_with_variable.num_replicas} replicas, this one has "
                f"{self.num_replicas_in_sync}).")
        return self.scope()

    def update_config_proto(self, config_proto):
        """Returns a copy of ``config_proto``: JAX has no session config to adjust.

        Devices and collectives are configured by XLA flags and jax.config before JAX starts, so
        the config is returned unchanged (a deep copy, as TF returns a modified copy).
        """
        return copy.deepcopy(config_proto)

    def configure(self, session_config=None, cluster_spec=None, task_type=None, task_id=None):
        """TF1 configuration hook: checks that the cluster is this one process.

        ``session_config`` has no JAX meaning (devices and collectives are set by XLA flags before
        JAX starts) and is accepted for compatibility.

        Raises:
          InvalidArgumentError: ``cluster_spec`` describes more than one worker; use a
            multi-worker strategy, which reads the cluster from ``TF_CONFIG``.
        """
        spec = cluster_spec or {}
        spec = spec.as_dict() if hasattr(spec, "as_dict") else dict(spec)
        workers = sum(len(v) for k, v in spec.items() if k in ("worker", "chief"))
        if workers > 1:
            raise errors.InvalidArgumentError(
                f"{type(self).__name__} runs in one process; a cluster of {workers} workers needs "
                "MultiWorkerMirroredStrategy.")

    def experimental_initialize(self):
        """Initialisation ops to run before any computation: none are needed in JAX (``[]``)."""
        return []
