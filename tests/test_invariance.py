"""`invariance.same_outputs` alone: which outputs of a replica body are equal on every replica.

Every Mirrored/PerReplica decision of ``strategy.run`` rests on this analysis, so each rule is
checked on a small jaxpr: traced with an axis environment (the replica axis of size 2), or as the
body of a ``shard_map(check_vma=False)``, as ``strategy.run`` compiles it. An input is *same*
when it is replicated; the answer may err towards *differ*, never towards *same*.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jdist._src import invariance
from jdist._src.base import REPLICA_AXIS as AXIS
from jdist._src.uneven.merge import merge_p

SAME, DIFFER = True, False


def same(fn, *inputs_same):
    """``same_outputs`` of ``fn`` traced over the replica axis; ``inputs_same`` per argument
    (each argument is a float32 scalar)."""
    closed = jax.make_jaxpr(fn, axis_env=[(AXIS, 2)])(*[jnp.float32(1)] * len(inputs_same))
    return invariance.same_outputs(closed.jaxpr, list(inputs_same))


# ----------------------------------------------------------------------- plain dataflow
def test_inputs_constants_and_their_combinations():
    assert same(lambda x, y: (x, y, x * y, y + 1.0, jnp.float32(3)), DIFFER, SAME) == [
        DIFFER, SAME, DIFFER, SAME, SAME]


def test_same_collectives_give_same_results():
    def body(x):
        return (lax.psum(x, AXIS), lax.pmean(x, AXIS), lax.pmax(x, AXIS), lax.pmin(x, AXIS),
                lax.all_gather(x, AXIS), lax.psum(x, AXIS) * x)
    assert same(body, DIFFER) == [SAME] * 5 + [DIFFER]


def test_axis_index_and_permutations_differ():
    def body(x):
        perm = [(0, 1), (1, 0)]
        return lax.axis_index(AXIS), lax.ppermute(x, AXIS, perm), x + lax.axis_index(AXIS)
    assert same(body, SAME) == [DIFFER] * 3


def test_shard_map_body_as_strategy_run_builds_it():
    mesh = Mesh(np.array(jax.devices()[:2]), (AXIS,))

    def body(x, w):
        grad = x * w
        return lax.pmean(grad, AXIS), grad, w - lax.pmean(grad, AXIS)
    mapped = jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS), P()), out_specs=P(),
                           check_vma=False)
    (eqn,) = jax.make_jaxpr(mapped)(jnp.ones((2, 3)), jnp.ones(3)).jaxpr.eqns
    replicated = [all(a is None for a in spec) for spec in eqn.params["in_specs"]]
    assert replicated == [False, True]
    assert invariance.same_outputs(eqn.params["jaxpr"], replicated) == [SAME, DIFFER, SAME]


# ------------------------------------------------------------------ loops: carry fixpoints
def test_scan_carry_that_stays_same():
    def body(c, w):
        return lax.scan(lambda c, _: (c * w + 1.0, c), c, None, length=3)
    assert same(body, SAME, SAME) == [SAME, SAME]


def test_scan_carry_that_takes_a_per_replica_value():
    def body(c, x):
        return lax.scan(lambda c, _: (c + x, c * 2.0), c, None, length=3)
    assert same(body, SAME, DIFFER) == [DIFFER, DIFFER]  # The ys read the carry too.


def test_scan_fixpoint_needs_more_than_one_pass():
    # a <- b <- c <- x: each pass over the body finds one more carry that differs.
    def body(a, b, c, x):
        step = lambda abc, _: ((abc[1], abc[2], x), abc[0])
        (a, b, c), ys = lax.scan(step, (a, b, c), None, length=4)
        return a, b, c, ys
    assert same(body, SAME, SAME, SAME, DIFFER) == [DIFFER] * 4
    assert same(body, SAME, SAME, SAME, SAME) == [SAME] * 4


def test_scan_xs_and_all_reduced_carry():
    def body(c, xs):
        return lax.scan(lambda c, x: (lax.psum(c + x, AXIS), x * 2.0), c, xs)
    closed = jax.make_jaxpr(body, axis_env=[(AXIS, 2)])(jnp.float32(0), jnp.ones(3))
    assert invariance.same_outputs(closed.jaxpr, [SAME, DIFFER]) == [SAME, DIFFER]
    assert invariance.same_outputs(closed.jaxpr, [SAME, SAME]) == [SAME, SAME]
    # A carry that starts per-replica stays so: the analysis does not count iterations.
    assert invariance.same_outputs(closed.jaxpr, [DIFFER, SAME]) == [DIFFER, SAME]


def test_while_carry_fixpoint():
    def body(a, b, x):
        def step(c):
            i, a, b = c
            return i + 1, b, x  # b takes x; a takes b one pass later.
        return lax.while_loop(lambda c: c[0] < 3, step, (0, a, b))
    assert same(body, SAME, SAME, DIFFER) == [SAME, DIFFER, DIFFER]
    assert same(body, SAME, SAME, SAME) == [SAME, SAME, SAME]


def test_while_whose_predicate_differs_makes_every_carry_differ():
    def body(limit, w):
        return lax.while_loop(lambda c: c[0] < limit, lambda c: (c[0] + 1.0, c[1] * 2.0),
                              (0.0, w))
    # Replicas may run different numbers of iterations: even the carry built from w differs.
    assert same(body, DIFFER, SAME) == [DIFFER, DIFFER]
    assert same(body, SAME, SAME) == [SAME, SAME]


def test_while_predicate_on_a_carry_that_becomes_per_replica():
    def body(x):
        return lax.while_loop(lambda c: c[1] < 10.0, lambda c: (c[0] + 1.0, c[1] + x),
                              (0.0, 0.0))
    assert same(body, DIFFER) == [DIFFER, DIFFER]


# -------------------------------------------------------------------------------- cond
def test_cond_on_a_same_index():
    def body(p, x, w):
        return lax.cond(p > 0, lambda x, w: (w, x), lambda x, w: (w * 2.0, x), x, w)
    assert same(body, SAME, DIFFER, SAME) == [SAME, DIFFER]


def test_cond_on_a_varying_index_differs_even_with_constant_branches():
    def body(w):
        index = lax.axis_index(AXIS)
        return lax.cond(index > 0, lambda w: w, lambda w: w + 1.0, w)
    assert same(body, SAME) == [DIFFER]


def test_switch_takes_every_branch_into_account():
    def body(w, x):
        branches = [lambda w, x: w, lambda w, x: w * 2.0, lambda w, x: x]
        return lax.switch(jnp.int32(1), branches, w, x)
    assert same(body, SAME, DIFFER) == [DIFFER]
    assert same(body, SAME, SAME) == [SAME]


# ------------------------------------------------------------------- call-like primitives
def test_jit_and_checkpoint_bodies_are_followed():
    def body(x, w):
        return (jax.jit(lambda u: u + 1.0)(w), jax.jit(lambda u, v: u * v)(x, w),
                jax.checkpoint(lambda u: lax.psum(u, AXIS))(x), jax.checkpoint(jnp.sin)(x))
    assert same(body, DIFFER, SAME) == [SAME, DIFFER, SAME, DIFFER]


def test_custom_jvp_and_custom_vjp_bodies_are_followed():
    @jax.custom_jvp
    def triple(z):
        return z * 3.0
    triple.defjvp(lambda primals, tangents: (primals[0] * 3.0, tangents[0] * 3.0))

    @jax.custom_vjp
    def double(z):
        return z * 2.0
    double.defvjp(lambda z: (z * 2.0, None), lambda _, g: (g * 2.0,))

    def body(x, w):
        return triple(w), triple(x), double(w), double(x), jax.nn.relu(w)
    assert same(body, DIFFER, SAME) == [SAME, DIFFER, SAME, DIFFER, SAME]


def test_gradient_of_a_replicated_parameter_is_per_replica():
    # check_vma=False, as TF: each replica differentiates its own copy of w.
    def body(x, w):
        loss = lambda w: jnp.sum((x * w) ** 2)
        grad = jax.grad(loss)(w)
        return grad, lax.pmean(grad, AXIS)
    assert same(body, DIFFER, SAME) == [DIFFER, SAME]


def test_unknown_sub_programs_are_assumed_to_differ():
    def body(w):
        return lax.custom_linear_solve(lambda v: v, w, lambda matvec, b: b)
    assert same(body, SAME) == [DIFFER]


# ------------------------------------------------------------------------- jdist_merge
def test_merge_primitive_reports_its_out_same_param():
    aval = jax.core.ShapedArray((), jnp.float32)

    def body(x, w, out_same):
        return merge_p.bind(x, w, index=0, out_avals=(aval,) * 3, out_same=out_same,
                            gathers=False, merge_body=None)
    for out_same in ((True, False, True), (False, False, False)):
        got = same(lambda x, w: body(x, w, out_same), DIFFER, SAME)
        assert got == list(out_same)


class _FlatTree:
    """Stands in for jax 0.11's ``FTTuple`` (its groups' ``unpack``, their ``vals``)."""

    def __init__(self, *groups):
        self.groups, self.vals = groups, [v for g in groups for v in getattr(g, "vals", [g])]

    def unpack(self):
        return self.groups


@pytest.mark.parametrize("params,counts", [
    ({"num_consts": 1, "num_carry": 2}, (1, 2)),  # jax 0.10
    ({"ft_in": _FlatTree(_FlatTree(None), _FlatTree(None, None), _FlatTree())}, (1, 2)),
    ({"ft_in": _FlatTree(_FlatTree(), _FlatTree(None), _FlatTree(None, None))}, (0, 1)),
])
def test_scan_counts_reads_both_jax_releases_parameters(params, counts):
    assert invariance.scan_counts(params) == counts
