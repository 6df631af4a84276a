"""A bfloat16 KV cache read with a float32 q (what the engine runs with kv_cache_dtype bf16):
every backend against the jnp reference over the same bf16 pages, and the KV write.

The reference, the XLA loops and the native kernel widen the pages to f32, so they match it
to f32 rounding; the Pallas kernels feed their dots bf16 (q rounded, f32 accumulation) and
match to bf16 tolerance.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.models.kv_cache import copy_blocks, copy_blocks_at_once
from pagedjax.pallas_kernels import dense_attention, paged_attention, paged_attention_reference, write_kv
from pagedjax.pallas_kernels.paged_attention import (cpu_native, packed_attention_reference, packed_paged_attention,
                                            reference)
from test_packed_attention import DEVICE_PALLAS, STEPS, make_step
from test_paged_attention import BF16, F32, _exact_f32_matmuls, assert_close  # noqa: F401
from test_paged_prefill import make_prefill_case, prefill_seqs

native = pytest.mark.skipif(jax.default_backend() != "cpu" or not cpu_native.available(),
                            reason="native kernel: CPU backend with a C++ compiler")
PALLAS = ["pallas_tpu_interpret", "pallas_gpu_interpret"] + DEVICE_PALLAS
XLA = ["reference", "chunked", "ragged"]


def bf16_pages(args):
    """(q, k, v, ...) -> the same with k and v in bf16 (q keeps its f32)."""
    q, k, v, *rest = args
    return (q, k.astype(BF16), v.astype(BF16), *rest)


def tolerance(impl):
    return BF16 if impl.startswith("pallas") else F32


@pytest.mark.parametrize("impl", XLA + PALLAS + [pytest.param("native", marks=native)])
@pytest.mark.parametrize("bs,g,d", [(16, 2, 64), (8, 4, 48)])
@pytest.mark.parametrize("decode", [True, False])
def test_padded_layout(impl, bs, g, d, decode):
    seqs = [(1, 0), (1, bs - 1), (1, 5 * bs + 2), (0, 3)] if decode else prefill_seqs(bs)
    q, k, v, tables, kv_lens, q_lens = bf16_pages(make_prefill_case(bs, g, d, F32, seqs, nq=1 if decode else 10))
    kv_lens = kv_lens if not decode else jnp.where(q_lens > 0, kv_lens, 0)
    out = jax.jit(functools.partial(paged_attention, scale=d ** -0.5, impl=impl))(q, k, v, tables, kv_lens, q_lens)
    want = paged_attention_reference(q, k, v, tables, kv_lens, q_lens, scale=d ** -0.5)
    assert out.dtype == F32
    assert_close(out, want, tolerance(impl))


@pytest.mark.parametrize("impl", XLA + PALLAS + [pytest.param("native", marks=native)])
@pytest.mark.parametrize("q_lens,ctx", STEPS)
def test_packed_layout(impl, q_lens, ctx):
    args = bf16_pages(make_step(np.random.default_rng(3), q_lens, ctx))
    want = packed_attention_reference(*args, scale=0.2)
    got = packed_paged_attention(*args, scale=0.2, impl=impl)
    assert got.dtype == F32
    assert_close(got, want, tolerance(impl))


@pytest.mark.parametrize("impl", ["xla", pytest.param("native", marks=native)])
def test_dense_cache(impl):
    rng = np.random.default_rng(4)
    q = jnp.asarray(rng.standard_normal((3, 4, 4, 16)), F32)
    k = jnp.asarray(rng.standard_normal((2, 5, 40, 16)), BF16)
    v = jnp.asarray(rng.standard_normal((2, 5, 40, 16)), BF16)
    slots, kv_lens, q_lens = (jnp.asarray(x, jnp.int32) for x in ([4, 0, 2], [40, 3, 17], [1, 3, 4]))
    got = dense_attention(q, k, v, slots, kv_lens, q_lens, scale=0.25, chunk_tokens=16, impl=impl)
    want = paged_attention_reference(q, k, v, slots[:, None], kv_lens, q_lens, scale=0.25)
    assert_close(got, want, F32)


def test_the_reference_widens_bf16_pages_exactly():
    """bf16 pages give what the same values in f32 pages give (no rounding beyond storage)."""
    q, k, v, tables, kv_lens, q_lens = make_prefill_case(16, 2, 32, F32, prefill_seqs(16))
    kb, vb = k.astype(BF16), v.astype(BF16)
    got = paged_attention_reference(q, kb, vb, tables, kv_lens, q_lens, scale=0.2)
    want = paged_attention_reference(q, kb.astype(F32), vb.astype(F32), tables, kv_lens, q_lens, scale=0.2)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("donate", [True, False])
def test_write_kv_into_bf16_pages(donate):
    """The write (on CPU the native in-place one) rounds the new rows to bf16 and drops
    slots < 0 or past the pool; undonated pages are left as they were."""
    rng = np.random.default_rng(5)
    k = jnp.asarray(rng.standard_normal((2, 6, 8, 16)), BF16)
    v = -k
    new = jnp.asarray(rng.standard_normal((7, 2, 16)), F32)
    slots = jnp.asarray([0, 47, -1, 48, 9, 10, -3], jnp.int32)
    want = reference.write_kv(k, v, new, 2 * new, slots)
    before = np.asarray(k)
    fn = jax.jit(write_kv, donate_argnums=(0, 1) if donate else ())
    got = fn(k, v, new, 2 * new, slots)
    for a, b in zip(got, want):
        assert a.dtype == BF16
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if not donate:
        np.testing.assert_array_equal(np.asarray(k), before)


@native
def test_cpu_write_is_native_and_in_place():
    """XLA:CPU widens a bf16 scatter to f32 over the whole pool (two pool-sized passes per
    layer); the engine's write must compile to the aliased native call, with no pool copy."""
    k = jnp.zeros((2, 64, 8, 16), BF16)
    new = jnp.ones((4, 2, 16), F32)
    exe = jax.jit(write_kv, donate_argnums=(0, 1)).lower(k, k, new, new, jnp.arange(4, dtype=jnp.int32)).compile()
    hlo = exe.as_text()
    assert "pagedjax_kv_write_bf16" in hlo
    assert "f32[2,64,8,16]" not in hlo and "f32[2,512,16]" not in hlo  # never widened
    assert exe.memory_analysis().alias_size_in_bytes >= 2 * k.nbytes


