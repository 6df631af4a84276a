"""Quantized KV cache: kv_quant's format, and the native kernel on int8 / float8_e4m3fn pages."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.pallas_kernels.paged_attention import kv_quant
from pagedjax.pallas_kernels.paged_attention.kv_quant import dequantize, is_quantized, quantize

I8, F8 = jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn)


def _vectors(seed=0, shape=(3, 5, 64)):
    rng = np.random.default_rng(seed)
    # magnitudes spread over a few decades per vector, and one outlier channel
    x = rng.standard_normal(shape) * np.exp(rng.uniform(-3, 3, shape[:-1] + (1,)))
    x[..., 7] *= 20
    return jnp.asarray(x, jnp.float32)


def test_dtypes():
    assert kv_quant.QUANTIZED_KV_DTYPES == (I8, F8)
    assert is_quantized(jnp.int8) and is_quantized("float8_e4m3fn") and is_quantized(F8)
    assert not is_quantized(jnp.bfloat16) and not is_quantized(jnp.float32) and not is_quantized(jnp.uint8)
    with pytest.raises(ValueError):
        quantize(jnp.ones((2, 4)), jnp.bfloat16)


def test_int8_round_trip():
    x = _vectors()
    x_q, scale = quantize(x, jnp.int8)
    assert x_q.dtype == I8 and x_q.shape == x.shape and scale.dtype == jnp.float16 and scale.shape == x.shape[:-1]
    xq = np.asarray(x_q, np.int32)
    assert np.abs(xq).max() <= 127 and (np.abs(xq).max(-1) >= 126).all()  # the range is used
    amax = np.abs(np.asarray(x)).max(-1)
    np.testing.assert_allclose(np.asarray(scale, np.float32), amax / 127, rtol=2 ** -10)  # float16 rounding
    err = np.abs(np.asarray(dequantize(x_q, scale)) - np.asarray(x)).max(-1)
    assert (err <= 0.5 / 127 * amax * (1 + 2 ** -9)).all()
    assert dequantize(x_q, scale).dtype == jnp.float32


def test_fp8_round_trip():
    x = _vectors(1)
    x_q, scale = quantize(x, jnp.float8_e4m3fn)
    assert x_q.dtype == F8 and scale.dtype == jnp.float16 and scale.shape == x.shape[:-1]
    y = np.asarray(x_q, np.float32)
    assert np.isfinite(y).all() and np.abs(y).max() <= 448
    x, s = np.asarray(x), np.asarray(scale, np.float32)[..., None]
    err = np.abs(np.asarray(dequantize(x_q, scale)) - x)
    # 3 mantissa bits: half an ulp relative; subnormals (|x_q| < 2^-6) step by 2^-9
    assert (err <= 2 ** -4 * np.abs(x) + 2 ** -10 * s * (1 + 2 ** -9)).all()


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn])
def test_zero_vectors_and_bf16_input(dtype):
    x = _vectors(2, (4, 16)).at[1].set(0.0).at[3].set(-0.0)
    x_q, scale = quantize(x.astype(jnp.bfloat16), dtype)
    assert float(scale[1]) == 0 and float(scale[3]) == 0
    assert not np.asarray(x_q[1], np.float32).any() and not np.asarray(x_q[3], np.float32).any()
    back = np.asarray(dequantize(x_q, scale))
    assert np.isfinite(back).all() and not back[1].any()
    tiny = jnp.full((2, 8), 1e-12, jnp.float32)  # the scale underflows float16: zeros, no inf / NaN
    t_q, t_s = quantize(tiny, dtype)
    assert np.isfinite(np.asarray(dequantize(t_q, t_s))).all()


def test_quantize_inside_jit():
    x = _vectors(3)
    for dtype in kv_quant.QUANTIZED_KV_DTYPES:
        a = jax.jit(quantize, static_argnums=1)(x, dtype)
        b = quantize(x, dtype)
        for u, v in zip(a, b):
            np.testing.assert_array_equal(np.asarray(u, np.float32), np.asarray(v, np.float32))


# ---- the native kernel on quantized pages -------------------------------------------------

def _native():
    from pagedjax.pallas_kernels.paged_attention import cpu_native
    return cpu_native if jax.default_backend() == "cpu" and cpu_native.available() else None


native_only = pytest.mark.skipif(_native() is None, reason="native kernel: CPU backend with a C++ compiler")
TOL = dict(rtol=1e-5, atol=1e-5)


def _quantized_batch(bs, hkv, g, d, dtype, seqs, nq, mb, seed=0):
    """make_batch's float32 batch with its pages quantized: (q, kq, vq, tables, kv_lens, q_lens,
    k_scales, v_scales, k_deq, v_deq)."""
    from test_paged_ragged import make_batch
    q, k, v, tables, kv_lens, q_lens = make_batch(bs, hkv, g, d, jnp.float32, seqs, nq, mb, seed=seed)
    rng = np.random.default_rng(seed + 100)  # per-token magnitudes that differ, as real caches do
    k = k * jnp.asarray(np.exp(rng.uniform(-2, 2, k.shape[:-1] + (1,))), jnp.float32)
    v = v * jnp.asarray(np.exp(rng.uniform(-2, 2, v.shape[:-1] + (1,))), jnp.float32)
    (kq, ks), (vq, vs) = quantize(k, dtype), quantize(v, dtype)
    return q, kq, vq, tables, kv_lens, q_lens, ks, vs, dequantize(kq, ks), dequantize(vq, vs)


def _check_padded(dtype, bs, hkv, g, d, seqs, nq, mb, seed=0, scale=0.2):
    from pagedjax.pallas_kernels import paged_attention_reference
    q, kq, vq, tables, kv_lens, q_lens, ks, vs, kd, vd = _quantized_batch(bs, hkv, g, d, dtype, seqs, nq, mb, seed)
    fn = jax.jit(lambda *a: _native().paged_attention_native(*a[:6], scale=scale, k_scales=a[6], v_scales=a[7]))
    out = fn(q, kq, vq, tables, kv_lens, q_lens, ks, vs)
    ref = paged_attention_reference(q, kd, vd, tables, kv_lens, q_lens, scale=scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), **TOL)
    for i, n in enumerate(np.asarray(q_lens)):  # padding slots are exact zeros
        assert not np.asarray(out[i, n:]).any()
    return out


@native_only
@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn])
@pytest.mark.parametrize("bs,g,d", [(16, 3, 64), (8, 1, 48), (32, 4, 128), (16, 2, 40)])
def test_native_decode(dtype, bs, g, d):
    mb = 8
    # short, exactly the table, empty row, kv_len 0, exactly a page, a page plus one
    seqs = [(1, 3), (1, mb * bs), (0, 9), (1, 0), (1, bs), (1, 2 * bs + 1)]
    _check_padded(dtype, bs, 2, g, d, seqs, 1, mb)


@native_only
@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn])
@pytest.mark.parametrize("bs,g,nq,d", [(8, 2, 6, 64), (16, 3, 5, 64), (32, 1, 12, 32)])
def test_native_prefill(dtype, bs, g, nq, d):
    mb = 6
    # fresh prefill, cached prefix with padded slots, several prefix pages, empty row, decode row
    seqs = [(nq, nq), (nq - 2, nq - 2 + bs // 2 + 1), (nq, nq + 3 * bs + 2), (0, 5), (1, mb * bs - 2)]
    _check_padded(dtype, bs, 2, g, d, seqs, nq, mb, seed=1)


@native_only
@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn])
def test_native_packed_layout_and_bf16_q(dtype):
    from pagedjax.pallas_kernels.paged_attention.packed import packed_attention_reference
    seqs = [(4, 30), (1, 17), (3, 3), (2, 64)]
    q, kq, vq, tables, kv_lens, q_lens, ks, vs, kd, vd = _quantized_batch(16, 3, 3, 64, dtype, seqs, 4, 4, seed=2)
    lens = np.asarray(q_lens)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    qp = jnp.concatenate([q[i, :n] for i, n in enumerate(lens)] + [q[0, :2]])  # 2 tokens no sequence owns
    out = _native().packed_attention_native(qp, kq, vq, tables, kv_lens, jnp.asarray(cu[:-1]), q_lens, scale=0.125,
                                            k_scales=ks, v_scales=vs)
    ref = packed_attention_reference(qp, kd, vd, tables, kv_lens, jnp.asarray(np.append(cu, cu[-1])), scale=0.125)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), **TOL)
    assert not np.asarray(out[-2:]).any()
    out16 = _native().packed_attention_native(qp.astype(jnp.bfloat16), kq, vq, tables, kv_lens, jnp.asarray(cu[:-1]),
                                              q_lens, scale=0.125, k_scales=ks, v_scales=vs)
    assert out16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out16, np.float32), np.asarray(ref), rtol=3e-2, atol=3e-2)


@native_only
@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn])
def test_native_reads_every_code_exactly(dtype):
    """One key per sequence: the output is its value row, so every one of the 256 codes (subnormal
    fp8 included) must come out as kv_quant.dequantize gives it; fp8 NaN codes give NaN."""
    codes = np.arange(256, dtype=np.uint8).reshape(2, 128)  # two value rows of D = 128
    hkv, nb, bs, d = 1, 4, 8, 128
    pages = np.zeros((hkv, nb, bs, d), np.uint8)
    pages[0, 1, 0], pages[0, 3, 0] = codes
    v = jnp.asarray(pages.view(np.int8)).view(jnp.int8) if dtype == jnp.int8 else jnp.asarray(pages).view(dtype)
    rng = np.random.default_rng(4)
    vs = jnp.asarray(np.exp(rng.uniform(-6, 6, (hkv, nb, bs))), jnp.float16)
    ks = jnp.ones((hkv, nb, bs), jnp.float16)
    q = jnp.asarray(rng.standard_normal((2, 1, 2, d)), jnp.float32)
    tables = jnp.asarray([[1, -1], [3, -1]], jnp.int32)
    one = jnp.ones(2, jnp.int32)
    out = _native().paged_attention_native(q, v, v, tables, one, one, scale=0.1, k_scales=ks, v_scales=vs)
    want = np.asarray(dequantize(v, vs))[0, [1, 3], 0]  # [2, D]
    got = np.asarray(out)[:, 0]  # [2, H, D]
    nan = np.isnan(want)
    assert nan.sum() == (2 if dtype == jnp.float8_e4m3fn else 0)
    if nan.any():  # the NaN key poisons its scores too: those rows are all NaN
        assert np.isnan(got[nan.any(-1)]).all()
        got, want = got[~nan.any(-1)], want[~nan.any(-1)]
    for h in range(got.shape[1]):
        np.testing.assert_array_equal(got[:, h], want)


@native_only
def test_native_supported_and_argument_errors():
    from pagedjax.pallas_kernels.paged_attention.cpu_native import native_supported, paged_attention_native
    for page in (jnp.int8, jnp.float8_e4m3fn, jnp.float32, jnp.bfloat16):
        assert native_supported(jnp.float32, page) and native_supported(jnp.bfloat16, page)
    assert not native_supported(jnp.int8, jnp.int8) and not native_supported(jnp.float32, jnp.float16)
    q, kq, vq, tables, kv_lens, q_lens, ks, vs, kd, vd = _quantized_batch(8, 1, 2, 32, jnp.int8, [(1, 5)], 1, 2)
    with pytest.raises(ValueError, match="required"):
        paged_attention_native(q, kq, vq, tables, kv_lens, q_lens, scale=0.1)
    with pytest.raises(ValueError, match="not taken"):
        paged_attention_native(q, kd, vd, tables, kv_lens, q_lens, scale=0.1, k_scales=ks, v_scales=vs)
    # scales given as float32 are rounded to float16 (the stored format)
    out = paged_attention_native(q, kq, vq, tables, kv_lens, q_lens, scale=0.1, k_scales=ks.astype(jnp.float32),
                                 v_scales=vs.astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(paged_attention_native(
        q, kq, vq, tables, kv_lens, q_lens, scale=0.1, k_scales=ks, v_scales=vs)))
