"""Validating public entry points for paged attention; pick a backend implementation.

`packed_paged_attention` takes the packed token layout the engine runs (packed.py);
`paged_attention` the padded [S, Q] layout; `paged_decode_attention` one query per sequence.

All checks read static shapes and dtypes only, so the wrappers run inside jax.jit.
impl:
  "auto"        TPU -> "pallas_tpu", GPU -> "pallas_gpu" (when the page size suits the
                kernel, else "chunked"); CPU -> "native" when the kernel builds, else
                "ragged"; other backends -> "ragged"
  "reference"   gather every page (paged_attention_reference)
  "chunked"     online-softmax loop over a padded [S, chunk] slab of pages in use
                (paged_attention_chunked)
  "ragged"      online-softmax loop over a flat list of every sequence's own page units
                (paged_attention_ragged; the fastest XLA path on CPU)
  "native"      C++ kernel through the XLA FFI, CPU only (cpu_native.py; several times
                faster than "ragged" there)
  "pallas_tpu", "pallas_gpu"                       compiled kernels: the decode kernel for
                                                   Q == 1, the prefill kernel for Q > 1
  "pallas_tpu_interpret", "pallas_gpu_interpret"   the same bodies in interpret mode (tests)

Dtypes: q and the pages each float32 or bfloat16. Softmax and accumulation run in float32
everywhere; the output has q's dtype. bf16 pages with an f32 q (the engine's bf16 KV cache):
the Pallas kernels feed their dots bf16 (q rounded, common.compute_dtype), the native kernel
and the jnp paths widen the pages to f32. Quantized pages (int8 / float8_e4m3fn with float16
scales per token and head, kv_quant.QuantizedPages) are dequantized as each path reads them,
never as a whole pool: the native kernel in its inner loop, the jnp paths per gathered chunk,
the Pallas kernels per compute block (the scale pages fetched beside the data pages through
the same block table: gathered on GPU, DMA'd into VMEM on TPU), their dots fed the raw int8 /
e4m3fn values in q's dtype (exact in f32 and bf16) with the K scales applied to the scores and
the V scales to the probabilities in f32 (common.compute_dtype). "auto" picks the Pallas
kernels for them as for float pages (TPU: page size a multiple of 32, the 8-bit tile).

Every entry point and every impl takes two static options (plain Python values, part of
each kernel's compile-time configuration; reference.py defines them):
  sliding_window: int >= 1 | None   the query at p sees key t iff t <= p and p - t < window
  soft_cap: float > 0 | None        scores s = scale * q.k become soft_cap * tanh(s / soft_cap)
None (the default) leaves every result as it was. With a window, the impls that walk pages
("chunked", "ragged", "native", the Pallas kernels, and the dense path) start each sequence
(or query tile / row) at the first page holding a key inside the window of its earliest
query, so a sequence far longer than the window costs about the window, and pages wholly
before the window are never read ("reference" gathers every page, masked).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from . import cpu_native, kv_quant, packed, ragged, reference
from .cpu_native import native_supported
from .pallas_gpu import gpu_supported, paged_decode_attention_gpu
from .pallas_gpu_prefill import paged_prefill_attention_gpu
from .pallas_tpu import paged_decode_attention_tpu, tpu_supported
from .pallas_tpu_prefill import paged_prefill_attention_tpu

IMPLS = ("auto", "reference", "chunked", "ragged", "native", "pallas_tpu", "pallas_gpu",
         "pallas_tpu_interpret", "pallas_gpu_interpret")
_XLA_IMPLS = ("reference", "chunked", "ragged", "native")  # one function for every Q
_FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
GPU_BACKENDS = ("gpu", "cuda", "rocm")  # jax.default_backend() names of GPUs


def _check_float(name, x):
    if jnp.dtype(x.dtype) not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32 or bfloat16, got {x.dtype}")


def _check_int32(name, x):
    if jnp.dtype(x.dtype) != jnp.int32:
        raise TypeError(f"{name} must be int32, got {x.dtype}")


def _check_rank(name, x, rank, layout):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if len(x.shape) != rank:
        raise ValueError(f"{name} must have rank {rank} {layout}, got shape {tuple(x.shape)}")


def _validate(q, k_pages, v_pages, block_tables, kv_lens, q_lens, impl):
    """q is [S, Q, H, D] here; q_lens may be None (decode)."""
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; expected one of {IMPLS}")
    _check_rank("k_pages", k_pages, 4, "[Hkv, NB, BS, D]")
    _check_rank("v_pages", v_pages, 4, "[Hkv, NB, BS, D]")
    _check_rank("block_tables", block_tables, 2, "[S, MB]")
    _check_rank("kv_lens", kv_lens, 1, "[S]")
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages and v_pages shapes differ: {k_pages.shape} vs {v_pages.shape}")
    if k_pages.dtype != v_pages.dtype:
        raise TypeError(f"k_pages and v_pages dtypes differ: {k_pages.dtype} vs {v_pages.dtype}")
    _check_float("q", q)
    if not kv_quant.is_quantized(k_pages.dtype):
        _check_float("k_pages", k_pages)
    elif not isinstance(k_pages, kv_quant.QuantizedPages) or not isinstance(v_pages, kv_quant.QuantizedPages):
        raise TypeError(f"{k_pages.dtype} pages must come as kv_quant.QuantizedPages (the pages with their scales)")
    _check_int32("block_tables", block_tables)
    _check_int32("kv_lens", kv_lens)
    s, _, h, d = q.shape
    hkv = k_pages.shape[0]
    if k_pages.shape[-1] != d:
        raise ValueError(f"head dim of q ({d}) and of the pages ({k_pages.shape[-1]}) differ")
    if hkv == 0 or h % hkv:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({hkv})")
    if block_tables.shape[0] != s or kv_lens.shape[0] != s:
        raise ValueError(f"sequence counts differ: q has {s}, block_tables "
                         f"{block_tables.shape[0]}, kv_lens {kv_lens.shape[0]}")
    if q_lens is not None:
        _check_rank("q_lens", q_lens, 1, "[S]")
        _check_int32("q_lens", q_lens)
        if q_lens.shape[0] != s:
            raise ValueError(f"sequence counts differ: q has {s}, q_lens {q_lens.shape[0]}")


def auto_impl(backend: str, q_dtype, page_size: int, page_dtype) -> str:
    """What impl="auto" runs on `backend` (jax.default_backend()'s name for it) for q and
    pages of these dtypes and this page size (the engine asks through pagedjax.platforms)."""
    if backend == "tpu":
        return "pallas_tpu" if tpu_supported(page_size, page_dtype) else "chunked"
    if backend in GPU_BACKENDS:
        return "pallas_gpu" if gpu_supported(page_size) else "chunked"
    return "native" if native_supported(q_dtype, page_dtype) else "ragged"


def _resolve(impl, q_dtype, page_size, page_dtype):
    """Concrete implementation name for this call (backend read at trace time: the kernels'
    own lowering choice, for callers that pass "auto")."""
    backend = jax.default_backend()
    if impl == "auto":
        return auto_impl(backend, q_dtype, page_size, page_dtype)
    if impl == "native" and not native_supported(q_dtype, page_dtype):
        raise ValueError("impl='native' needs the CPU backend, float32/bfloat16 q and pages, and a built kernel "
                         f"(backend {backend!r}, q {q_dtype}, pages {page_dtype}; see cpu_native.py)")
    if impl == "pallas_tpu" and backend != "tpu":
        raise ValueError(f"impl='pallas_tpu' needs a TPU backend (have {backend!r}); "
                         "use 'pallas_tpu_interpret' on other backends")
    if impl == "pallas_gpu" and backend not in GPU_BACKENDS:
        raise ValueError(f"impl='pallas_gpu' needs a GPU backend (have {backend!r}); "
                         "use 'pallas_gpu_interpret' on other backends")
    if impl.startswith("pallas_gpu") and not gpu_supported(page_size):
        raise ValueError(f"pallas_gpu needs a power-of-two page size, got {page_size}")
    return impl


def _check_options(sliding_window, soft_cap):
    """The static options: sliding_window an int >= 1 or None, soft_cap a float > 0 or None."""
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    if soft_cap is not None:
        if isinstance(soft_cap, bool) or not isinstance(soft_cap, (int, float)) or not math.isfinite(soft_cap) \
                or soft_cap <= 0:
            raise ValueError(f"soft_cap must be a positive float or None, got {soft_cap!r}")
    return (None if sliding_window is None else int(sliding_window),
            None if soft_cap is None else float(soft_cap))


def _tpu_interpret():
    from jax.experimental.pallas import tpu as pltpu
    # Simulated DMAs land only at .wait(), scratch starts as NaN: catches ordering bugs.
    return pltpu.InterpretParams(dma_execution_mode="on_wait", detect_races=True)


def _decode(impl, q, k_pages, v_pages, block_tables, kv_lens, scale, opts):
    """q [S, H, D] through a Pallas decode kernel (quantized pages with their scales);
    opts: dict(sliding_window=..., soft_cap=...)."""
    (k, k_scales), (v, v_scales) = kv_quant.split(k_pages), kv_quant.split(v_pages)
    if impl.startswith("pallas_tpu"):
        interpret = _tpu_interpret() if impl.endswith("interpret") else False
        return paged_decode_attention_tpu(q, k, v, block_tables, kv_lens, scale=scale, interpret=interpret,
                                          k_scales=k_scales, v_scales=v_scales, **opts)
    return paged_decode_attention_gpu(q, k, v, block_tables, kv_lens, scale=scale,
                                      interpret=impl.endswith("interpret"), k_scales=k_scales, v_scales=v_scales,
                                      **opts)


def _prefill(impl, q, k_pages, v_pages, block_tables, kv_lens, q_lens, scale, opts):
    """q [S, Q, H, D], Q > 1, through a Pallas prefill kernel (quantized pages with their scales)."""
    (k, k_scales), (v, v_scales) = kv_quant.split(k_pages), kv_quant.split(v_pages)
    if impl.startswith("pallas_tpu"):
        interpret = _tpu_interpret() if impl.endswith("interpret") else False
        return paged_prefill_attention_tpu(q, k, v, block_tables, kv_lens, q_lens, scale=scale,
                                           interpret=interpret, k_scales=k_scales, v_scales=v_scales, **opts)
    return paged_prefill_attention_gpu(q, k, v, block_tables, kv_lens, q_lens, scale=scale,
                                       interpret=impl.endswith("interpret"), k_scales=k_scales, v_scales=v_scales,
                                       **opts)


def _xla(name, q, k_pages, v_pages, block_tables, kv_lens, q_lens, scale, opts):
    fn = {"reference": reference.paged_attention_reference,
          "chunked": reference.paged_attention_chunked,
          "ragged": ragged.paged_attention_ragged,
          "native": cpu_native.paged_attention_native}[name]
    return fn(q, k_pages, v_pages, block_tables, kv_lens, q_lens, scale=scale, **opts)


def _scale(scale, d):
    return 1.0 / math.sqrt(d) if scale is None else scale


def _options(sliding_window, soft_cap):
    w, c = _check_options(sliding_window, soft_cap)
    return dict(sliding_window=w, soft_cap=c)


def paged_attention(q, k_pages, v_pages, block_tables, kv_lens, q_lens, *, scale=None,
                    impl="auto", sliding_window=None, soft_cap=None):
    """q [S, Q, H, D] -> [S, Q, H, D]; see reference.py for the layout and semantics
    (sliding_window, soft_cap: static options, see the module doc)."""
    _check_rank("q", q, 4, "[S, Q, H, D]")
    _validate(q, k_pages, v_pages, block_tables, kv_lens, q_lens, impl)
    opts = _options(sliding_window, soft_cap)
    scale = _scale(scale, q.shape[-1])
    name = _resolve(impl, q.dtype, k_pages.shape[2], k_pages.dtype)
    if name in _XLA_IMPLS:
        return _xla(name, q, k_pages, v_pages, block_tables, kv_lens, q_lens, scale, opts)
    if q.shape[1] > 1:
        return _prefill(name, q, k_pages, v_pages, block_tables, kv_lens, q_lens, scale, opts)
    lens = jnp.where(q_lens > 0, kv_lens, 0)  # an empty query slot outputs zeros
    return _decode(name, q[:, 0], k_pages, v_pages, block_tables, lens, scale, opts)[:, None]


PACKED_ROW_TOKENS = 16  # query tokens per row when a packed step runs on a padded backend


def packed_paged_attention(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, *, scale=None,
                           impl="auto", sliding_window=None, soft_cap=None):
    """Packed layout: q [T, H, D] -> [T, H, D]; see packed.py for the layout and semantics.

    "native" and "reference" take the packed layout as it is. The other backends take
    padded rows (packed.to_rows): one row per token when the step has no more tokens than
    sequences (decode-like: the decode kernels), else rows of PACKED_ROW_TOKENS tokens.
    """
    _check_rank("q", q, 3, "[T, H, D]")
    _check_rank("cu_q_lens", cu_q_lens, 1, "[S + 1]")
    _check_int32("cu_q_lens", cu_q_lens)
    t, h, d = q.shape
    s = block_tables.shape[0] if len(block_tables.shape) == 2 else 0
    if cu_q_lens.shape[0] != s + 1:
        raise ValueError(f"cu_q_lens must have S + 1 = {s + 1} entries, got {cu_q_lens.shape[0]}")
    _validate(jax.ShapeDtypeStruct((s, 1, h, d), q.dtype), k_pages, v_pages, block_tables, kv_lens, None, impl)
    opts = _options(sliding_window, soft_cap)
    scale = _scale(scale, d)
    name = _resolve(impl, q.dtype, k_pages.shape[2], k_pages.dtype)
    if name == "native":
        return cpu_native.packed_attention_native(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens[:-1],
                                                  cu_q_lens[1:] - cu_q_lens[:-1], scale=scale, **opts)
    if name == "reference":
        return packed.packed_attention_reference(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens,
                                                 scale=scale, **opts)
    tile = 1 if t <= s else PACKED_ROW_TOKENS
    q_rows, tables, row_kv, row_q, token_row, token_slot = packed.to_rows(q, block_tables, kv_lens, cu_q_lens,
                                                                          tile)
    if name in _XLA_IMPLS:
        out = _xla(name, q_rows, k_pages, v_pages, tables, row_kv, row_q, scale, opts)
    elif tile > 1:
        out = _prefill(name, q_rows, k_pages, v_pages, tables, row_kv, row_q, scale, opts)
    else:
        out = _decode(name, q_rows[:, 0], k_pages, v_pages, tables, jnp.where(row_q > 0, row_kv, 0), scale,
                      opts)[:, None]
    return packed.from_rows(out, token_row, token_slot)


def paged_decode_attention(q, k_pages, v_pages, block_tables, kv_lens, *, scale=None,
                           impl="auto", sliding_window=None, soft_cap=None):
    """One query token per sequence: q [S, H, D] -> [S, H, D]."""
    _check_rank("q", q, 3, "[S, H, D]")
    s, h, d = q.shape
    q4 = jax.ShapeDtypeStruct((s, 1, h, d), q.dtype)  # shape-only view as [S, 1, H, D]
    _validate(q4, k_pages, v_pages, block_tables, kv_lens, None, impl)
    opts = _options(sliding_window, soft_cap)
    scale = _scale(scale, q.shape[-1])
    name = _resolve(impl, q.dtype, k_pages.shape[2], k_pages.dtype)
    if name in _XLA_IMPLS:
        q_lens = jnp.ones(q.shape[:1], jnp.int32)
        return _xla(name, q[:, None], k_pages, v_pages, block_tables, kv_lens, q_lens,
                    scale, opts)[:, 0]
    return _decode(name, q, k_pages, v_pages, block_tables, kv_lens, scale, opts)


def write_kv(k_pages, v_pages, k, v, slot_mapping):
    """Scatter k, v [T, Hkv, D] into their slots (slot_mapping [T] int32, -1 = drop), cast to
    the pages' dtype. bf16 pages on CPU go through the native in-place write (cpu_native.py)."""
    _check_rank("k_pages", k_pages, 4, "[Hkv, NB, BS, D]")
    _check_rank("k", k, 3, "[T, Hkv, D]")
    _check_rank("slot_mapping", slot_mapping, 1, "[T]")
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages and v_pages shapes differ: {k_pages.shape} vs {v_pages.shape}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {k.shape} vs {v.shape}")
    hkv, _, _, d = k_pages.shape
    if k.shape[1:] != (hkv, d):
        raise ValueError(f"k must be [T, {hkv}, {d}] to match the pages, got {k.shape}")
    if slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries "
                         f"for {k.shape[0]} tokens")
    _check_int32("slot_mapping", slot_mapping)
    if not kv_quant.is_quantized(k_pages.dtype):
        _check_float("k_pages", k_pages)
    _check_float("k", k)
    if cpu_native.native_write_supported(k_pages.dtype):  # in place; XLA:CPU would widen the pool
        return cpu_native.write_kv_native(k_pages, v_pages, k, v, slot_mapping)
    return reference.write_kv(k_pages, v_pages, k, v, slot_mapping)
