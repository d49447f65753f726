"""Helpers that keep multi-device tests short (in the spirit of ``chex``).

Example:
  >>> import numpy as np, jdist.testing
  >>> s = jdist.testing.mirrored(2)
  >>> v = jdist.testing.per_replica(s, [np.float32([1.0, 2.0]), np.float32([3.0])])
  >>> jdist.testing.assert_local_results(s, v, [[1.0, 2.0], [3.0]])
"""

import contextlib
import functools
import re
from typing import Any, Iterator, List, Sequence

import jax
import jax.monitoring
import numpy as np

import jdist

REPLICA_COUNTS = (1, 2, 3, 4, 8)  #: The replica counts jdist's tests cover (8 CPU devices).
#: The dataset tests add 5 replicas, where TF's split leaves trailing replicas short or empty.
DATASET_REPLICA_COUNTS = (1, 2, 3, 4, 5, 8)


@functools.lru_cache(maxsize=None)
def mirrored(num_replicas: int) -> jdist.MirroredStrategy:
    """A `MirroredStrategy` over the first ``num_replicas`` local devices, shared per count (so
    tests reuse its compiled programs).

    Args:
      num_replicas: how many devices (from ``jax.local_devices()``) to replicate over.

    Returns:
      The strategy.
    """
    return jdist.MirroredStrategy(jax.local_devices()[:num_replicas])


@functools.lru_cache(maxsize=None)
def mirrored_reducing_to_one_device(num_replicas: int) -> jdist.MirroredStrategy:
    """`mirrored` with ``cross_device_ops=ReductionToOneDevice()`` (which, as TF's, takes every
    dtype and a negative gather axis), shared per count.

    Example:
      >>> s = jdist.testing.mirrored_reducing_to_one_device(2)
      >>> type(s.extended._cross_device_ops).__name__
      'ReductionToOneDevice'
    """
    return jdist.MirroredStrategy(jax.local_devices()[:num_replicas],
                                  cross_device_ops=jdist.ReductionToOneDevice())


def per_replica(strategy: jdist.Strategy, components: Sequence[Any]) -> Any:
    """A `PerReplica` with one given component per replica (uneven leading sizes allowed).

    Args:
      strategy: the strategy whose replicas get the components.
      components: a list with one array (or nest) per replica.

    Returns:
      The distributed value, as `Strategy.experimental_distribute_values_from_function` builds it.
    """
    if len(components) != strategy.num_replicas_in_sync:
        raise ValueError(f"expected {strategy.num_replicas_in_sync} components, got "
                         f"{len(components)}.")
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: components[ctx.replica_id_in_sync_group])


def assert_local_results(strategy: jdist.Strategy, value: Any, expected: Sequence[Any],
                         rtol: float = 1e-6, atol: float = 1e-6) -> None:
    """Asserts that each replica's component of ``value`` equals ``expected[i]`` (NumPy close).

    Args:
      strategy: the strategy that holds ``value``.
      value: a distributed value (or a plain value on one replica).
      expected: a list with one expected array (or nest) per replica.
      rtol: relative tolerance.
      atol: absolute tolerance.
    """
    results = strategy.experimental_local_results(value)
    assert len(results) == len(expected), (len(results), len(expected))
    for i, (got, want) in enumerate(zip(results, expected)):
        jax.tree_util.tree_map(
            lambda g, w: np.testing.assert_allclose(
                np.asarray(g), np.asarray(w), rtol=rtol, atol=atol,
                err_msg=f"replica {i}"), got, want)


#: The event JAX records once per XLA compilation.
_XLA_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def count_compiles() -> Iterator[List[float]]:
    """Counts the XLA compilations made inside the ``with`` block (through ``jax.monitoring``).

    Yields:
      A list that gains one entry (the compile's duration in seconds) per XLA compilation.

    Example:
      >>> import jax
      >>> f = jax.jit(lambda x: x * 3.0)
      >>> with jdist.testing.count_compiles() as compiles:
      ...   _ = [f(np.float32(i)) for i in range(3)]
      >>> len(compiles)
      1
    """
    compiles: List[float] = []

    def listener(event: str, duration_secs: float, **_: Any) -> None:
        if event == _XLA_COMPILE_EVENT:
            compiles.append(duration_secs)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


_ALL_REDUCE_PATTERNS = (
    re.compile(r'"?stablehlo\.all_reduce"?\('),  # Lowered StableHLO (generic or pretty form).
    re.compile(r"=\s*\S.*?\ball-reduce(?:-start)?\("),  # Compiled HLO (sync or async start).
)


def count_all_reduces(hlo_text: str) -> int:
    """Counts the all-reduce operations in HLO text.

    Args:
      hlo_text: lowered StableHLO (``jax.jit(f).lower(...).as_text()``) or compiled HLO
        (``.compile().as_text()``, where the compiler may have merged several into one).

    Returns:
      The number of all-reduce operations.

    Example:
      >>> count_all_reduces('%1 = "stablehlo.all_reduce"(%arg0) ...')
      1
    """
    lowered = len(_ALL_REDUCE_PATTERNS[0].findall(hlo_text))
    if lowered:
        return lowered
    return sum(1 for line in hlo_text.splitlines() if _ALL_REDUCE_PATTERNS[1].search(line))
