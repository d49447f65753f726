"""``jdist.checkpoint``: saving and restoring Mirrored training state with orbax-checkpoint,
and the position of a distributed iterator with it (`iterator_state`, `iterator_from_state`:
JSON, which `CheckpointManager` saves beside the state in the same atomic step).

Needs the ``checkpoint`` extra (``pip install 'jdist[checkpoint]'``); orbax is imported when a
`CheckpointManager` is first created, not by ``import jdist``.

Example:
  >>> import jdist
  >>> jdist.checkpoint.CheckpointManager.__name__
  'CheckpointManager'
"""

from jdist._src.training.checkpoint import CheckpointManager
from jdist._src.input.iterator_state import iterator_from_state
from jdist._src.input.iterator_state import iterator_state

__all__ = ("CheckpointManager", "iterator_from_state", "iterator_state")
