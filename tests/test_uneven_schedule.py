"""An exact uneven step groups its independent all-reduces into one collective (uneven_schedule).

The order of the body's equations changes, its numbers do not: the structure is checked on
jaxprs, the numbers against NumPy computed replica by replica.
"""

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jdist
from jdist._src.uneven import schedule as uneven_schedule
from jdist._src.base import REPLICA_AXIS as AXIS
from jdist._src.uneven.trace import is_cut
from jdist.testing import assert_local_results, mirrored, per_replica


def body_jaxpr(body, *args, devices=1):
    """The jaxpr of ``body`` as a replica body over ``devices`` devices, and its mesh."""
    mesh = jax.sharding.Mesh(jax.devices()[:devices], (AXIS,))
    mapped = jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS),
                           check_vma=False)
    return jax.make_jaxpr(mapped)(*args).jaxpr.eqns[0].params["jaxpr"], mesh


def scheduled(body, *args):
    """The primitive names of ``body``'s jaxpr once scheduled, a group spelled as the list of
    its members' names."""
    inner, _ = body_jaxpr(body, *args)
    return [[m[0].name for m in e.params["members"]] if e.primitive is
            uneven_schedule.collectives_p else e.primitive.name
            for e in uneven_schedule.grouped_collectives(inner, is_cut).eqns]


ONE = jnp.ones(1)


@pytest.mark.parametrize("body,names", [
    (lambda a, b: (lax.psum(a * 2, AXIS), lax.psum(jnp.sin(b), AXIS)),
     ["mul", "sin", ["psum", "psum"]]),
    # A sum of a sum waits for it; the other sum joins the first round.
    (lambda a, b: (lax.psum(lax.psum(a, AXIS) * 2, AXIS), lax.psum(b, AXIS)),
     [["psum", "psum"], "mul", "psum"]),
    # Unlike collectives share a round, each its own cut.
    (lambda a, b: (lax.psum(a, AXIS), lax.pmax(b, AXIS), lax.psum(b, AXIS)),
     [["psum", "psum"], "pmax"]),
    # Another collective is a barrier: the sums on either side of it stay there.
    (lambda a, b: (lax.psum(a, AXIS), lax.all_gather(a, AXIS), lax.psum(b, AXIS)),
     ["psum", "all_gather", "psum"]),
    (lambda a, b: (lax.psum(lax.psum(a, AXIS), AXIS), lax.all_gather(b, AXIS), lax.psum(b, AXIS)),
     ["psum", "psum", "all_gather", "psum"]),
])
def test_independent_all_reduces_share_one_cut(body, names):
    assert scheduled(body, ONE, ONE) == names


def test_equations_with_effects_keep_their_order():
    def body(a, b):
        jax.debug.callback(print, lax.psum(a, AXIS))
        jax.debug.callback(print, b)  # Needs no sum, and still runs after the first callback.
        return lax.psum(b, AXIS)
    assert scheduled(body, ONE, ONE) == [["psum", "psum"], "debug_callback", "debug_callback"]


def evaluated(jaxpr, mesh, *args):
    """``jaxpr`` run over ``mesh`` equation by equation, a collective as the exact step binds
    it (`uneven_schedule.bind_cut`)."""
    def run(*values):
        env = dict(zip(jaxpr.invars, values))
        read = lambda v: v.val if hasattr(v, "val") else env[v]  # noqa: E731
        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            if is_cut(eqn):
                outs = uneven_schedule.bind_cut(eqn, ins)
            else:
                outs = eqn.primitive.bind(*ins, **eqn.params)
                outs = outs if eqn.primitive.multiple_results else [outs]
            env.update(zip(eqn.outvars, outs))
        return tuple(read(v) for v in jaxpr.outvars)
    return jax.jit(jax.shard_map(run, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS),
                                 check_vma=False))(*args)


