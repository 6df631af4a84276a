"""The CPU backend (XLA:CPU): native C++ kernels where the CPU's features allow, layers
unrolled, conditionals that skip work, a fixed KV budget."""
from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import jax.numpy as jnp

from pagedjax.platforms.base import CPU_KV_BUDGET_BYTES, Platform

FAST_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # bf16 dots in hardware
# /proc/cpuinfo flags describe() names, in its order
FEATURES = {"amx_bf16": "AMX-BF16", "avx512_bf16": "AVX512-BF16", "avx512_vnni": "AVX512-VNNI", "avx2": "AVX2"}


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of /proc/cpuinfo (empty where there is none)."""
    line = next((x for x in _cpuinfo().splitlines() if x.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


@functools.cache
def cpu_model() -> str:
    """/proc/cpuinfo's model name ("AMD EPYC 9R14 96-Core Processor"), else the machine's."""
    line = next((x for x in _cpuinfo().splitlines() if x.startswith("model name")), "")
    return line.partition(":")[2].strip() or platform.processor() or platform.machine() or "cpu"


def num_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def host_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


@dataclass(frozen=True)
class CpuPlatform(Platform):
    """flags: the CPU feature flags to answer for (tests); None reads /proc/cpuinfo."""

    backend: str = "cpu"
    flags: frozenset[str] | None = None

    name: ClassVar[str] = "cpu"
    scan_layers: ClassVar[bool] = False  # XLA:CPU steps faster unrolled (models.llama.CausalLM)
    moe_impl: ClassVar[str] = "sorted"  # jax.lax.ragged_dot is a slow generic loop on XLA:CPU
    skip_by_conditional: ClassVar[bool] = True  # the host drives XLA:CPU: a branch costs nothing
    fusion_barrier: ClassVar[str] = "conditional"  # XLA:CPU removes optimization barriers before it fuses
    precise_f32_dots: ClassVar[bool] = False  # XLA:CPU computes f32 dots in f32 anyway
    lora_width: ClassVar[int] = 32  # the native kernels' bf16 contraction width
    # a step costs what its padded rows cost (the native GEMV tiles take 1, 2, 4 or 8 rows): rungs
    # of 1, 2 and 4 tokens for small decode batches (scripts/decode_floor.py)
    min_step_tokens: ClassVar[int] = 1

    def default_step(self, dtype=None) -> int:
        """1 (`min_step_tokens`), but 8 for float32 weights: an engine with float32 steps of 1,
        2 and 4 tokens ran its 32-token steps ~1.6x slower (the mixed workload of
        scripts/bench_workload.py, 2-core AMD EPYC, 2026-12-07; bf16 unchanged), and f32 decode
        gains little from them."""
        if dtype is not None and jnp.dtype(dtype) == jnp.float32:
            return 8
        return self.min_step_tokens

    @property
    def features(self) -> frozenset[str]:
        return self.flags if self.flags is not None else cpu_flags()

    @property
    def fast_bf16(self) -> bool:
        """AVX512-BF16 or AMX-BF16."""
        return any(f in self.features for f in FAST_BF16_FLAGS)

    def native_kernels(self) -> tuple[str, ...]:
        """The native kernels built and registered here (the first call builds them; see
        pallas_kernels/native_build.py): "amx-bf16-matmul", "bf16-matmul" (AVX512-BF16),
        "avx2-matmul" (bf16 / f32 weights), "int8-matmul" (AVX512-VNNI), "fp8-matmul", "attention"."""
        from pagedjax.pallas_kernels import cpu_matmul
        from pagedjax.pallas_kernels.paged_attention import cpu_native

        probes = (("amx-bf16-matmul", cpu_matmul.amx_available), ("bf16-matmul", cpu_matmul.available),
                  ("avx2-matmul", cpu_matmul.avx2_available), ("int8-matmul", cpu_matmul.int8_available),
                  ("fp8-matmul", cpu_matmul.fp8_available), ("attention", cpu_native.available))
        return tuple(name for name, available in probes if available())

    def native_matmul(self, dtype) -> bool:
        """bf16 weights (AMX, AVX512-BF16 or AVX2) and float32 weights (AVX2)."""
        return jnp.dtype(dtype) in (jnp.bfloat16, jnp.float32)

    def native_head(self, dtype) -> bool:
        """Wherever a kernel serves the dtype: XLA:CPU's dot widens a bf16 head to float32 on
        every call (SmolLM2's [49152, 576]: 170 MB written and read again per step), while the
        kernels (AMX, the AVX512-BF16 GEMV tiles, AVX2) stream it once (scripts/bench_matmul.py)."""
        return self.native_matmul(dtype)

    def memory_bytes(self) -> int | None:
        """The host's memory."""
        return host_memory_bytes()

    def kv_budget_bytes(self, weight_bytes: int, tensor_parallel_size: int = 1) -> int:
        """CPU_KV_BUDGET_BYTES, whatever the weights (the host's memory is shared with
        everything else on it)."""
        return CPU_KV_BUDGET_BYTES

    def device_name(self) -> str:
        return cpu_model()

    def hardware(self) -> list[str]:
        features = " ".join(v for k, v in FEATURES.items() if k in self.features)
        return [f"{num_cores()} cores", *super().hardware(), *([features] if features else [])]
