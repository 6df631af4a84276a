"""The TPU backend: Pallas Mosaic kernels, native bf16, layers under scan, the KV budget from
the device's free memory. Conditionals branch on the TPU's scalar core (no host wait), but
the CPU-measured skips (models.lora, block copies) stay off: they were never measured here."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pagedjax.platforms.base import Platform


@dataclass(frozen=True)
class TpuPlatform(Platform):
    backend: str = "tpu"

    name: ClassVar[str] = "tpu"
