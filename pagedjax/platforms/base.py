"""`Platform`: every "which backend am I on" decision of the engine, answered in one place.

One subclass per backend family (cpu.py, gpu.py, tpu.py); this base holds the defaults of an
XLA accelerator (what any backend other than the CPU got before the platform object existed),
so an unknown backend (a plugin) behaves as it always did. A decision that also depends on
the mesh, a dtype or a shape takes those as arguments or stays at its call site; the platform
answers the backend's part. Policy attributes are class constants; what needs the hardware
(CPU flags, device memory, native kernels) is read when asked, so a platform built by name
on other hardware (tests: `get_platform("tpu")` on a CPU) answers without touching it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import jax

AUTO_DTYPE_ENV = "PAGEDJAX_AUTO_DTYPE"  # pins what dtype="auto" means ("float32" or "bfloat16", ...)
MIN_STEP_TOKENS_ENV = "PAGEDJAX_MIN_STEP_TOKENS"  # pins the smallest step rung (a power of two, 1-16)
DTYPE_NAMES = ("bfloat16", "float16", "float32")
COMPILE_CACHE_ENV = "PAGEDJAX_COMPILE_CACHE"  # "0": no persistent compilation cache
CPU_KV_BUDGET_BYTES = 2 << 30  # default KV memory on the CPU backend
ACCELERATOR_KV_FRACTION = 0.8  # of the device memory left after weights
UNKNOWN_DEVICE_BYTES = 16 << 30  # a device that reports no memory limit


@dataclass(frozen=True)
class Platform:
    """A backend's answers. `backend`: jax.default_backend()'s name for it ("cpu", "cuda",
    "rocm", "gpu", "tpu", or a plugin's). Read it through `current_platform()`."""

    backend: str = "other"

    name: ClassVar[str] = "other"  # the family: "cpu", "gpu", "tpu"; "other" for plugins
    scan_layers: ClassVar[bool] = True  # models.loader: layers under one jax.lax.scan (fast compiles)
    moe_impl: ClassVar[str] = "ragged"  # models.moe: what impl="auto" runs (a grouped matmul)
    # sample.select_cond: a conditional makes the host wait for the device (XLA:GPU runs it
    # from the host), so both branches are computed and selected; pallas dense attention also
    # walks whole slots there (its own lowering, pallas_kernels/dense_attention.py)
    select_conditionals: ClassVar[bool] = False
    # models.lora.delta, models.kv_cache.copy_blocks: unused work skipped by a conditional or a
    # loop whose trip count is read on the device (measured to pay on XLA:CPU only); elsewhere
    # the work is computed at once, with no device-read predicate
    skip_by_conditional: ClassVar[bool] = False
    # models.llama.rope_table_once: how a value computed once per step is kept out of the
    # layers' fusions: "optimization_barrier", or "conditional" where XLA removes barriers (CPU)
    fusion_barrier: ClassVar[str] = "optimization_barrier"
    precise_f32_dots: ClassVar[bool] = True  # float32 matmuls ask Precision.HIGHEST (else TF32 / bf16 passes)
    lora_width: ClassVar[int] = 1  # models.lora.stack_shape: slots * rank padded to a multiple of this
    # core.buckets: the smallest step rung (EngineConfig.min_step_tokens overrides): a step of one
    # token costs an accelerator what a step of eight does
    min_step_tokens: ClassVar[int] = 8
    compile_cache_min_secs: ClassVar[float] = 0.0  # keep every executable (JAX's default keeps those over 1 s)

    # -- dtype -----------------------------------------------------------------------------
    @property
    def fast_bf16(self) -> bool:
        """bf16 dots run natively (the accelerators' default answer)."""
        return True

    @property
    def auto_dtype(self) -> str:
        """What dtype="auto" means: $PAGEDJAX_AUTO_DTYPE if set, else bfloat16 where bf16
        dots run natively, float32 elsewhere."""
        pinned = os.environ.get(AUTO_DTYPE_ENV)
        if pinned:
            if pinned not in DTYPE_NAMES:
                raise ValueError(f"{AUTO_DTYPE_ENV} must be one of {sorted(DTYPE_NAMES)}, got {pinned!r}")
            return pinned
        return "bfloat16" if self.fast_bf16 else "float32"

    def smallest_step(self, dtype=None) -> int:
        """The smallest step rung in tokens for a model of weights in `dtype` (core.buckets;
        EngineConfig.min_step_tokens overrides): $PAGEDJAX_MIN_STEP_TOKENS if set, else
        `default_step(dtype)`."""
        pinned = os.environ.get(MIN_STEP_TOKENS_ENV)
        if not pinned:
            return self.default_step(dtype)
        if not pinned.isdigit() or int(pinned) not in (1, 2, 4, 8, 16):
            raise ValueError(f"{MIN_STEP_TOKENS_ENV} must be a power of two from 1 to 16, got {pinned!r}")
        return int(pinned)

    def default_step(self, dtype=None) -> int:
        """The smallest step rung unless pinned: `min_step_tokens`."""
        return self.min_step_tokens

    # -- kernels ---------------------------------------------------------------------------
    def attention_impl(self, q_dtype, page_size: int, page_dtype) -> str:
        """The paged attention implementation attention_impl="auto" runs for q and pages of
        these dtypes and this page size (pallas_kernels.paged_attention.ops.auto_impl, asked
        for this backend)."""
        from pagedjax.pallas_kernels.paged_attention.ops import auto_impl

        return auto_impl(self.backend, q_dtype, page_size, page_dtype)

    @property
    def attention(self) -> str:
        """attention_impl for the auto dtype's q and pages in 16-token blocks (the default)."""
        return self.attention_impl(self.auto_dtype, 16, self.auto_dtype)

    def native_kernels(self) -> tuple[str, ...]:
        """The native (C++ through the XLA FFI) kernels usable here: none off the CPU."""
        return ()

    def native_matmul(self, dtype) -> bool:
        """Decode-sized matmuls of weights in `dtype` may go to a native kernel (one device:
        the caller checks the mesh; the kernel's `supported` checks each shape)."""
        return False

    def native_head(self, dtype) -> bool:
        """The vocab head of `dtype` too (where the native kernel beats XLA's dot on it)."""
        return False

    # -- memory ----------------------------------------------------------------------------
    def device(self):
        """The first device of this backend, or None where this process has none."""
        try:
            return jax.devices(self.backend)[0]
        except RuntimeError:
            return None

    def memory_stats(self) -> dict:
        device = self.device()
        return (device.memory_stats() if device is not None else None) or {}

    def memory_bytes(self) -> int | None:
        """Memory of one device (None where it reports none)."""
        return self.memory_stats().get("bytes_limit")

    def kv_budget_bytes(self, weight_bytes: int, tensor_parallel_size: int = 1) -> int:
        """The KV cache's default memory (EngineConfig.kv_cache_memory_gb unset), over the
        tensor-parallel devices: ACCELERATOR_KV_FRACTION of what one device has left after
        its share of the weights (weight_bytes), times the devices."""
        stats = self.memory_stats()
        free = stats.get("bytes_limit", UNKNOWN_DEVICE_BYTES) - stats.get("bytes_in_use", 0) - weight_bytes
        return int(max(free, 0) * ACCELERATOR_KV_FRACTION) * tensor_parallel_size

    # -- compile cache ---------------------------------------------------------------------
    def compile_cache_dir(self) -> str | None:
        """Where compiled executables persist (None: $PAGEDJAX_COMPILE_CACHE=0, off): the
        user's JAX compilation cache dir if set, else $PAGEDJAX_CACHE/jax_compilation_cache
        (default ~/.cache/pagedjax)."""
        if os.environ.get(COMPILE_CACHE_ENV, "1") == "0":
            return None
        if jax.config.jax_compilation_cache_dir:
            return jax.config.jax_compilation_cache_dir
        root = Path(os.environ.get("PAGEDJAX_CACHE") or Path.home() / ".cache" / "pagedjax")
        return str(root / "jax_compilation_cache")

    # -- reports ---------------------------------------------------------------------------
    def device_name(self) -> str:
        device = self.device()
        return getattr(device, "device_kind", None) or self.backend

    def hardware(self) -> list[str]:
        """describe()'s words on the hardware, after the device name."""
        memory = self.memory_bytes()
        return [f"{memory / 2**30:.1f} GiB"] if memory else []

    def as_dict(self) -> dict:
        """Every decision, by name (JSON-ready)."""
        return {"name": self.name, "backend": self.backend, "device": self.device_name(),
                "memory_bytes": self.memory_bytes(), "fast_bf16": self.fast_bf16, "dtype_auto": self.auto_dtype,
                "attention": self.attention, "scan_layers": self.scan_layers, "moe_impl": self.moe_impl,
                "native_kernels": list(self.native_kernels()), "select_conditionals": self.select_conditionals,
                "skip_by_conditional": self.skip_by_conditional, "fusion_barrier": self.fusion_barrier,
                "precise_f32_dots": self.precise_f32_dots, "lora_width": self.lora_width,
                "min_step_tokens": self.smallest_step(),
                "compile_cache_dir": self.compile_cache_dir(), "compile_cache_min_secs": self.compile_cache_min_secs}

    def describe(self) -> str:
        """One line: "cpu: AMD EPYC 9R14 (2 cores, 7.6 GiB, AVX512-BF16 AVX2), native kernels
        bf16-matmul attention, dtype auto=float32, attention=native, scan=off, moe=sorted".
        Kept once made (LLMEngine.stats() reads it every step), until $PAGEDJAX_AUTO_DTYPE or
        $PAGEDJAX_MIN_STEP_TOKENS changes."""
        pin = (os.environ.get(AUTO_DTYPE_ENV), os.environ.get(MIN_STEP_TOKENS_ENV))
        kept = self.__dict__.get("_description")  # frozen: written past __setattr__, not a field
        if kept is None or kept[0] != pin:
            kept = self.__dict__["_description"] = (pin, self._describe())
        return kept[1]

    def _describe(self) -> str:
        hardware = ", ".join(self.hardware())
        kernels = " ".join(self.native_kernels())
        parts = [f"{self.name}: {self.device_name()}" + (f" ({hardware})" if hardware else "")]
        if kernels:
            parts.append(f"native kernels {kernels}")
        parts += [f"dtype auto={self.auto_dtype}", f"attention={self.attention}",
                  f"scan={'on' if self.scan_layers else 'off'}", f"moe={self.moe_impl}",
                  f"smallest step={self.smallest_step()}"]
        return ", ".join(parts)