OPS = {"sin": lambda u, v: jnp.sin(u), "add": lambda u, v: u + v, "twice": lambda u, v: u * 2,
       "psum": lambda u, v: lax.psum(u, AXIS), "pmax": lambda u, v: lax.pmax(u, AXIS),
       "pmin": lambda u, v: lax.pmin(v, AXIS), "gather": lambda u, v: lax.all_gather(u, AXIS)[0]}


@st.composite
def programs(draw):
    """A random body: each step applies an op to two of the values so far (two inputs first)."""
    return [(draw(st.sampled_from(sorted(OPS))), draw(st.integers(0, i + 1)),
             draw(st.integers(0, i + 1))) for i in range(draw(st.integers(1, 12)))]


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(programs())
def test_a_scheduled_body_computes_what_the_body_computes(ops):
    def body(x, y):
        values = [x, y]
        for op, a, b in ops:
            values.append(OPS[op](values[a], values[b]))
        return tuple(values[2:])
    rng = np.random.default_rng(len(ops))
    x, y = (rng.normal(size=(4, 3)).astype(np.float32) for _ in range(2))
    inner, mesh = body_jaxpr(body, x, y, devices=4)
    grouped = uneven_schedule.grouped_collectives(inner, is_cut)
    assert sum(map(is_cut, grouped.eqns)) <= sum(map(is_cut, inner.eqns))
    for got, want in zip(evaluated(grouped, mesh, x, y), evaluated(inner, mesh, x, y)):
        np.testing.assert_array_equal(got, want)


# ------------------------------------------------------------------- numbers, end to end
def step(x, w):
    """Independent sums, a sum of a sum, a mean and a zero-size sum in one exact step."""
    ctx = jdist.get_replica_context()
    total, rows, grads = ctx.all_reduce("sum", (jnp.sum(x, 0), jnp.float32(x.shape[0]),
                                                {"w": x.T @ jnp.ones(x.shape[0]) * w}))
    mean = ctx.all_reduce("mean", jnp.sum(x * w))
    twice = ctx.all_reduce("sum", total * rows)
    empty = ctx.all_reduce("sum", jnp.zeros((0,)))
    return total, rows, grads, mean, twice, empty


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_a_grouped_step_computes_each_replicas_numbers(n):
    s, rng = mirrored(n), np.random.default_rng(n)
    comps = [rng.normal(size=(i % 3 + (i == 0), 2)).astype(np.float32) for i in range(n)]
    outs = s.run(step, args=(per_replica(s, comps), np.float32(0.5)))
    total = sum(c.sum(0) for c in comps)
    rows = float(sum(len(c) for c in comps))
    expected = (total, rows, {"w": sum(c.T @ np.ones(len(c)) * 0.5 for c in comps)},
                np.mean([np.sum(c * 0.5) for c in comps]), total * rows * n, np.zeros((0,)))
    leaves = jax.tree_util.tree_leaves(outs, is_leaf=lambda v: isinstance(v, jdist.DistributedValues))
    for out, want in zip(leaves, jax.tree_util.tree_leaves(expected)):
        assert_local_results(s, out, [np.asarray(want, np.float32)] * n, rtol=1e-5)


@pytest.mark.parametrize("n", [2, 3, 8])
def test_replicas_whose_sums_depend_differently_are_not_grouped(n):
    """Python code branching on a shape: a one-row replica's second sum needs the first, the
    others' do not; grouping would give the replicas different collectives."""
    s = mirrored(n)
    comps = [np.arange(1 + i % 2, dtype=np.float32) + i for i in range(n)]

    def step(x):
        ctx = jdist.get_replica_context()
        first = ctx.all_reduce("sum", jnp.sum(x))
        local = jnp.sum(x * 2) + (first * 0 if x.shape[0] == 1 else 0)
        return first, ctx.all_reduce("sum", local)
    first, second = s.run(step, args=(per_replica(s, comps),))
    total = float(sum(c.sum() for c in comps))
    assert_local_results(s, first, [total] * n)
    assert_local_results(s, second, [2 * total] * n)
