"""bfloat16 matmul for the CPU backend: cpu_matmul.cc through the XLA FFI.

`matmul_bf16(x, w)`: x [M, I] float32, w [O, I] bfloat16 (a model's [out, in] layout) ->
[M, O] float32, the same as `matmul_bf16_reference` (x rounded to bf16, products and sums
in float32; the order of the sums differs, so results agree to float32 rounding).
`supported(m, i, o)` says whether it takes a shape. Two paths:
- AMX tiles (Intel Sapphire Rapids and later, `amx_available()`): any M; O a multiple of 16.
  Decode-sized M reads the weights at memory speed, prompt-sized M runs at several times the
  compute XLA:CPU's dot reaches.
- AVX512-BF16 otherwise: decode-sized M (at most MAX_ROWS rows), where XLA:CPU's library dot
  reads the weights at a fraction of the memory bandwidth.
Needs a C++ compiler (built at first use, pallas_kernels/native_build.py).
PAGEDJAX_NATIVE_MATMUL=0 turns the kernel off, PAGEDJAX_AMX=0 its AMX path.

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
MAX_ROWS = 32  # AVX512-BF16 path; larger M: XLA's dot (both are compute-bound there; XLA tiles it better)
AMX_MAX_ROWS = 64  # what `supported` offers the AMX path; larger M: XLA's dot, which uses AMX too and
#                    tiles prompt-sized shapes better (scripts/bench_matmul.py: even at ~96 rows)
log = logging.getLogger(__name__)
_lib: list = []  # the loaded library (amx_available asks it)


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
    _lib.append(lib)
    return True


@functools.cache
def amx_available() -> bool:
    """True when the kernel is built and Linux grants this process the AMX tile state."""
    if os.environ.get("PAGEDJAX_AMX", "1") == "0" or not available():
        return False
    return bool(_lib[0].PagedjaxAmxReady())


def supported(m: int, i: int, o: int) -> bool:
    """The kernel serves x [m, i] . w [o, i]^T here: CPU backend, kernel built, i % 32 == 0,
    and with AMX o % 16 == 0 and m <= AMX_MAX_ROWS, else m <= MAX_ROWS and o % 4 == 0."""
    if m <= 0 or i % 32 != 0 or jax.default_backend() != "cpu" or not available():
        return False
    if o % 16 == 0 and amx_available():
        return m <= AMX_MAX_ROWS
    return m <= MAX_ROWS and o % 4 == 0


def matmul_bf16(x, w, amx: bool | None = None):
    """x [M, I] float32 (or bf16), w [O, I] bfloat16 -> [M, O] float32; needs `supported`.
    amx: force the AMX (True) or AVX512-BF16 (False) path; None picks AMX where it serves."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1] or jnp.dtype(w.dtype) != jnp.bfloat16:
        raise ValueError(f"matmul_bf16: x [M, I] and w [O, I] bfloat16, got {x.shape} {x.dtype}, {w.shape} {w.dtype}")
    if not available():
        raise RuntimeError("matmul_bf16 needs a CPU with AVX512-BF16 and a C++ compiler (see available())")
    m, (o, i) = x.shape[0], w.shape
    if amx is None:
        amx = o % 16 == 0 and amx_available()
    if amx and not amx_available():
        raise RuntimeError("matmul_bf16(amx=True): this CPU or kernel offers no AMX (see amx_available())")
    if i % 32 or o % (16 if amx else 4) or (not amx and m > MAX_ROWS):
        raise ValueError(f"matmul_bf16: shape x {x.shape}, w {w.shape} not served by the "
                         f"{'AMX' if amx else 'AVX512-BF16'} path (see supported())")
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((m, o), jnp.float32), vmap_method="sequential")
    return call(x.astype(jnp.float32), w, amx=amx)


def matmul_bf16_reference(x, w):
    """What matmul_bf16 computes, in jnp."""
    return jnp.einsum("mi,oi->mo", x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)
