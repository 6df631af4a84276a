"""Which dtypes a model and its KV cache use.

`dtype` (the model's matrices; activations, norms and softmax stay float32, see models.llama):
  "auto"      bfloat16 where the hardware runs bf16 dots natively (TPU; GPU of compute
              capability 8.0 or newer; CPU with AVX512-BF16 or AMX-BF16 in /proc/cpuinfo),
              float32 elsewhere. PAGEDJAX_AUTO_DTYPE=float32 (or bfloat16) pins what "auto"
              means, e.g. for tests that compare with float32 transformers token for token.
  "bfloat16", "float32", "float16"
`kv_cache_dtype`: "auto" (the model dtype; float32 for a float16 model: the kernels take
float32 or bfloat16 pages), "bfloat16" or "float32"; "int8" or "fp8" (e4m3): 8-bit pages with a
float16 scale per token and KV head (pallas_kernels/paged_attention/kv_quant.py), ~2x the tokens.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import jax.numpy as jnp

AUTO_DTYPE_ENV = "PAGEDJAX_AUTO_DTYPE"
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "int8", "fp8")
QUANTIZED_KV_CACHE_DTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}  # pallas_kernels/paged_attention/kv_quant.py
_FAST_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def check_dtype(dtype: str) -> None:
    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def has_fast_bf16(backend: str | None = None) -> bool:
    """True where bf16 dots run natively: TPU, GPU (compute capability >= 8.0; ROCm: yes),
    CPU with AVX512-BF16 or AMX-BF16."""
    import jax

    backend = backend or jax.default_backend()
    if backend == "tpu":
        return True
    if backend == "cpu":
        return any(f in cpu_flags() for f in _FAST_BF16_CPU_FLAGS)
    capability = getattr(jax.devices()[0], "compute_capability", None)  # CUDA: "8.0", "9.0", ...
    try:
        return capability is None or float(capability) >= 8.0
    except (TypeError, ValueError):
        return True


def auto_dtype() -> str:
    """What dtype="auto" means here: PAGEDJAX_AUTO_DTYPE if set, else by the hardware."""
    pinned = os.environ.get(AUTO_DTYPE_ENV)
    if pinned:
        if pinned not in DTYPES:
            raise ValueError(f"{AUTO_DTYPE_ENV} must be one of {sorted(DTYPES)}, got {pinned!r}")
        return pinned
    return "bfloat16" if has_fast_bf16() else "float32"


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
