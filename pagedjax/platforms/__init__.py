"""One object per backend that answers every "which backend am I on" question of the engine
(dtype "auto", attention implementation, scan, MoE implementation, native kernels, compile
cache, memory budget), so each backend's choices are read in one place:

    from pagedjax.platforms import current_platform
    p = current_platform()          # CpuPlatform, GpuPlatform or TpuPlatform (cached per backend)
    p.scan_layers, p.moe_impl, p.auto_dtype, p.attention_impl(q_dtype, page_size, page_dtype)
    print(p.describe())             # "cpu: AMD EPYC ... (2 cores, ...), ..., scan=off, moe=sorted"
    get_platform("tpu").scan_layers  # a named backend's answers, without its hardware (tests)

Outside this package nothing asks jax.default_backend() except the kernels in pallas_kernels
choosing their own lowering (docs/design/platforms.md lists them).
"""
from __future__ import annotations

import jax

from pagedjax.platforms.base import (ACCELERATOR_KV_FRACTION, AUTO_DTYPE_ENV, COMPILE_CACHE_ENV, CPU_KV_BUDGET_BYTES,
                                     Platform)
from pagedjax.platforms.cpu import CpuPlatform, cpu_flags
from pagedjax.platforms.gpu import GPU_BACKENDS, GpuPlatform
from pagedjax.platforms.tpu import TpuPlatform

__all__ = ["ACCELERATOR_KV_FRACTION", "AUTO_DTYPE_ENV", "COMPILE_CACHE_ENV", "CPU_KV_BUDGET_BYTES", "CpuPlatform",
           "GpuPlatform", "Platform", "TpuPlatform", "cpu_flags", "current_platform", "get_platform"]

_KINDS = {"cpu": CpuPlatform, "tpu": TpuPlatform, **{name: GpuPlatform for name in GPU_BACKENDS}}
_cache: dict[str, Platform] = {}


def get_platform(backend: str) -> Platform:
    """The platform of a backend by jax's name for it ("cpu", "gpu", "cuda", "rocm", "tpu"),
    whatever this process runs on (its hardware is read only when a decision needs it)."""
    if backend not in _KINDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {sorted(_KINDS)}")
    return _platform(backend)


def current_platform() -> Platform:
    """The platform of jax.default_backend(), read now (cached per backend name); a backend
    pagedjax does not know gets the base Platform (an XLA accelerator's defaults)."""
    return _platform(jax.default_backend())


def _platform(backend: str) -> Platform:
    platform = _cache.get(backend)
    if platform is None:
        platform = _cache[backend] = _KINDS.get(backend, Platform)(backend=backend)
    return platform
