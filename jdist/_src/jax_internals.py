"""Every use jdist makes of JAX's internals (``jax._src``): no other module imports them.

JAX promises nothing about ``jax._src``; `jax_version` admits only the releases these are tested
on (CI runs the suite on each). Each access below is here because no public API serves, and
says what breaks if JAX changes it:

- `batched_block_until_ready` (``jax._src.lib.xla_client``): what ``jax.block_until_ready``
  calls underneath, one C++ call. The CPU dispatch guard (`dispatch`) waits for the previous
  program on every step: 6.7 us for 8 arrays, against 13.6 for the public call's tree walk. If
  it goes, every guarded launch raises AttributeError (tests/test_dispatch.py).
- `batched_device_put` (``jax._src.lib.xla_client``): the batched placement ``jax.device_put``
  calls underneath, under 10 us an array against 36-75 for the public call (`host_values`).
  A changed signature fails every input pipeline step that places host arrays
  (tests/test_input_*.py).
- `shard_map_p` and `unshard_aval` (``jax._src.shard_map``): `staged_outputs` edits a traced
  ``shard_map`` equation's ``out_specs`` and must recompute its output types; the primitive is
  not among ``jax.extend.core.primitives``. If they change, `staged_outputs.unblock_replicated`
  fails (tests/test_staged_outputs.py); a primitive that no longer matches only makes it fall
  back to a second ``shard_map`` (slower, same numbers).
- `TRACE_STATE` and `JIT_DISABLED` (``jax._src.core``, ``jax._src.config``): the current
  trace (what ``jax.extend.core.find_top_trace(())`` returns, read without its three Python
  calls) and the ``jax_disable_jit`` flag (its ``.value`` read in C++, where
  ``jax.config.jax_disable_jit`` is a Python property). ``strategy.run`` asks both on every
  call: the public spellings cost it four Python calls, 1-2 us of a 30-40 us call here. If they
  move, ``import jdist`` fails with AttributeError (every test).
- `distributed_client` (``jax._src.distributed.global_state.client``): the coordination
  service's key-value store that ``jax.distributed.initialize`` starts, which multi-worker
  agreement exchanges its payloads through; JAX has no public handle on it. If it moves,
  MultiWorkerMirroredStrategy fails at creation (tests/test_multi_worker.py).
"""

from jax._src import config as _config
from jax._src import core as _core
from jax._src import distributed as _distributed
from jax._src import shard_map as _shard_map
from jax._src.lib import xla_client as _xla_client

batched_block_until_ready = _xla_client.batched_block_until_ready
batched_device_put = _xla_client.batched_device_put
shard_map_p = _shard_map.shard_map_p
unshard_aval = _shard_map.unshard_aval
TRACE_STATE = _core.trace_state_strong_ref  # ``.value``: the current trace.
JIT_DISABLED = _config.disable_jit  # ``.value``: whether ``jax.disable_jit`` is on.


def distributed_client():
    """The key-value store client of this process's ``jax.distributed`` (None before it starts)."""
    return _distributed.global_state.client
