"""State that crosses into plain JAX: unwrap_mirrored, mirror, to_host, replica_key."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jdist
from jdist import errors
from jdist.testing import mirrored
from jdist.testing import per_replica

COUNTS = (1, 2, 4, 8)
OPTIMIZER = optax.sgd(0.1, momentum=0.9)


def host_params():
    rng = np.random.default_rng(0)
    return {"w": rng.normal(size=(3, 2)).astype(np.float32), "b": np.arange(2, dtype=np.float32)}


def step(params, opt_state, x):
    """Every replica computes the same update (x is replicated), so the state stays Mirrored."""
    grads = jax.grad(lambda p: jnp.sum((x @ p["w"] + p["b"]) ** 2))(params)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def reference_steps(params, num_steps, x):
    opt_state = OPTIMIZER.init(params)
    for _ in range(num_steps):
        params, opt_state = jax.jit(step)(params, opt_state, x)
    return params, opt_state


def run_state(strategy):
    params = host_params()
    return strategy.run(step, args=(params, OPTIMIZER.init(params), jnp.ones((4, 3))))


def assert_tree_equal(got, want):
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("n", COUNTS)
def test_unwrap_mirrored_gives_replicated_arrays(n):
    strategy = mirrored(n)
    state = run_state(strategy)
    plain = jdist.unwrap_mirrored(state)
    for leaf in jax.tree_util.tree_leaves(plain):
        assert isinstance(leaf, jax.Array) and not isinstance(leaf, jdist.DistributedValues)
        assert leaf.sharding.is_fully_replicated and len(leaf.sharding.device_set) == n
    assert_tree_equal(plain, reference_steps(host_params(), 1, jnp.ones((4, 3))))


@pytest.mark.parametrize("n", COUNTS)
def test_device_get_and_to_host_give_numpy(n):
    state = run_state(mirrored(n))
    want = reference_steps(host_params(), 1, jnp.ones((4, 3)))
    for host in (jax.device_get(jdist.unwrap_mirrored(state)), jdist.to_host(state)):
        assert all(isinstance(x, np.ndarray) for x in jax.tree_util.tree_leaves(host))
        assert_tree_equal(host, want)


@pytest.mark.parametrize("n", (2, 8))
def test_flax_serialization_round_trip(n):
    serialization = pytest.importorskip("flax.serialization")
    strategy = mirrored(n)
    params, _ = run_state(strategy)
    data = serialization.to_bytes(jdist.unwrap_mirrored(params))
    restored = jdist.mirror(serialization.from_bytes(host_params(), data), strategy)
    assert_tree_equal(jdist.to_host(restored), jdist.to_host(params))
    assert isinstance(restored["w"], jdist.Mirrored) and restored["w"].num_replicas == n


@pytest.mark.parametrize("n", COUNTS)
def test_mirror_places_one_replicated_array_per_leaf(n):
    strategy = mirrored(n)
    state = jdist.mirror(host_params(), strategy)
    for leaf, want in zip(jax.tree_util.tree_leaves(state, is_leaf=jdist.Mirrored.__instancecheck__),
                          jax.tree_util.tree_leaves(host_params())):
        assert isinstance(leaf, jdist.Mirrored) and leaf.num_replicas == n
        assert leaf.value.shape == want.shape  # No stacked replica axis.
        assert leaf.value.sharding.spec == P() and leaf.value.sharding.mesh == strategy.extended.mesh
        np.testing.assert_array_equal(np.asarray(leaf.value), want)
    again = jdist.mirror(state, strategy)  # Already placed: the same buffers, not copies.
    assert again["w"].value is state["w"].value
    assert_tree_equal(jdist.mirror(jdist.unwrap_mirrored(state), strategy), state)


def test_mirror_uses_the_current_strategy():
    strategy = mirrored(4)
    with strategy.scope():
        state = jdist.mirror({"w": np.zeros(2, np.float32)})
    assert state["w"].num_replicas == 4


@pytest.mark.parametrize("fn", (jdist.unwrap_mirrored, jdist.to_host,
                                lambda t: jdist.mirror(t, mirrored(2))))
def test_per_replica_leaves_are_rejected(fn):
    value = per_replica(mirrored(2), [np.float32(1), np.float32(2)])
    with pytest.raises(errors.UnsupportedValueError, match="PerReplica"):
        fn({"a": np.ones(2, np.float32), "b": value})


def test_to_host_rejects_sharded_arrays():
    stacked = per_replica(mirrored(2), [np.ones(2, np.float32), np.zeros(2, np.float32)]).stacked
    with pytest.raises(errors.UnsupportedValueError, match="replicated"):
        jdist.to_host(stacked)


@pytest.mark.parametrize("n", (2, 8))
@pytest.mark.parametrize("carry_as", ("mirrored", "plain"))
def test_scan_carry_over_run(n, carry_as):
    strategy = mirrored(n)
    x = jnp.ones((4, 3))
    convert = (lambda t: jdist.mirror(t, strategy)) if carry_as == "mirrored" else (
        jdist.unwrap_mirrored)

    def body(carry, _):
        return convert(strategy.run(step, args=(*carry, x))), None

    params = host_params()
    carry = convert((params, OPTIMIZER.init(params)))
    # jdist.function: a scan over run is a program with collectives, launched through the guard.
    final, _ = jdist.function(lambda c: lax.scan(body, c, None, length=3))(carry)
    want = reference_steps(params, 3, x)
    np.testing.assert_allclose(jdist.to_host(final)[0]["w"], want[0]["w"], rtol=1e-6)


@pytest.mark.parametrize("n", COUNTS)
def test_replica_keys_differ_and_repeat(n):
    strategy = mirrored(n)

    def draw(key):
        return jax.random.uniform(jdist.replica_key(key), (3,)), jax.random.uniform(key, (3,))

    key = jax.random.key(7)
    per_replica_draws, shared = strategy.run(draw, args=(key,))
    got = np.stack([np.asarray(v) for v in strategy.experimental_local_results(per_replica_draws)])
    want = np.stack([jax.random.uniform(jax.random.fold_in(key, i), (3,)) for i in range(n)])
    np.testing.assert_array_equal(got, want)
    assert len({row.tobytes() for row in got}) == n  # Different on every replica.
    again, _ = strategy.run(draw, args=(key,))  # Reproducible from the key.
    assert_tree_equal(strategy.experimental_local_results(again), tuple(got))
    assert isinstance(shared, jdist.Mirrored) or n == 1  # The key itself: identical on all.
    np.testing.assert_array_equal(np.asarray(shared), jax.random.uniform(key, (3,)))


def test_replica_key_needs_a_replica_context():
    with mirrored(2).scope(), pytest.raises(errors.WrongContextError, match="strategy.run"):
        jdist.replica_key(jax.random.key(0))
