"""Editing a traced replica program so its replicated outputs leave unblocked (no retrace)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend import core
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jdist._src.run.staged_outputs import unblock_replicated


def staged(n, body, *args):
    mesh = Mesh(np.array(jax.devices()[:n]), ("r",))
    mapped = jax.shard_map(lambda *a: [x[None] for x in body(*a)], mesh=mesh,
                           in_specs=(P(), P("r")), out_specs=P("r"), check_vma=False)
    return jax.make_jaxpr(jax.jit(mapped))(*args)


def body(w, x):  # Outputs: a replicated sum, a per-replica product, a replicated scalar.
    total = lax.psum(x[0], "r")
    return [w + total, x[0] * 2, jnp.sum(total)]


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_replicated_outputs_leave_as_the_value_and_the_rest_stacked(n):
    w = jnp.arange(3.0)
    x = jnp.arange(3.0 * n).reshape(n, 3)
    edited = unblock_replicated(staged(n, body, w, x), [True, n == 1, True])
    core.check_jaxpr(edited.jaxpr)
    out = core.jaxpr_as_fun(edited)(w, x)
    total = np.asarray(x).sum(0)
    np.testing.assert_allclose(out[0], np.asarray(w) + total)
    expected = np.asarray(x)[0] * 2 if n == 1 else np.asarray(x) * 2
    np.testing.assert_allclose(out[1], expected)
    np.testing.assert_allclose(out[2], total.sum())
    assert out[0].sharding.is_fully_replicated and out[2].shape == ()


def test_an_output_not_made_by_the_blocking_broadcast_is_left_to_the_caller():
    mesh = Mesh(np.array(jax.devices()[:2]), ("r",))
    mapped = jax.shard_map(lambda x: x * 2, mesh=mesh, in_specs=P("r"), out_specs=P("r"),
                           check_vma=False)
    assert unblock_replicated(jax.make_jaxpr(jax.jit(mapped))(jnp.ones((2, 3))), [True]) is None


@pytest.mark.parametrize("edited", [True, False], ids=["edited", "second_shard_map"])
def test_the_program_gives_the_same_values_with_or_without_the_edit(edited, monkeypatch):
    from jdist._src.run import staged_outputs
    if not edited:  # The fallback a form the edit does not know takes.
        monkeypatch.setattr(staged_outputs, "unblock_replicated", lambda *args: None)
    n, w, x = 4, jnp.arange(3.0), jnp.arange(12.0).reshape(4, 3)
    mesh = Mesh(np.array(jax.devices()[:n]), ("r",))
    program = staged_outputs.staged_program(staged(n, body, w, x), [True, False, True], mesh, "r")
    out = program(w, x)
    np.testing.assert_allclose(out[0], np.asarray(w) + np.asarray(x).sum(0))
    np.testing.assert_allclose(out[1], np.asarray(x) * 2)
    np.testing.assert_allclose(out[2], np.asarray(x).sum())
