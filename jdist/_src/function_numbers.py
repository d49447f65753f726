"""A `jdist.function`'s Python-number arguments, compiled in as ``tf.function`` compiles them.

``tf.function`` hands its function a Python number as that number, and traces again for each
new value. So ``lr / 3`` in it is Python's float64 division, rounded to float32 once where a
tensor meets it. A ``strategy.run(fn, args=(lr,))`` inside gets the number itself: its
``merge_call`` takes it as one value, and its ``all_reduce`` sums the replicas' copies.

A ``jax.jit`` tracer can be none of these: traced, ``lr / 3`` is float32's division of
float32(lr). On lr = 0.01 that gives 0.0033333332 where TF gives 0.0033333334. So `function`
takes such numbers out of the call, keys its program on their values, and puts them back while
its function is traced. Arrays (``jnp.float32(lr)``, TF's tensor) stay traced, one program for
every value.
"""

import collections
import warnings
from typing import Any, Callable, Optional

import jax

from jdist._src import errors

_NUMBER_TYPES = frozenset((bool, int, float, complex))  # Exactly: NumPy scalars are arrays.
RETRACE_WARNING_AT = 5  # Programs for distinct numbers before the warning (TF warns at 5).
KEPT = 64  # Programs kept per function for distinct numbers, the most recently used.

Call = tuple  # ``(args, kwargs)``.
Key = tuple  # The numbers taken out of a call: ``((leaf index, type, exact, value, path), ...)``.


def _is_none(x) -> bool:
    return x is None


def holds_numbers(types) -> bool:
    """Whether a call whose leaves have the set of ``types`` holds a Python number."""
    return not _NUMBER_TYPES.isdisjoint(types)


def _exact(value):
    """A key for ``value`` equal only to the same number: ``-0.0`` is not ``0.0``, NaN is NaN."""
    if type(value) is float:
        return value.hex()
    if type(value) is complex:
        return value.real.hex(), value.imag.hex()
    return value


def take_out(call: Call, is_static: Callable) -> tuple[Call, Optional[Key]]:
    """``(call, key)``: the call with its Python numbers (outside static arguments) as None,
    and the key `put_back` restores them from (None where it has none).

    Example:
      >>> call, key = take_out(((1.5, [2]), {}), lambda path: False)
      >>> call, [value for *_, value, path in key]
      (((None, [None]), {}), [1.5, 2])
    """
    leaves, tree = jax.tree_util.tree_flatten_with_path(call, is_leaf=_is_none)
    key = tuple((i, type(x), _exact(x), x, path) for i, (path, x) in enumerate(leaves)
                if type(x) in _NUMBER_TYPES and not is_static(path))
    if not key:
        return call, None
    taken = {entry[0] for entry in key}
    return jax.tree_util.tree_unflatten(
        tree, [None if i in taken else x for i, (_, x) in enumerate(leaves)]), key


def paths(key: Optional[Key]) -> frozenset:
    """The paths in the call of the numbers `take_out` took out (``key``'s)."""
    return frozenset(() if key is None else (entry[4] for entry in key))


def same_numbers(key: Optional[Key], other: Optional[Key]) -> bool:
    """Whether two calls' keys hold the same numbers in the same places."""
    return _exact_key(key) == _exact_key(other)


def _exact_key(key):
    return None if key is None else tuple(entry[:3] for entry in key)


def put_back(call: Call, key: Optional[Key]) -> Call:
    """The call `take_out` took ``key``'s numbers out of, with the numbers in their places."""
    if key is None:
        return call
    leaves, tree = jax.tree_util.tree_flatten(call, is_leaf=_is_none)
    for i, _, _, value, _ in key:
        leaves[i] = value
    return jax.tree_util.tree_unflatten(tree, leaves)


class ProgramsByNumbers:
    """One compiled function per set of Python numbers, the `KEPT` most recently used; warns
    once when a function has needed `RETRACE_WARNING_AT` of them, as TF warns of retracing."""

    def __init__(self, name: str, make: Callable[[Optional[Key]], Any]):
        self._name, self._make = name, make
        self._programs: collections.OrderedDict = collections.OrderedDict()
        self._made, self._warned = 0, False

    def get(self, key: Key):
        """The compiled function for ``key``'s numbers (``make(key)`` the first time)."""
        exact = _exact_key(key)
        program = self._programs.get(exact)
        if program is not None:
            self._programs.move_to_end(exact)
            return program
        program = self._programs[exact] = self._make(key)
        if len(self._programs) > KEPT:
            self._programs.popitem(last=False)
        self._made += 1
        if self._made >= RETRACE_WARNING_AT and not self._warned:
            self._warned = True
            warnings.warn(errors.RetracingWarning(
                f"jdist.function {self._name} has compiled {self._made} programs, one for "
                "each new value of its Python-number arguments: like tf.function, it computes "
                "with the numbers themselves (Python's float64 arithmetic), so each value is "
                "a new program. Pass a number that changes between calls as an array "
                "(jnp.float32(lr)), which every call shares one program for, as TF's "
                "tf.constant(lr) does."), stacklevel=5)
        return program
