"""SEMANTICS.md, Contexts: which strategy is current and which context code runs in."""

import jax.numpy as jnp
import numpy as np
import pytest

import jdist
from jdist import errors
from jdist.testing import mirrored


def test_no_strategy_gives_the_default_one_replica_strategy():
    s = jdist.get_strategy()
    assert s.num_replicas_in_sync == 1
    assert not jdist.has_strategy()
    assert not jdist.in_cross_replica_context()
    ctx = jdist.get_replica_context()
    assert (ctx.num_replicas_in_sync, ctx.replica_id_in_sync_group) == (1, 0)
    assert ctx.strategy is s


def test_default_strategy_run_just_calls_fn():
    calls = []
    out = jdist.get_strategy().run(lambda x: calls.append(x) or x + 1, args=(1,))
    assert out == 2 and calls == [1]


def test_default_replica_context_all_reduce_is_identity():
    ctx = jdist.get_replica_context()
    assert float(ctx.all_reduce("sum", 3.0)) == 3.0
    assert float(ctx.all_reduce(jdist.ReduceOp.MEAN, jnp.int32(3))) == 3.0


def test_default_merge_call_runs_merge_fn_in_cross_replica_context():
    def merge_fn(strategy, x, y=0):
        assert jdist.in_cross_replica_context()
        assert jdist.get_replica_context() is None
        return x + y
    assert jdist.get_replica_context().merge_call(merge_fn, args=(2,), kwargs={"y": 3}) == 5


@pytest.mark.parametrize("n", [1, 2, 8])
def test_scope_is_cross_replica_context(n):
    s = mirrored(n)
    with s.scope():
        assert jdist.get_strategy() is s
        assert jdist.get_replica_context() is None
        assert jdist.in_cross_replica_context()
        assert jdist.has_strategy()
        with s.scope():  # Re-entering the same scope is fine.
            assert jdist.get_strategy() is s
    assert not jdist.has_strategy()


def test_entering_another_strategys_scope_raises():
    with mirrored(2).scope():
        with pytest.raises(RuntimeError, match="Mixing different"):
            with mirrored(4).scope():
                pass
        with pytest.raises(errors.MixedStrategyError):
            with mirrored(4).scope():
                pass


def test_experimental_set_strategy_sets_and_resets_globally():
    s = mirrored(2)
    jdist.experimental_set_strategy(s)
    assert jdist.get_strategy() is s and jdist.in_cross_replica_context()
    jdist.experimental_set_strategy(None)
    assert not jdist.has_strategy()


@pytest.mark.parametrize("n1, n2", [(2, 3), (1, 2)])
def test_run_of_another_strategy_than_the_global_one_raises(n1, n2):
    s1, s2 = mirrored(n1), mirrored(n2)
    jdist.experimental_set_strategy(s1)
    try:
        with pytest.raises(errors.MixedStrategyError, match="Mixing different"):
            s2.run(lambda: jnp.ones(()))
        assert float(s1.run(lambda: jnp.ones(()) * 2)) == 2.0
    finally:
        jdist.experimental_set_strategy(None)
    assert float(s2.run(lambda: jnp.ones(()) * 3)) == 3.0


def test_experimental_set_strategy_inside_a_scope_raises():
    with mirrored(2).scope():
        with pytest.raises(RuntimeError, match="inside a `strategy.scope"):
            jdist.experimental_set_strategy(mirrored(2))


@pytest.mark.parametrize("n", [1, 2, 3])
def test_inside_run_is_replica_context(n):
    s = mirrored(n)
    seen = {}

    def fn():
        ctx = jdist.get_replica_context()
        seen.update(ctx=ctx, strategy=jdist.get_strategy(), cross=jdist.in_cross_replica_context(),
                    n=ctx.num_replicas_in_sync)
        return ctx.replica_id_in_sync_group
    out = s.run(fn)
    assert seen["strategy"] is s and seen["ctx"].strategy is s
    assert not seen["cross"] and seen["n"] == n
    assert [int(x) for x in s.experimental_local_results(out)] == list(range(n))


@pytest.mark.parametrize("call", ["reduce", "gather", "reduce_to", "run"])
def test_cross_replica_calls_inside_run_raise_with_pointer(call):
    s = mirrored(2)
    v = s.run(lambda: jdist.get_replica_context().replica_id_in_sync_group)
    calls = {
        "reduce": (lambda: s.reduce("sum", v, axis=None), "merge_call"),
        "gather": (lambda: s.gather(v, axis=0), "all_gather"),
        "reduce_to": (lambda: s.extended.reduce_to("sum", v, "cpu:0"), "merge_call"),
        "run": (lambda: s.run(lambda: 1.0), "merge_call"),
    }
    body, pointer = calls[call]

    def fn():
        body()
        return 0.0
    with pytest.raises(RuntimeError, match=pointer):
        s.run(fn)


def test_replica_context_used_after_its_run_raises():
    s = mirrored(2)
    kept = []
    s.run(lambda: kept.append(jdist.get_replica_context()) or 0.0)
    with pytest.raises(RuntimeError, match="after its strategy.run returned"):
        kept[0].all_reduce("sum", 1.0)
    with pytest.raises(errors.WrongContextError):
        kept[0].merge_call(lambda s: 0)


def test_replica_context_as_context_manager():
    s = mirrored(1)
    with jdist.ReplicaContext(s, 0) as ctx:
        assert jdist.get_replica_context() is ctx
        assert jdist.get_strategy() is s
        assert not jdist.in_cross_replica_context()
    assert jdist.get_replica_context().strategy is jdist.get_strategy()


