"""``jdist.experimental``: the names TF keeps under ``tf.distribute.experimental``.

Example:
  >>> import jdist
  >>> jdist.experimental.CommunicationOptions(implementation="ring").implementation
  <CommunicationImplementation.RING: 'RING'>
"""

from jdist._src.input import Optional
from jdist._src.packing import CommunicationImplementation
from jdist._src.packing import CommunicationOptions
from jdist._src.preemption import PreemptionCheckpointHandler
from jdist._src.preemption import TerminationConfig

# TF's deprecated name of CommunicationImplementation.
CollectiveCommunication = CommunicationImplementation

__all__ = ("CollectiveCommunication", "CommunicationImplementation", "CommunicationOptions",
           "Optional", "PreemptionCheckpointHandler", "TerminationConfig")
