"""What is compiled for each replica function, keyed weakly as ``jax.jit``'s cache.

Neither a function nor what its closure holds (a dataset iterator, a model) is kept alive. A
bound method, new at every attribute access (``strategy.run(self.train_step, ...)``), is keyed
on its owner (weakly) and its function, so every access finds the same `FnCache`.
"""

import functools
import inspect
import weakref


class FnCache:
    """Everything compiled for one replica function (the fields `spmd.ReplicatedRunner.run`
    reads): ``programs`` by signature (a program or an `uneven` plan), the ``direct`` program
    and its guard ``token``, the ``plans`` it calls by number, the ``placing`` of the last call
    made canonical, and whether calls missed the direct program (``direct_missed``,
    ``flatten_first``). ``fn`` (for a bound method, one holding its owner weakly) is held
    weakly when the cache is keyed weakly on it."""
    __slots__ = ("_fn", "programs", "direct", "token", "direct_missed", "flatten_first",
                 "plans", "placing", "__weakref__")

    def __init__(self, fn, weak):
        self._fn = weakref.ref(fn) if weak else (lambda: fn)
        self.programs, self.plans = {}, []
        self.direct = self.token = self.placing = None
        self.direct_missed = self.flatten_first = False

    def plan_number(self, program) -> int:
        """The number under which ``program`` is in `plans` (added if it is not)."""
        for i, known in enumerate(self.plans):
            if known is program:
                return i
        self.plans.append(program)
        return len(self.plans) - 1

    @property
    def fn(self):
        return self._fn()


class FunctionCaches:
    """The `FnCache` of each replica function one strategy runs."""

    def __init__(self):
        self._weak = weakref.WeakKeyDictionary()  # Function -> `FnCache`.
        self._by_owner = weakref.WeakKeyDictionary()  # Bound methods: owner -> {func: cache}.
        self._strong = {}  # For callables that cannot be weakly referenced.
        self._last = (_dead, None)  # The last function found (held weakly) and its cache.

    def get(self, fn):
        """The `FnCache` of ``fn`` (see the module doc)."""
        last_fn, last_cache = self._last
        if last_fn() is fn:  # A training loop runs one step function call after call.
            return last_cache
        cache = self._find(fn)
        if isinstance(cache._fn, weakref.ref):  # Not a bound method (new at every access).
            self._last = (weakref.ref(fn, self._forget_last), cache)
        return cache

    def _forget_last(self, ref):
        if self._last[0] is ref:
            self._last = (_dead, None)

    def _find(self, fn):
        if inspect.ismethod(fn):
            owner, func = fn.__self__, fn.__func__
            try:
                by_func = self._by_owner.setdefault(owner, {})
            except TypeError:
                pass  # An owner that cannot be weakly referenced: keyed on the method below.
            else:
                if func not in by_func:
                    by_func[func] = FnCache(_weak_method(owner, func), weak=False)
                return by_func[func]
        try:
            cache = self._weak.get(fn)
            if cache is None:
                cache = self._weak[fn] = FnCache(fn, weak=True)
        except TypeError:
            cache = self._strong.setdefault(fn, FnCache(fn, weak=False))
        return cache


def _weak_method(owner, func):
    """``func`` called with ``owner`` as its first argument, holding ``owner`` weakly."""
    ref = weakref.ref(owner)

    @functools.wraps(func)
    def method(*args, **kwargs):
        return func(ref(), *args, **kwargs)
    return method


def _dead():
    """A dead weak reference: `FunctionCaches._last` before any function."""
    return None
