"""Quantized KV cache format: int8 or float8_e4m3fn pages with a float16 scale per token and head.

Layout (beside the usual page pools):
  k_pages, v_pages    [Hkv, NB, BS, D]  int8 or float8_e4m3fn
  k_scales, v_scales  [Hkv, NB, BS]     float16 (same block indexing as the pages)
A stored vector x [D] (one token, one kv head) is x_q * scale: scale = max|x| / QMAX (QMAX 127
for int8, 448 for e4m3fn, its largest finite value), rounded to float16 before x is divided by
it, so `dequantize` undoes exactly the scale that `quantize` used. int8 rounds to nearest
(error <= scale / 2 per element); e4m3fn keeps 3 mantissa bits (relative error <= 2^-4 for
normal values). A zero vector has scale 0 and x_q 0. `dequantize` gives float32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

QUANTIZED_KV_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))
_QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}


def is_quantized(dtype) -> bool:
    """True for the quantized page dtypes (int8, float8_e4m3fn)."""
    return jnp.dtype(dtype) in QUANTIZED_KV_DTYPES


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """x [..., D] float -> (x_q [..., D] in `dtype`, scale [...] float16), per vector over D."""
    dtype = jnp.dtype(dtype)
    if dtype not in _QMAX:
        raise ValueError(f"not a quantized KV dtype: {dtype}")
    qmax = _QMAX[dtype]
    x = x.astype(jnp.float32)
    scale = (jnp.max(jnp.abs(x), axis=-1) / qmax).astype(jnp.float16)
    s = scale.astype(jnp.float32)[..., None]
    y = jnp.where(s > 0, x / jnp.where(s > 0, s, 1.0), 0.0)  # zero (or underflowed) scale: x_q 0
    if dtype == jnp.int8:
        y = jnp.round(y)
    y = jnp.clip(y, -qmax, qmax)  # a scale rounded down may push |y| just past qmax
    return y.astype(dtype), scale


def dequantize(x_q: jax.Array, scale: jax.Array) -> jax.Array:
    """x_q [..., D], scale [...] -> float32 [..., D] (x_q * scale)."""
    return x_q.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]
