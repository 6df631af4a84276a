"""Quantized KV cache: kv_quant's format, and the native kernel on int8 / float8_e4m3fn pages."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import kv_quant
from pallas_kernels.paged_attention.kv_quant import dequantize, is_quantized, quantize

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