def test_scope_inside_replica_function_raises():
    s = mirrored(2)

    def fn():
        with s.scope():
            pass
        return 0.0
    with pytest.raises(errors.WrongContextError, match="merge_call"):
        s.run(fn)


# ------------------------------------------------ issue 9: default scope, mixing strategies
def test_default_strategy_scope_keeps_the_default_replica_context():
    # TF: the default strategy's scope is no cross-replica context; its replica context stays.
    default, ctx = jdist.get_strategy(), jdist.get_replica_context()
    with default.scope():
        assert not jdist.in_cross_replica_context()
        assert jdist.get_replica_context() is ctx
        assert jdist.get_strategy() is default and not jdist.has_strategy()
        assert float(ctx.all_reduce("sum", 2.0)) == 2.0
        assert ctx.merge_call(lambda strategy, x: x + 1, args=(1,)) == 2
    assert jdist.get_replica_context() is ctx


@pytest.mark.parametrize("n", [1, 2, 8])
def test_default_scope_inside_another_scope_raises(n):
    # TF: "Must not nest tf.distribute.Strategy scopes".
    default = jdist.get_strategy()
    with mirrored(n).scope():
        with pytest.raises(errors.MixedStrategyError, match="Must not nest"):
            with default.scope():
                pass


DEFAULT_CONTEXT_CALLS = {
    "merge_call": lambda ctx: ctx.merge_call(lambda strategy: 1),
    "all_reduce": lambda ctx: ctx.all_reduce("sum", jnp.float32(1)),
    "all_gather": lambda ctx: ctx.all_gather(jnp.ones(2), axis=0),
}


@pytest.mark.parametrize("n", [1, 2, 8])
@pytest.mark.parametrize("call", sorted(DEFAULT_CONTEXT_CALLS))
def test_default_replica_context_used_in_another_strategys_scope_raises(n, call):
    # TF: a ReplicaContext works only where it is the current one (require_replica_context).
    ctx = jdist.get_replica_context()  # Outside any scope: the default replica context.
    DEFAULT_CONTEXT_CALLS[call](ctx)  # Fine here.
    with mirrored(n).scope():
        with pytest.raises(RuntimeError, match="cross-replica context"):
            DEFAULT_CONTEXT_CALLS[call](ctx)


@pytest.mark.parametrize("call", sorted(DEFAULT_CONTEXT_CALLS))
def test_default_replica_context_used_in_another_strategys_replica_function_raises(call):
    ctx = jdist.get_replica_context()

    def fn():
        DEFAULT_CONTEXT_CALLS[call](ctx)
        return jnp.float32(0)
    with pytest.raises(errors.MixedStrategyError, match="Mixing different"):
        mirrored(2).run(fn)


MIXED_CALLS = {
    "run": lambda s, v: s.run(lambda x: x, args=(v,)),
    "reduce": lambda s, v: s.reduce("sum", v, axis=None),
    "gather": lambda s, v: s.gather(v, axis=0),
    "experimental_distribute_dataset": lambda s, v: s.experimental_distribute_dataset(
        [np.zeros((4, 2))]),
    "distribute_datasets_from_function": lambda s, v: s.distribute_datasets_from_function(
        lambda ctx: [np.zeros((2, 2))]),
    "extended.reduce_to": lambda s, v: s.extended.reduce_to("sum", v, "cpu:0"),
    "extended.batch_reduce_to": lambda s, v: s.extended.batch_reduce_to("sum", [(v, "cpu:0")]),
    "extended.broadcast_to": lambda s, v: s.extended.broadcast_to(jnp.ones(2), "cpu:0"),
}


@pytest.mark.parametrize("n1, n2", [(2, 4), (4, 2), (8, 3), (1, 2), (2, 1)])
@pytest.mark.parametrize("call", sorted(MIXED_CALLS))
def test_mixing_strategies_raises(n1, n2, call):
    # TF: "Mixing different tf.distribute.Strategy objects" (RuntimeError).
    s1, s2 = mirrored(n1), mirrored(n2)
    v = s2.experimental_distribute_values_from_function(
        lambda ctx: np.ones((2, 2), np.float32) * ctx.replica_id_in_sync_group)
    with s1.scope():
        with pytest.raises(errors.MixedStrategyError, match="Mixing different"):
            MIXED_CALLS[call](s2, v)
    MIXED_CALLS[call](s2, v)  # Outside s1's scope the same call works.
    with s2.scope():
        MIXED_CALLS[call](s2, v)  # So does it in s2's own scope.


@pytest.mark.parametrize("n", [1, 2, 3])
def test_default_strategy_methods_inside_another_scope_raise(n):
    default = jdist.get_strategy()
    with mirrored(n).scope():
        with pytest.raises(errors.MixedStrategyError):
            default.reduce("mean", np.float32(1), axis=None)
        with pytest.raises(errors.MixedStrategyError):
            default.run(lambda: 1.0)


@pytest.mark.parametrize("n", [2, 3, 8])
def test_replica_id_of_a_context_kept_after_run_raises(n):
    # TF: a tensor of a finished function cannot be used; jdist raises the same clean error as
    # all_reduce instead of handing out the step's leaked tracer.
    kept = []
    mirrored(n).run(lambda: kept.append(jdist.get_replica_context()) or jnp.float32(0))
    with pytest.raises(errors.WrongContextError, match="after its strategy.run returned"):
        kept[0].replica_id_in_sync_group
