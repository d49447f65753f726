"""``jdist.experimental``: the names TF keeps under ``tf.distribute.experimental``.

Example:
  >>> import jdist
  >>> jdist.experimental.CommunicationOptions(implementation="ring").implementation
  <CommunicationImplementation.RING: 'RING'>
"""

from jdist._src.input.datasets import Optional
from jdist._src.reduce.packing import CommunicationImplementation
from jdist._src.reduce.packing import CommunicationOptions
from jdist._src.training.preemption import PreemptionCheckpointHandler
from jdist._src.training.preemption import TerminationConfig

# TF's deprecated name of CommunicationImplementation.
CollectiveCommunication = CommunicationImplementation

__all__ = ("CollectiveCommunication", "CommunicationImplementation", "CommunicationOptions",
           "Optional", "PreemptionCheckpointHandler", "TerminationConfig")
