"""Errors raised by jdist; see :mod:`jdist._src.errors`."""

from jdist._src.errors import ClusterMismatchError
from jdist._src.errors import CrossReplicaArithmeticError
from jdist._src.errors import InvalidArgumentError
from jdist._src.errors import JdistError
from jdist._src.errors import MissingDependencyError
from jdist._src.errors import MixedStrategyError
from jdist._src.errors import NoGradientError
from jdist._src.errors import OutOfRangeError
from jdist._src.errors import ShapeMismatchError
from jdist._src.errors import UnevenValuesError
from jdist._src.errors import UnavailableError
from jdist._src.errors import UnguardedTraceError
from jdist._src.errors import UnknownDeviceError
from jdist._src.errors import UnsupportedJaxError
from jdist._src.errors import UnsupportedValueError
from jdist._src.errors import WrongContextError
from jdist._src.errors import X64CastWarning
from jdist._src.errors import X64RequiredError

__all__ = (
    "ClusterMismatchError",
    "CrossReplicaArithmeticError",
    "InvalidArgumentError",
    "JdistError",
    "MissingDependencyError",
    "MixedStrategyError",
    "NoGradientError",
    "OutOfRangeError",
    "ShapeMismatchError",
    "UnevenValuesError",
    "UnavailableError",
    "UnguardedTraceError",
    "UnknownDeviceError",
    "UnsupportedJaxError",
    "UnsupportedValueError",
    "WrongContextError",
    "X64CastWarning",
    "X64RequiredError",
)
