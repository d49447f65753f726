"""Typed errors raised by jdist.

Every error subclasses both :class:`JdistError` and the builtin TensorFlow raises for the same
situation, so code ported from tf.distribute that catches the builtin keeps working.
"""


class JdistError(Exception):
    """Base class of every error jdist raises on purpose."""


class InvalidArgumentError(JdistError, ValueError):
    """An argument has the wrong value (an unknown op, an axis out of range, ...)."""


class ShapeMismatchError(InvalidArgumentError):
    """Per-replica values whose shapes must agree do not."""


class X64RequiredError(InvalidArgumentError):
    """An int64 host number does not fit the int32 JAX without ``jax_enable_x64`` holds it in."""


class UnknownDeviceError(InvalidArgumentError):
    """A device name or object does not name a device this process can use."""


class OutOfRangeError(JdistError, IndexError):
    """An iterator was asked for an element after its data ended (TF's ``OutOfRangeError``)."""


class WrongContextError(JdistError, RuntimeError):
    """A call was made in a context where it is not allowed (replica vs cross-replica)."""


class MixedStrategyError(WrongContextError):
    """A scope of one strategy was entered inside the scope of another."""


class UnguardedTraceError(WrongContextError):
    """``strategy.run`` was traced into a program jdist's CPU dispatch guard cannot pace (a plain
    ``jax.jit`` on several CPU devices); use ``jdist.function`` for the outermost function."""


class CrossReplicaArithmeticError(JdistError, TypeError):
    """Arithmetic was attempted on a per-replica value outside the replica function."""


class UnsupportedValueError(JdistError, TypeError):
    """A value of a type jdist cannot distribute or return from a replica function."""


class NoGradientError(JdistError, ValueError):
    """A gradient came back through a ``merge_call`` result where TF runs ``merge_fn`` outside
    the gradient tape (``MirroredStrategy``): TF's gradient is None there."""


class UnevenValuesError(JdistError, RuntimeError):
    """Per-replica values of different shapes reached a place where jdist cannot compute TF's
    numbers exactly (a traced loop, a collective inside ``lax.scan``)."""


class UnsupportedJaxError(JdistError, ImportError):
    """The installed JAX is not a release jdist is tested on (raised when jdist is imported)."""


class MissingDependencyError(JdistError, ImportError):
    """A feature needs an optional package (an extra such as ``jdist[checkpoint]``) not installed."""


class UnavailableError(JdistError, RuntimeError):
    """A peer worker died or stopped reaching collectives (TF's ``UnavailableError``); the
    multi-worker watchdog prints it and exits with status 14."""


class ClusterMismatchError(JdistError, RuntimeError):
    """JAX's distributed runtime runs already with another cluster, or cannot start for this one."""


class X64CastWarning(UserWarning):
    """jdist holds float64 host values as float32 without ``jax_enable_x64``, as ``jax.jit`` does
    (said once per dtype and process)."""
