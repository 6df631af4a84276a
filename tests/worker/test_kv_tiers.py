"""KVTierCopier's device side on its own: the gather and the scatter over every layer are exact
inverses for f32, bf16 (the native in-place write on CPU) and int8 pools (pages and scales),
padding entries change nothing, and the host block spec follows the pool."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.models.kv_cache import PagedKVCache, init_kv_cache
from pagedjax.pallas_kernels.paged_attention import cpu_native
from pagedjax.worker.kv_tiers import (block_spec, gather_blocks, padded, pool_leaves, scatter_blocks,
                                      scatter_blocks_native)

L, NB, BS, HKV, D = 3, 10, 4, 2, 8


def _random_pool(dtype, seed=0):
    kv = init_kv_cache(PagedKVCache(NB, BS), L, HKV, D, dtype)
    rng = np.random.default_rng(seed)
    leaves = [jnp.asarray(rng.integers(-100, 100, x.shape).astype(np.float32)).astype(x.dtype)
              for x in jax.tree.leaves(kv)]
    return jax.tree.unflatten(jax.tree.structure(kv), leaves)


def test_padded():
    assert [padded(n) for n in (0, 1, 2, 3, 4, 5, 9, 16, 17)] == [1, 1, 2, 4, 4, 8, 16, 16, 32]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, "int8"])
def test_gather_scatter_roundtrip(dtype):
    kv = _random_pool(dtype)
    names, leaves = pool_leaves(kv)
    assert names == (["k", "v"] if dtype != "int8" else ["k", "k_scales", "v", "v_scales"])
    spec = block_spec(kv, L)
    assert spec["k"][0] == (HKV, L, BS, D) and (dtype != "int8" or spec["k_scales"][0] == (HKV, L, BS))
    src = np.array([7, 2, 9, 0], np.int32)
    got = [np.asarray(x) for x in gather_blocks(leaves, jnp.asarray(src), L)]
    for x, g in zip(leaves, got):  # block b of layer l is row l * NB + b
        assert g.shape == (4, x.shape[0], L, *x.shape[2:])
        np.testing.assert_array_equal(g[1, :, 2], np.asarray(x)[:, 2 * NB + 2])
    # into other blocks, two padding entries (NB: dropped)
    dst = np.array([1, 3, 4, 8, NB, NB], np.int32)
    values = [np.concatenate([g, np.full((2, *g.shape[1:]), 1, g.dtype)]) for g in got]
    before = [np.asarray(x) for x in leaves]
    native = dtype == jnp.bfloat16 and cpu_native.native_write_supported(dtype)
    fn = scatter_blocks_native if native else scatter_blocks
    after = [np.asarray(x) for x in jax.jit(lambda lv, b, v: fn(lv, b, v, L))(leaves, jnp.asarray(dst), values)]
    back = [np.asarray(x) for x in gather_blocks(after, jnp.asarray(dst[:4]), L)]
    for g, b in zip(got, back):
        np.testing.assert_array_equal(g, b)
    untouched = [b for b in range(NB) if b not in dst[:4]]
    rows = [l * NB + b for l in range(L) for b in untouched]
    for x, y in zip(before, after):
        np.testing.assert_array_equal(x[:, rows], y[:, rows])


def test_attach_is_none_when_off_and_attaches_a_policy_per_scheduler():
    from types import SimpleNamespace

    from pagedjax.core.block_pool import BlockPool
    from pagedjax.worker.kv_tiers import attach_kv_tiers

    runner = SimpleNamespace(kv=_random_pool(jnp.float32), num_layers=L, kv_tiers=None, dp=1)
    from pagedjax.core.sched.prefix_cache import PrefixCache

    pool = BlockPool(NB, BS)
    sched = SimpleNamespace(window=None, pool=pool, prefix=PrefixCache(pool), offload=None)
    assert attach_kv_tiers(None, runner, [sched]) is None and runner.kv_tiers is None and sched.pool.evicted is None
    copier = attach_kv_tiers(0.01, runner, [sched])
    assert runner.kv_tiers is copier and sched.offload is not None and sched.pool.evicted == []
    assert sched.prefix.written is None and copier.disk is None  # no disk tier: nothing recorded for it
    assert copier.host.spec.block_bytes == 2 * HKV * L * BS * D * 4
