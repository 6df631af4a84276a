"""Sliding-window attention and attention-logit soft-capping in every attention path.

Every impl against `paged_attention_reference` (whose window semantics are checked against a
direct numpy masked softmax), windows smaller than, equal to and larger than the sequences,
kv lengths far past the window, chunked-prefill queries, GQA, soft_cap alone and with a
window, bf16 and int8 pages, the packed and dense entry points; and pages wholly before the
window filled with NaN, which the paths that skip them must never read.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.pallas_kernels.dense_attention import dense_attention, dense_packed_attention
from pagedjax.pallas_kernels.paged_attention import kv_quant, ops, packed
from pagedjax.pallas_kernels.paged_attention.cpu_native import native_supported
from pagedjax.pallas_kernels.paged_attention.reference import paged_attention_reference

F32, BF16 = jnp.float32, jnp.bfloat16
TOL = {F32: dict(atol=2e-5, rtol=2e-5), BF16: dict(atol=3e-2, rtol=3e-2)}
HKV, G, D = 2, 2, 64
BS, MB = 8, 32  # 256 keys a table: far past the windows below
XLA = ["chunked", "ragged", "native"]
PALLAS = ["pallas_tpu_interpret", "pallas_gpu_interpret"]
# (sliding_window, soft_cap): 24 is below, equal to and above the kv lengths of the cases
OPTIONS = [(24, None), (5, 20.0), (None, 30.0)]
PALLAS_OPTIONS = [(24, 20.0)]  # interpret mode is slow: one case covering both
# (q_len, kv_len): fresh prefill shorter than the window, chunked prefill with a prefix equal
# to / past the window, long chunks far past it, a padding row, a decode-like row at the end
PREFILL = [(10, 10), (6, 24), (10, 40), (9, 250), (0, 5), (1, MB * BS)]
DECODE = [1, 8, 9, 24, 100, 250, 0]


@pytest.fixture(autouse=True)
def _exact_f32_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


def skip_native(impl, page_dtype=F32):
    if impl == "native" and not native_supported(F32, page_dtype):
        pytest.skip("native CPU kernel unavailable")


def make_case(seqs, nq, dtype=F32, page_dtype=None, g=G, bs=BS, mb=MB, seed=0):
    """seqs: (q_len, kv_len) each. Shuffled tables, entries past a sequence's pages -1.
    Returns (q [S, Q, H, D], k, v, tables, kv_lens, q_lens)."""
    rng = np.random.default_rng(seed)
    s = len(seqs)
    nb = s * mb
    page_dtype = page_dtype or dtype
    q = jnp.asarray(rng.standard_normal((s, nq, HKV * g, D)), dtype)
    k = jnp.asarray(2 * rng.standard_normal((HKV, nb, bs, D)), page_dtype)  # peaky scores: the cap bites
    v = jnp.asarray(rng.standard_normal((HKV, nb, bs, D)), page_dtype)
    tables = rng.permutation(nb).reshape(s, mb).astype(np.int32)
    for i, (_, kv) in enumerate(seqs):
        tables[i, -(-kv // bs):] = -1
    kv_lens = jnp.asarray([kv for _, kv in seqs], jnp.int32)
    q_lens = jnp.asarray([ql for ql, _ in seqs], jnp.int32)
    return q, k, v, jnp.asarray(tables), kv_lens, q_lens


def assert_close(out, ref, dtype=F32):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), **TOL[dtype])


def run(impl, *args, entry=ops.paged_attention, **opts):
    return jax.jit(functools.partial(entry, impl=impl, **opts))(*args)


# -- the reference against an independent oracle -------------------------------------------

@pytest.mark.parametrize("window,cap", [(1, None), (7, None), (24, 5.0), (None, 3.0)])
def test_reference_matches_numpy_oracle(window, cap):
    seqs = [(10, 10), (6, 24), (10, 40), (0, 5), (1, 50)]
    q, k, v, tables, kv_lens, q_lens = make_case(seqs, 10, mb=8, seed=3)
    out = np.asarray(paged_attention_reference(q, k, v, tables, kv_lens, q_lens, scale=0.125,
                                               sliding_window=window, soft_cap=cap))
    qn, kn, vn = (np.asarray(x, np.float64) for x in (q, k, v))
    tn = np.asarray(tables)
    for s, (ql, kv) in enumerate(seqs):
        pages = tn[s, :(kv + BS - 1) // BS]
        keys = kn[:, pages].reshape(HKV, -1, D)[:, :kv]  # [Hkv, kv, D]
        vals = vn[:, pages].reshape(HKV, -1, D)[:, :kv]
        for j in range(10):
            for h in range(HKV * G):
                if j >= ql:
                    assert not out[s, j, h].any()
                    continue
                p = kv - ql + j
                sc = 0.125 * keys[h // G] @ qn[s, j, h]
                if cap is not None:
                    sc = cap * np.tanh(sc / cap)
                t = np.arange(kv)
                vis = (t <= p) & ((p - t < window) if window else True)
                w = np.where(vis, np.exp(sc - sc[vis].max()), 0.0)
                np.testing.assert_allclose(out[s, j, h], w @ vals[h // G] / w.sum(), atol=1e-5, rtol=1e-5)


def test_options_validated():
    args = make_case([(1, 4)], 1, mb=2)
    for bad in [dict(sliding_window=0), dict(sliding_window=2.5), dict(soft_cap=0.0), dict(soft_cap=-1.0)]:
        with pytest.raises(ValueError):
            ops.paged_attention(*args, impl="reference", **bad)


# -- every impl against the reference ------------------------------------------------------

@pytest.mark.parametrize("impl", XLA + PALLAS)
def test_prefill_impls(impl):
    skip_native(impl)
    args = make_case(PREFILL, 10)
    for window, cap in (OPTIONS if impl in XLA else PALLAS_OPTIONS):
        ref = paged_attention_reference(*args, scale=D ** -0.5, sliding_window=window, soft_cap=cap)
        out = run(impl, *args, sliding_window=window, soft_cap=cap)
        assert_close(out, ref)
    if impl == "native":  # a window past every sequence walks exactly as no window: same bits
        np.testing.assert_array_equal(np.asarray(run(impl, *args, sliding_window=10 ** 6)),
                                      np.asarray(run(impl, *args)))


@pytest.mark.parametrize("impl", XLA + PALLAS)
def test_decode_impls(impl):
    skip_native(impl)
    q, k, v, tables, kv_lens, _ = make_case([(1, n) for n in DECODE], 1, g=4, seed=1)
    for window, cap in (OPTIONS if impl in XLA else PALLAS_OPTIONS):
        ref = paged_attention_reference(q, k, v, tables, kv_lens, (kv_lens > 0).astype(jnp.int32), scale=D ** -0.5,
                                        sliding_window=window, soft_cap=cap)[:, 0]
        out = run(impl, q[:, 0], k, v, tables, kv_lens, entry=ops.paged_decode_attention, sliding_window=window,
                  soft_cap=cap)
        assert_close(out, ref)


@pytest.mark.parametrize("impl", ["reference", "ragged", "native"] + PALLAS)
def test_packed_entry_point(impl):
    """Chunked prefill (rows of 16 tokens) and decode-like (a row per token) packed steps."""
    skip_native(impl)
    seqs = [(18, 60), (0, 9), (1, 200), (7, 24)]
    q, k, v, tables, kv_lens, q_lens = make_case(seqs, 20, seed=2)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum([ql for ql, _ in seqs])]), jnp.int32)
    tokens = jnp.concatenate([q[s, :ql] for s, (ql, _) in enumerate(seqs)] + [q[0, :2]])  # 2 tokens nobody owns
    dec_cu = jnp.asarray([0, 1, 1, 2, 3], jnp.int32)  # one token each but the padding row
    for window, cap in [(6, 25.0)] + ([(24, None)] if impl == "native" else []):
        opts = dict(sliding_window=window, soft_cap=cap)
        ref = packed.packed_attention_reference(tokens, k, v, tables, kv_lens, cu, scale=D ** -0.5, **opts)
        padded = paged_attention_reference(q, k, v, tables, kv_lens, q_lens, scale=D ** -0.5, **opts)
        assert_close(ref[:cu[-1]], jnp.concatenate([padded[s, :ql] for s, (ql, _) in enumerate(seqs)]))
        assert not np.asarray(ref[cu[-1]:]).any()
        assert_close(run(impl, tokens, k, v, tables, kv_lens, cu, entry=ops.packed_paged_attention, **opts), ref)
        if impl in PALLAS:  # the decode-like rows run the decode kernels: test_decode_impls
            continue
        dec = tokens[:3]
        ref = packed.packed_attention_reference(dec, k, v, tables, kv_lens, dec_cu, scale=D ** -0.5, **opts)
        assert_close(run(impl, dec, k, v, tables, kv_lens, dec_cu, entry=ops.packed_paged_attention, **opts), ref)


@pytest.mark.parametrize("impl", ["xla", "native"])
def test_dense_path(impl):
    """Dense slots of 100 rows walked in chunks of 16 (the last chunk shifted back)."""
    skip_native(impl)
    rng = np.random.default_rng(4)
    ns, length = 5, 100
    seqs = [(10, 10), (6, 24), (10, 90), (0, 5), (1, length)]
    q = jnp.asarray(rng.standard_normal((len(seqs), 10, HKV * G, D)), F32)
    k = jnp.asarray(2 * rng.standard_normal((HKV, ns, length, D)), F32)
    v = jnp.asarray(rng.standard_normal((HKV, ns, length, D)), F32)
    slots = jnp.asarray(rng.permutation(ns), jnp.int32)
    kv_lens = jnp.asarray([kv for _, kv in seqs], jnp.int32)
    q_lens = jnp.asarray([ql for ql, _ in seqs], jnp.int32)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(np.asarray(q_lens))]), jnp.int32)
    tokens = jnp.concatenate([q[s, :ql] for s, (ql, _) in enumerate(seqs)])
    for window, cap in [(24, None), (5, 20.0)]:
        opts = dict(sliding_window=window, soft_cap=cap)
        ref = paged_attention_reference(q, k, v, slots[:, None], kv_lens, q_lens, scale=D ** -0.5, **opts)
        out = jax.jit(functools.partial(dense_attention, scale=D ** -0.5, chunk_tokens=16, impl=impl, **opts))(
            q, k, v, slots, kv_lens, q_lens)
        assert_close(out, ref)
        out = jax.jit(functools.partial(dense_packed_attention, scale=D ** -0.5, chunk_tokens=16, impl=impl, **opts))(
            tokens, k, v, slots, kv_lens, cu)
        assert_close(out, jnp.concatenate([ref[s, :ql] for s, (ql, _) in enumerate(seqs)]))


@pytest.mark.parametrize("impl", XLA + PALLAS)
def test_bf16_pages(impl):
    skip_native(impl, BF16)
    args = make_case(PREFILL, 10, page_dtype=BF16, bs=16, mb=16, seed=5)
    window, cap = 24, 20.0
    ref = paged_attention_reference(*args, scale=D ** -0.5, sliding_window=window, soft_cap=cap)
    out = run(impl, *args, sliding_window=window, soft_cap=cap)
    assert_close(out, ref, BF16 if impl in PALLAS else F32)  # the Pallas kernels round q to bf16


@pytest.mark.parametrize("impl", XLA + PALLAS)
def test_int8_pages(impl):
    skip_native(impl, jnp.int8)
    q, k, v, tables, kv_lens, q_lens = make_case(PREFILL, 10, bs=32, mb=8, seed=6)
    kq, vq = (kv_quant.QuantizedPages(*kv_quant.quantize(x, jnp.int8)) for x in (k, v))
    window, cap = 24, 20.0
    ref = ops.paged_attention(q, kq, vq, tables, kv_lens, q_lens, impl="reference", sliding_window=window,
                              soft_cap=cap)
    out = run(impl, q, kq, vq, tables, kv_lens, q_lens, sliding_window=window, soft_cap=cap)
    assert_close(out, ref, F32 if impl in XLA else BF16)


# -- pages wholly before the window are never read -----------------------------------------

@pytest.mark.parametrize("impl", XLA + PALLAS)
def test_nan_pages_before_window_not_read(impl):
    """Pages wholly before the window of a sequence's earliest query hold NaN (another
    request's garbage); the paths that skip them give the clean reference's answer. Page 0
    (where unused table slots point) stays finite."""
    skip_native(impl)
    window, bs, mb = 20, BS, MB
    seqs = [(4, 250), (4, 37)] + ([] if impl in PALLAS else [(4, 4)])
    s = len(seqs)
    rng = np.random.default_rng(7)
    nb = s * mb + 1
    q = jnp.asarray(rng.standard_normal((s, 4, HKV * G, D)), F32)
    k = 2 * rng.standard_normal((HKV, nb, bs, D)).astype(np.float32)
    v = rng.standard_normal((HKV, nb, bs, D)).astype(np.float32)
    tables = (1 + rng.permutation(nb - 1)).reshape(s, mb).astype(np.int32)
    kv_lens = jnp.asarray([kv for _, kv in seqs], jnp.int32)
    q_lens = jnp.asarray([ql for ql, _ in seqs], jnp.int32)
    ref = paged_attention_reference(q, jnp.asarray(k), jnp.asarray(v), jnp.asarray(tables), kv_lens, q_lens,
                                    scale=D ** -0.5, sliding_window=window, soft_cap=30.0)
    dec_ref = paged_attention_reference(q[:, :1], jnp.asarray(k), jnp.asarray(v), jnp.asarray(tables), kv_lens,
                                        jnp.ones((s,), jnp.int32), scale=D ** -0.5, sliding_window=window)
    poisoned = 0
    for i, (ql, kv) in enumerate(seqs):
        first_key = max(kv - ql - (window - 1), 0)  # the earliest query's first key
        for page in range(first_key // bs):
            k[:, tables[i, page]] = np.nan
            v[:, tables[i, page]] = np.nan
            poisoned += 1
    assert poisoned > 20
    args = (jnp.asarray(k), jnp.asarray(v), jnp.asarray(tables), kv_lens)
    out = run(impl, q, *args, q_lens, sliding_window=window, soft_cap=30.0)
    assert_close(out, ref)
    if impl in PALLAS:  # interpret mode is slow; the decode kernels walk from their first page alike
        return
    out = run(impl, q[:, 0], *args, entry=ops.paged_decode_attention, sliding_window=window)
    assert_close(out, dec_ref[:, 0])
