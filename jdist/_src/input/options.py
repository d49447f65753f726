"""The types that describe distributed input: `InputReplicationMode`, `InputContext` (what
``distribute_datasets_from_function`` tells ``dataset_fn``) and `InputOptions` (how datasets are
split, padded and fed), as in ``tf.distribute``."""

import enum
from typing import Any, Optional

from jdist._src.input import auto_shard
from jdist._src import errors


class InputReplicationMode(enum.Enum):
    """How ``distribute_datasets_from_function`` replicates ``dataset_fn``: once per worker,
    its batches dealt to the replicas in turn (``PER_WORKER``), or once per replica."""
    PER_WORKER = "PER_WORKER"
    PER_REPLICA = "PER_REPLICA"


class InputContext:
    """What an input function is told about its input pipeline (``tf.distribute.InputContext``).

    Args:
      num_input_pipelines: how many input pipelines (workers) there are.
      input_pipeline_id: this pipeline's index in ``[0, num_input_pipelines)``.
      num_replicas_in_sync: how many replicas consume the batches.

    Example:
      >>> ctx = InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=4)
      >>> ctx.get_per_replica_batch_size(64)
      16
    """

    def __init__(self, num_input_pipelines: int = 1, input_pipeline_id: int = 0,
                 num_replicas_in_sync: int = 1):
        self._num_input_pipelines = int(num_input_pipelines)
        self._input_pipeline_id = int(input_pipeline_id)
        self._num_replicas_in_sync = int(num_replicas_in_sync)

    @property
    def num_input_pipelines(self) -> int:
        """The number of input pipelines (one per worker, or per replica in PER_REPLICA mode)."""
        return self._num_input_pipelines

    @property
    def input_pipeline_id(self) -> int:
        """This input pipeline's index; use it to shard the data (``ds.shard(num, id)``)."""
        return self._input_pipeline_id

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of replicas the batches are for."""
        return self._num_replicas_in_sync

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """``global_batch_size // num_replicas_in_sync``.

        Raises:
          InvalidArgumentError (a ValueError): the global batch size does not divide evenly.
        """
        if global_batch_size % self._num_replicas_in_sync != 0:
            raise errors.InvalidArgumentError(
                f"The `global_batch_size` {global_batch_size!r} is not divisible by "
                f"`num_replicas_in_sync` {self._num_replicas_in_sync!r}.")
        return global_batch_size // self._num_replicas_in_sync

    def __repr__(self):
        return (f"InputContext(num_input_pipelines={self._num_input_pipelines}, "
                f"input_pipeline_id={self._input_pipeline_id}, "
                f"num_replicas_in_sync={self._num_replicas_in_sync})")


class InputOptions:
    """Options for distributed datasets (``tf.distribute.InputOptions``).

    Args:
      experimental_fetch_to_device: True (default) transfers each replica's batch to its device
        ahead of the step; False keeps the batches in host memory until ``run``.
      experimental_replication_mode: an `InputReplicationMode`
        (``distribute_datasets_from_function`` only).
      experimental_place_dataset_on_device: accepted for TF compatibility; requires
        ``PER_REPLICA`` mode and ``experimental_fetch_to_device=False``, as in TF.
      experimental_per_replica_buffer_size: how many prepared elements may wait ahead of the
        step (default TF's 1; None the same; 0 prepares each on request, no thread). A numpy
        dataset on CPU devices is placed in blocks by the loop's own thread whatever the size.
      auto_shard_policy: a `jdist.AutoShardPolicy` for ``experimental_distribute_dataset``
        (TF keeps it in ``tf.data.Options``, also read). None: the tf.data dataset's own,
        else ``AUTO``.

    Example:
      >>> InputOptions(experimental_per_replica_buffer_size=None).experimental_per_replica_buffer_size
      1
    """

    def __init__(self, experimental_fetch_to_device: Optional[bool] = None,
                 experimental_replication_mode: Any = InputReplicationMode.PER_WORKER,
                 experimental_place_dataset_on_device: bool = False,
                 experimental_per_replica_buffer_size: Optional[int] = 1,
                 auto_shard_policy: Any = None) -> None:
        if experimental_fetch_to_device is None:
            experimental_fetch_to_device = True
        mode = experimental_replication_mode
        if isinstance(mode, str):
            try:
                mode = InputReplicationMode[mode.upper()]
            except KeyError:
                raise errors.InvalidArgumentError(
                    f"{mode!r} is not an InputReplicationMode (PER_WORKER, PER_REPLICA).") from None
        if not isinstance(mode, InputReplicationMode):
            raise errors.InvalidArgumentError(
                f"experimental_replication_mode must be an InputReplicationMode, got {mode!r}.")
        size = 1 if experimental_per_replica_buffer_size is None else (
            experimental_per_replica_buffer_size)
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise errors.InvalidArgumentError(
                f"experimental_per_replica_buffer_size must be None or an int >= 0, got "
                f"{size!r}.")
        self.experimental_fetch_to_device = bool(experimental_fetch_to_device)
        self.experimental_replication_mode = mode
        self.experimental_place_dataset_on_device = bool(experimental_place_dataset_on_device)
        self.experimental_per_replica_buffer_size = size
        self.auto_shard_policy = auto_shard.as_policy(auto_shard_policy)

    def __eq__(self, other):
        return isinstance(other, InputOptions) and vars(self) == vars(other)

    def __hash__(self):
        return hash(tuple(sorted(vars(self).items())))

    def __repr__(self):
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"InputOptions({fields})"
