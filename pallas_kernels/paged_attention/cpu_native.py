"""Native paged attention for the CPU backend: cpu_attention.cc through the XLA FFI.

XLA:CPU runs the jnp paths as many small fused loops; for decode (a few query rows per
sequence) their fixed costs dominate. The C++ kernel walks each sequence's pages once with
an online softmax, on XLA's intra-op thread pool. Pages may be float32 or bfloat16 (widened
to float32 as they are read), or int8 / float8_e4m3fn with float16 scales per token and kv
head (kv_quant.py; dequantized as they are read: widened and multiplied by their scale); q,
the softmax and the output are float32 (a bf16 q is widened, the output cast back to q's
dtype). It is compiled at first use with the
system C++ compiler (`g++ -O3 -march=native`, about 10 s; pallas_kernels/native_build.py)
into ~/.cache/pagedjax/native/ (PAGEDJAX_CACHE moves the root); `available()` is False (and the
engine keeps the XLA path) when there is no compiler, the build fails, or
PAGEDJAX_NATIVE_ATTENTION=0.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.pallas_kernels import native_build
from pagedjax.pallas_kernels.paged_attention import kv_quant

_SOURCE = Path(__file__).with_name("cpu_attention.cc")
_TARGETS = {"float32": ("pagedjax_paged_attention_f32", "PagedAttentionF32"),  # page dtype -> (target, symbol)
            "bfloat16": ("pagedjax_paged_attention_bf16", "PagedAttentionBF16"),
            "int8": ("pagedjax_paged_attention_int8", "PagedAttentionInt8"),  # + k / v scales
            "float8_e4m3fn": ("pagedjax_paged_attention_fp8", "PagedAttentionFP8")}
_TARGETS_BY_STORAGE = {**_TARGETS, "uint8": _TARGETS["float8_e4m3fn"]}  # fp8 pools kept as bytes (kv_quant.py)
_Q_DTYPES = ("float32", "bfloat16")
_QUANTIZED = ("int8", "float8_e4m3fn", "uint8")  # kv_quant.QUANTIZED_KV_DTYPES; uint8: fp8 pages as their bytes
_WRITE_TARGET = ("pagedjax_kv_write_bf16", "PagedKVWriteBF16")
_COPY_TARGET = ("pagedjax_copy_blocks_bf16", "PagedCopyBlocksBF16")
log = logging.getLogger(__name__)


def build() -> Path:
    """Compiles cpu_attention.cc (once per source, jaxlib and CPU); returns the library path."""
    return native_build.build(_SOURCE)


@functools.cache
def available() -> bool:
    """True when the kernel is built and registered with XLA (at most one build per process)."""
    if os.environ.get("PAGEDJAX_NATIVE_ATTENTION", "1") == "0":
        return False
    try:
        lib = ctypes.cdll.LoadLibrary(str(build()))
        for target, symbol in [*_TARGETS.values(), _WRITE_TARGET, _COPY_TARGET]:
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    except (OSError, RuntimeError, AttributeError) as e:
        log.warning("native CPU paged attention unavailable, using the XLA path: %s", e)
        return False
    return True


def native_supported(q_dtype, page_dtype) -> bool:
    """The kernel serves this call: CPU backend, float32 or bfloat16 q, float32, bfloat16, int8 or
    float8_e4m3fn pages (the last two with their scales), kernel built."""
    ok = (jnp.dtype(q_dtype).name in _Q_DTYPES and jnp.dtype(page_dtype).name in _TARGETS)
    return ok and jax.default_backend() == "cpu" and available()


def packed_attention_native(q, k_pages, v_pages, block_tables, kv_lens, q_starts, q_lens, *, scale,
                            sliding_window=None, soft_cap=None, k_scales=None, v_scales=None):
    """Packed layout: q [T, H, D]; sequence s owns tokens [q_starts[s], q_starts[s] + q_lens[s]).
    Same result as `packed_attention_reference` (float32 softmax; pages float32 or bfloat16;
    the output in q's dtype); needs `available()`. int8 / float8_e4m3fn pages need their
    k_scales / v_scales [Hkv, NB, BS] (float16; kv_quant.py): the result is the reference's on
    `kv_quant.dequantize(pages, scales)`; or pass the pools as kv_quant.QuantizedPages, whose
    data and scales are taken as they are stored (fp8: its bytes). sliding_window / soft_cap:
    as in reference.py (FFI attributes, 0 = off); with a window each sequence's walk starts at
    the first page inside the window of its earliest query."""
    if isinstance(k_pages, kv_quant.QuantizedPages):
        (k_pages, k_scales), (v_pages, v_scales) = kv_quant.split(k_pages, True), kv_quant.split(v_pages, True)
    page = jnp.dtype(k_pages.dtype).name
    if jnp.dtype(v_pages.dtype).name != page:
        raise ValueError(f"k_pages {k_pages.dtype} and v_pages {v_pages.dtype} differ")
    target, _ = _TARGETS_BY_STORAGE[page]
    quantized = page in _QUANTIZED
    if quantized != (k_scales is not None) or quantized != (v_scales is not None):
        raise ValueError(f"{page} pages: k_scales and v_scales are {'required' if quantized else 'not taken'}")
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32), vmap_method="sequential")
    i32 = lambda x: x.astype(jnp.int32)
    scales = (k_scales.astype(jnp.float16), v_scales.astype(jnp.float16)) if quantized else ()
    out = call(q.astype(jnp.float32), k_pages, v_pages, *scales, i32(block_tables), i32(kv_lens), i32(q_starts),
               i32(q_lens), scale=np.float32(scale), sliding_window=np.int64(sliding_window or 0),
               soft_cap=np.float32(soft_cap or 0.0))
    return out.astype(q.dtype)


def paged_attention_native(q, k_pages, v_pages, block_tables, kv_lens, q_lens, *, scale, sliding_window=None,
                           soft_cap=None, k_scales=None, v_scales=None):
    """Padded layout q [S, Q, H, D]: same result as `paged_attention_reference` (quantized
    pages: with their scales, as in `packed_attention_native`)."""
    s, nq, h, d = q.shape
    starts = jnp.arange(s, dtype=jnp.int32) * nq
    out = packed_attention_native(q.reshape(s * nq, h, d), k_pages, v_pages, block_tables, kv_lens, starts,
                                  q_lens, scale=scale, sliding_window=sliding_window, soft_cap=soft_cap,
                                  k_scales=k_scales, v_scales=v_scales)
    return out.reshape(s, nq, h, d)


def native_write_supported(page_dtype) -> bool:
    """The native KV write and block copy serve this pool: bfloat16 pages on the CPU backend,
    kernel built (XLA:CPU widens a bf16 scatter, or a bf16 update in a loop, to f32 over the
    whole pool; f32 pools are updated in place)."""
    return jnp.dtype(page_dtype) == jnp.bfloat16 and jax.default_backend() == "cpu" and available()


def write_kv_native(k_pages, v_pages, k, v, slot_mapping):
    """`reference.write_kv` for bfloat16 pools on CPU, in place (the pools alias the results)."""
    call = jax.ffi.ffi_call(_WRITE_TARGET[0], (jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                                               jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)),
                            input_output_aliases={0: 0, 1: 1}, vmap_method="sequential")
    bf16 = lambda x: x.astype(jnp.bfloat16)
    return call(k_pages, v_pages, bf16(k), bf16(v), slot_mapping.astype(jnp.int32))


def copy_blocks_native(kv, num_layers: int, src, dst):
    """`models.kv_cache.copy_blocks` for bfloat16 pools on CPU, in place."""
    k, v = kv
    call = jax.ffi.ffi_call(_COPY_TARGET[0], (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
                            input_output_aliases={0: 0, 1: 1}, vmap_method="sequential")
    return call(k, v, src.astype(jnp.int32), dst.astype(jnp.int32), num_layers=np.int64(num_layers))
