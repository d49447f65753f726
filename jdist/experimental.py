"""``jdist.experimental``: the names TF keeps under ``tf.distribute.experimental``.

Example:
  >>> import jdist
  >>> jdist.experimental.CommunicationOptions(implementation="ring").implementation
  <CommunicationImplementation.RING: 'RING'>
"""

from jdist._src.input import Optional
from jdist._src.packing import CommunicationImplementation
from jdist._src.packing import CommunicationOptions

# TF's deprecated name of CommunicationImplementation.
CollectiveCommunication = CommunicationImplementation

__all__ = ("CollectiveCommunication", "CommunicationImplementation", "CommunicationOptions",
           "Optional")
