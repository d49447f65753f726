"""Typed errors raised by jdist.

Every error subclasses both :class:`JdistError` (catch anything jdist raises) and the builtin
TensorFlow raises for the same situation (``ValueError``, ``TypeError``, ``RuntimeError``), so code
ported from tf.distribute that catches the builtin keeps working.
"""


class JdistError(Exception):
    """Base class of every error jdist raises on purpose."""


class InvalidArgumentError(JdistError, ValueError):
    """An argument has the wrong value (an unknown op, an axis out of range, ...)."""


class ShapeMismatchError(InvalidArgumentError):
    """Per-replica values whose shapes must agree do not."""


class X64RequiredError(InvalidArgumentError):
    """An int64 host number does not fit the int32 that JAX without ``jax_enable_x64`` holds it
    in (JAX would wrap it); the message names 64-bit mode and the other ways out."""


class UnknownDeviceError(InvalidArgumentError):
    """A device name or object does not name a device this process can use."""


class OutOfRangeError(JdistError, IndexError):
    """An iterator was asked for an element after its data ended (TF's ``OutOfRangeError``)."""


class WrongContextError(JdistError, RuntimeError):
    """A call was made in a context where it is not allowed (replica vs cross-replica)."""


class MixedStrategyError(WrongContextError):
    """A scope of one strategy was entered inside the scope of another."""


class UnguardedTraceError(WrongContextError):
    """``strategy.run`` was traced into a program jdist's CPU dispatch guard cannot pace.

    A plain ``jax.jit`` (or ``lax.scan``, ``jax.grad``, ...) around ``strategy.run`` on several
    simulated CPU devices builds a collective program that JAX launches by itself; launched back
    to back, such programs deadlock the CPU runtime. Use ``jdist.function`` instead of
    ``jax.jit`` for the outermost compiled function.
    """


class CrossReplicaArithmeticError(JdistError, TypeError):
    """Arithmetic was attempted on a per-replica value outside the replica function."""


class UnsupportedValueError(JdistError, TypeError):
    """A value of a type jdist cannot distribute or return from a replica function."""


class NoGradientError(JdistError, ValueError):
    """A gradient came back through a ``merge_call`` result on a strategy whose ``merge_fn`` TF
    runs outside the replica's gradient tape (``MirroredStrategy``,
    ``MultiWorkerMirroredStrategy``): TF's ``tape.gradient`` gives None there, which
    ``jax.grad`` cannot; the message names the ways out (``lax.stop_gradient`` for TF's
    numbers, ``all_reduce`` to differentiate)."""


class UnevenValuesError(JdistError, RuntimeError):
    """Per-replica values of different shapes reached a place where jdist cannot compute TF's
    numbers exactly (a traced loop, a collective inside ``lax.scan``); the message names the
    ways out: run that batch outside the jit, ``drop_remainder=True``, or padded batches."""


class UnsupportedJaxError(JdistError, ImportError):
    """The installed JAX is not a release jdist is tested on (raised when jdist is imported);
    the message names the tested releases and how to try another anyway."""


class MissingDependencyError(JdistError, ImportError):
    """A feature needs an optional package (an extra such as ``jdist[checkpoint]``) not installed."""


class UnavailableError(JdistError, RuntimeError):
    """A peer worker died or stopped reaching collectives (TF's ``UnavailableError``).

    The multi-worker watchdog prints it and ends the process with exit status 14 when the main
    thread is blocked in a collective; `MultiWorkerMirroredStrategy` documents the timeout.
    """


class ClusterMismatchError(JdistError, RuntimeError):
    """JAX's distributed runtime runs already with another cluster, or cannot start for this one."""


class X64CastWarning(UserWarning):
    """Without ``jax_enable_x64``, jdist holds float64 host values as float32, as ``jax.jit``
    does, and says so once per dtype and process (TF computes with them in float64)."""
