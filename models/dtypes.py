"""Which dtypes a model and its KV cache use.

`dtype` (the model's matrices; activations, norms and softmax stay float32, see models.llama):
  "auto"      bfloat16 where the hardware runs bf16 dots natively (TPU; GPU of compute
              capability 8.0 or newer; CPU with AVX512-BF16 or AMX-BF16 in /proc/cpuinfo),
              float32 elsewhere. PAGEDJAX_AUTO_DTYPE=float32 (or bfloat16) pins what "auto"
              means, e.g. for tests that compare with float32 transformers token for token.
              The platform decides (pagedjax.platforms: Platform.auto_dtype, fast_bf16).
  "bfloat16", "float32", "float16"
`kv_cache_dtype`: "auto" (the model dtype; float32 for a float16 model: the kernels take
float32 or bfloat16 pages), "bfloat16" or "float32"; "int8" or "fp8" (e4m3): 8-bit pages with a
float16 scale per token and KV head (pallas_kernels/paged_attention/kv_quant.py), ~2x the tokens.
"""
from __future__ import annotations

import jax.numpy as jnp

from pagedjax.platforms import AUTO_DTYPE_ENV, current_platform, get_platform  # noqa: F401  (AUTO_DTYPE_ENV re-exported)
from pagedjax.platforms.cpu import cpu_flags  # noqa: F401  (re-exported)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "int8", "fp8")
QUANTIZED_KV_CACHE_DTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}  # pallas_kernels/paged_attention/kv_quant.py


def check_dtype(dtype: str) -> None:
    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")


def has_fast_bf16(backend: str | None = None) -> bool:
    """True where bf16 dots run natively: TPU, GPU (compute capability >= 8.0; ROCm: yes),
    CPU with AVX512-BF16 or AMX-BF16 (backend None: this process's; see pagedjax.platforms)."""
    return (get_platform(backend) if backend else current_platform()).fast_bf16


def auto_dtype() -> str:
    """What dtype="auto" means here: PAGEDJAX_AUTO_DTYPE if set, else by the hardware."""
    return current_platform().auto_dtype


def resolve_dtype(dtype: str, cfg=None):
    """'auto' or a dtype name -> the jnp dtype of the model's matrices. (cfg: unused, kept for
    callers that pass the model config.)"""
    del cfg
    check_dtype(dtype)
    return jnp.dtype(DTYPES[auto_dtype() if dtype == "auto" else dtype])


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype):
    """'auto' -> the model dtype (float32 for float16); 'bfloat16' / 'float32' -> that;
    'int8' -> int8, 'fp8' -> float8_e4m3fn (the quantized pages' storage)."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype == "auto":
        return jnp.dtype(jnp.bfloat16 if jnp.dtype(model_dtype) == jnp.bfloat16 else jnp.float32)
    return jnp.dtype(QUANTIZED_KV_CACHE_DTYPES.get(kv_cache_dtype) or DTYPES[kv_cache_dtype])
