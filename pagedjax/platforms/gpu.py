"""GPU backends (XLA:GPU: CUDA, ROCm): Pallas GPU kernels, layers under scan, no conditional
the host would wait on, the KV budget from the device's free memory."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pagedjax.pallas_kernels.paged_attention.ops import GPU_BACKENDS  # noqa: F401  (jax's names for GPUs)
from pagedjax.platforms.base import Platform

MIN_BF16_CAPABILITY = 8.0  # Ampere: bf16 tensor cores


@dataclass(frozen=True)
class GpuPlatform(Platform):
    backend: str = "gpu"

    name: ClassVar[str] = "gpu"
    select_conditionals: ClassVar[bool] = True  # XLA:GPU runs a conditional from the host

    @property
    def fast_bf16(self) -> bool:
        """Compute capability 8.0 or newer (CUDA); ROCm and an unknown capability: yes."""
        capability = getattr(self.device(), "compute_capability", None)  # CUDA: "8.0", "9.0", ...
        try:
            return capability is None or float(capability) >= MIN_BF16_CAPABILITY
        except (TypeError, ValueError):
            return True
