"""Skinny bfloat16 matmul for the CPU backend: cpu_matmul.cc through the XLA FFI.

`matmul_bf16(x, w)`: x [M, I] float32, w [O, I] bfloat16 (a model's [out, in] layout) ->
[M, O] float32, the same as `matmul_bf16_reference` (x rounded to bf16, products and sums
in float32; the order of the sums differs, so results agree to float32 rounding). It serves
decode-sized M, where XLA:CPU's library dot reads the weights at a fraction of the memory
bandwidth; `supported(m, i, o)` says whether it takes a shape. Needs a CPU with AVX512-BF16
and a C++ compiler (built at first use, pallas_kernels/native_build.py);
PAGEDJAX_NATIVE_MATMUL=0 turns it off.

    y = matmul_bf16(jnp.ones((16, 576)), w)   # w: [1536, 576] bfloat16 -> y [16, 1536]
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

import jax
import jax.numpy as jnp

from pallas_kernels import native_build

_SOURCE = Path(__file__).with_name("cpu_matmul.cc")
_TARGET, _SYMBOL = "pagedjax_matmul_bf16", "MatmulBF16"
MAX_ROWS = 32  # larger M: XLA's dot (both are compute-bound there; XLA tiles it better)
log = logging.getLogger(__name__)


def _cpu_has_avx512_bf16() -> bool:
    return "avx512_bf16" in native_build.cpu_signature().split()


@functools.cache
def available() -> bool:
    """True when the kernel is built and registered with XLA (at most one build per process)."""
    if os.environ.get("PAGEDJAX_NATIVE_MATMUL", "1") == "0" or not _cpu_has_avx512_bf16():
        return False
    try:
        lib = ctypes.cdll.LoadLibrary(str(native_build.build(_SOURCE)))
        jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(getattr(lib, _SYMBOL)), platform="cpu")
    except (OSError, RuntimeError, AttributeError) as e:
        log.warning("native CPU bf16 matmul unavailable, using XLA's dot: %s", e)
        return False
    return True


def supported(m: int, i: int, o: int) -> bool:
    """The kernel serves x [m, i] . w [o, i]^T here: CPU backend, m <= MAX_ROWS, i % 32 == 0,
    o % 4 == 0, kernel built."""
    return (0 < m <= MAX_ROWS and i % 32 == 0 and o % 4 == 0 and jax.default_backend() == "cpu"
            and available())


def matmul_bf16(x, w):
    """x [M, I] float32 (or bf16), w [O, I] bfloat16 -> [M, O] float32; needs `supported`."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1] or jnp.dtype(w.dtype) != jnp.bfloat16:
        raise ValueError(f"matmul_bf16: x [M, I] and w [O, I] bfloat16, got {x.shape} {x.dtype}, {w.shape} {w.dtype}")
    if not available():
        raise RuntimeError("matmul_bf16 needs a CPU with AVX512-BF16 and a C++ compiler (see available())")
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32),
                            vmap_method="sequential")
    return call(x.astype(jnp.float32), w)


def matmul_bf16_reference(x, w):
    """What matmul_bf16 computes, in jnp."""
    return jnp.einsum("mi,oi->mo", x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)