@pytest.mark.parametrize("fn", [copy_blocks, copy_blocks_at_once])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_copy_blocks(dtype, fn):
    """Copy-on-write of blocks in every layer (on CPU a bf16 pool goes through the native
    in-place copy; accelerators copy all entries at once): real copies first, padding
    entries (dst >= NB) ignored."""
    layers, nb = 3, 10
    rng = np.random.default_rng(6)
    kv = tuple(jnp.asarray(rng.standard_normal((2, layers * nb, 4, 8)), dtype) for _ in range(2))
    src, dst = jnp.asarray([1, 4, 0, 0], jnp.int32), jnp.asarray([7, 2, nb, nb], jnp.int32)
    want = [np.asarray(x).copy() for x in kv]
    for w in want:
        for layer in range(layers):
            for a, b in ((1, 7), (4, 2)):
                w[:, layer * nb + b] = w[:, layer * nb + a]
    got = jax.jit(fn, static_argnums=(1,), donate_argnums=(0,))(kv, layers, src, dst)
    for g, w in zip(got, want):
        assert g.dtype == dtype
        np.testing.assert_array_equal(np.asarray(g), w)


def test_copy_blocks_at_once_has_no_loop():
    """The accelerator form is one gather and one scatter: no while loop (XLA:GPU would wait
    for the device to read a loop's trip count, once a step)."""
    kv = tuple(jnp.zeros((2, 30, 4, 8), F32) for _ in range(2))
    idx = jnp.zeros(4, jnp.int32)
    assert "while" not in jax.jit(copy_blocks_at_once, static_argnums=(1,)).lower(kv, 3, idx, idx).as_text()
