"""``jdist.experimental``: the names TF keeps under ``tf.distribute.experimental``.

Example:
  >>> import jdist
  >>> jdist.experimental.CommunicationOptions(implementation="ring").implementation
  <CommunicationImplementation.RING: 'RING'>
"""

from jdist._src.cross_device_ops import CommunicationImplementation
from jdist._src.cross_device_ops import CommunicationOptions

# TF's deprecated name of CommunicationImplementation.
CollectiveCommunication = CommunicationImplementation

__all__ = ("CollectiveCommunication", "CommunicationImplementation", "CommunicationOptions")
