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

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

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


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QuantizedPages:
    """A quantized page pool: data [Hkv, NB, BS, D] int8 / float8_e4m3fn and its scales
    [Hkv, NB, BS] float16 (a pytree of the two, so it travels through jit, scan, shard_map
    and donation like the plain array it replaces). An fp8 pool on the CPU keeps its data as
    the e4m3fn bytes (uint8): XLA:CPU updates a float8 array through float32, a copy of the
    whole pool per write (28 ms against 0.02 for int8, 3 x 144k tokens x 64 on a 2-core
    EPYC). `shape` is the data's, `dtype` the values' (int8 or float8_e4m3fn)."""

    data: jax.Array
    scales: jax.Array

    @property
    def shape(self):
        return self.data.shape

    @property
    def dtype(self):
        return jnp.dtype(jnp.float8_e4m3fn) if self.data.dtype == jnp.uint8 else self.data.dtype

    @property
    def ndim(self):
        return self.data.ndim


def zeros(shape, dtype) -> jax.Array | QuantizedPages:
    """An empty pool [Hkv, NB, BS, D]: quantized dtypes as QuantizedPages with zero scales."""
    if is_quantized(dtype):
        as_bytes = jnp.dtype(dtype) == jnp.float8_e4m3fn and jax.default_backend() == "cpu"
        return QuantizedPages(jnp.zeros(shape, jnp.uint8 if as_bytes else dtype), jnp.zeros(shape[:-1], jnp.float16))
    return jnp.zeros(shape, dtype)


def _values(data: jax.Array) -> jax.Array:
    """Stored pages (or a part) as their value dtype: fp8 bytes seen as float8_e4m3fn."""
    return jax.lax.bitcast_convert_type(data, jnp.float8_e4m3fn) if data.dtype == jnp.uint8 else data


def load(pages, take) -> jax.Array:
    """`take(pages)` as float32 [..., D]: `take` indexes or slices the leading axes of a pool
    [Hkv, NB, BS, D] (its last axis kept, whatever its size); quantized pages are taken with
    their scales and dequantized right there, in the attention loop, never as a whole pool."""
    if isinstance(pages, QuantizedPages):
        return _values(take(pages.data)).astype(jnp.float32) * take(pages.scales[..., None]).astype(jnp.float32)
    return take(pages).astype(jnp.float32)


def scatter_pages(pages, update, values) -> jax.Array | QuantizedPages:
    """`update(pool, new)` writes new [T, Hkv, D] (cast to the pool's dtype) into a pool
    [Hkv, NB, BS, D]; quantized pages get values quantized and their scales written alike
    (`update` must keep the last axis generic: scales go in as [Hkv, NB, BS, 1])."""
    if isinstance(pages, QuantizedPages):
        v_q, scale = quantize(values, pages.dtype)
        scales = update(pages.scales[..., None], scale[..., None])[..., 0]
        if pages.data.dtype == jnp.uint8:  # fp8 stored as bytes
            v_q = jax.lax.bitcast_convert_type(v_q, jnp.uint8)
        return QuantizedPages(update(pages.data, v_q), scales)
    return update(pages, values.astype(pages.dtype))


def split(pages, as_stored: bool = False) -> tuple[jax.Array, jax.Array | None]:
    """(data, scales) of a quantized pool, (pages, None) of a plain one: what the kernels take
    (their k_scales / v_scales). as_stored: fp8 bytes stay uint8 (the native CPU kernel reads
    them as they are); else the data comes as its value dtype."""
    if not isinstance(pages, QuantizedPages):
        return pages, None
    return (pages.data if as_stored else _values(pages.data)), pages.scales


@functools.cache
def _hadamard(d: int) -> np.ndarray:
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h / np.float32(np.sqrt(d))


def rotate(x: jax.Array) -> jax.Array:
    """x [..., D] times an orthonormal Hadamard matrix [D, D] (D a power of two; other D: x
    as it is). A quantized cache stores keys and values rotated, queries rotated alike, and
    the attention output rotated back: q.k and p.v are unchanged (the matrix is orthogonal),
    while an outlier channel (keys have a few, rope makes them per token) is spread over all
    D, so the per-vector scale fits the rest: on SmolLM2-135M the int8 cache's log-prob error
    fell by a third (scripts/bench_quantization.py)."""
    d = x.shape[-1]
    if d & (d - 1):
        return x
    h = jnp.asarray(_hadamard(d))  # symmetric and orthonormal: its own inverse
    return jnp.einsum("...d,de->...e", x.astype(jnp.float32), h, precision=jax.lax.Precision.HIGHEST).astype(x.dtype)
