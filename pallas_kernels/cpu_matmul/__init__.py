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
`matmul_avx2(x, w)` (cpu_matmul_avx2.cc) serves CPUs with AVX2 and FMA but no AVX512-BF16 (AMD
Zen 2/3, older Intel), for bf16 weights (widened as read, x rounded to bf16 as above) and for
float32 weights on any such CPU: decode-sized M (AVX2_MAX_ROWS), where XLA:CPU's dot
ran several times slower than the weights stream in. `matmul(x, w)` picks the path for w's
dtype; `supported(m, i, o, dtype)` says whether one serves a shape.
`matmul_int8(x, w_q, w_scale)` (cpu_matmul_int8.cc, AVX512-VNNI) serves int8 weights (per
output channel, symmetric: w ~ w_q * w_scale[:, None]) at decode-sized M (INT8_MAX_ROWS): W8A8,
each row of x quantized on entry (x_scale = max|x[m]| / 127, x_q = round(x / x_scale), both
divisions as multiplications by the reciprocal), the integer dot on vpdpbusd (u8 x s8), then
both scales; bit for bit `matmul_int8_reference`. act_bits=16: x quantized per row to int16
instead (x_scale = max|x[m]| / 32767; relative error ~1.5e-5, the quality of weight-only int8),
the weights sign-extended to int16 as read, the dot on vpdpwssd (s16 pairs -> s32 lanes, exact
for I <= INT8_A16_MAX_IN), the 16 lanes summed in float32 by a fixed tree; also bit for bit
its reference.
`matmul_fp8(x, w_q, w_scale)` (cpu_matmul_fp8.cc, AVX512-BF16) serves float8_e4m3fn weights
with a float32 scale per output row at decode-sized M (FP8_MAX_ROWS): each 32 weights widened
to bf16 in registers (exact: every e4m3fn value is a bf16), x rounded to bf16, the dot on
vdpbf16ps in f32, then w_scale; `matmul_fp8_reference` up to the order of the f32 sums.
`matmul_int8_bf16(x, w_q, w_scale)` (the same source, the kernel templated on the weight
format) does the same for int8 weights: each 32 widened to bf16 in registers (exact: every
int8 is a bf16), x rounded to bf16, vdpbf16ps, then w_scale; `matmul_int8_bf16_reference` up
to the order of the f32 sums. For a bf16 model this loses nothing (its x is bf16 already) and
runs faster than the 16-bit-activation kernel (fewer instructions per product on a CPU where
vdpbf16ps and vpdpwssd take alike).
`matmul_quantized(x, w_q, w_scale, x_dtype=...)` picks the path for w_q's dtype and the
caller's compute dtype: int8 with x_dtype bfloat16 (the default): `matmul_int8_bf16` (where
AVX512-BF16 is missing: the 16-bit-activation kernel); int8 with x_dtype float32 (or float16):
`matmul_int8` with 16-bit activations (near-exact for a float32 model), or act_bits=8 when told;
float8_e4m3fn: `matmul_fp8` either way (x is rounded to bf16 there, whatever x_dtype says).
`supported(m, i, o, w_q.dtype)` says whether one serves a shape (for int8: both int8 kernels).
Needs a C++ compiler (built at first use, pallas_kernels/native_build.py).
PAGEDJAX_NATIVE_MATMUL=0 turns the kernels off, PAGEDJAX_AMX=0 the AMX path.

    y = matmul(jnp.ones((16, 576)), w)   # w: [1536, 576] bfloat16 or float32 -> y [16, 1536]
    y = matmul_quantized(jnp.ones((16, 576)), w_q, w_scale)   # w_q [1536, 576] int8, w_scale [1536]
    y = matmul_quantized(x, w_q, w_scale, x_dtype=jnp.float32)   # a float32 model: x as int16
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.pallas_kernels import native_build
from pagedjax.pallas_kernels.cpu_matmul.reference import (  # noqa: F401 (the kernels' jnp references)
    _check_act_bits, matmul_bf16_reference, matmul_fp8_reference, matmul_int8_bf16_reference, matmul_int8_reference)

_SOURCE = Path(__file__).with_name("cpu_matmul.cc")
_TARGET, _SYMBOL = "pagedjax_matmul_bf16", "MatmulBF16"
_AVX2_SOURCE = Path(__file__).with_name("cpu_matmul_avx2.cc")
_AVX2_TARGETS = {"float32": ("pagedjax_matmul_avx2_f32", "MatmulAvx2F32"),
                 "bfloat16": ("pagedjax_matmul_avx2_bf16", "MatmulAvx2BF16")}
# AVX2 path, by weight dtype; larger M: XLA's dot (scripts/bench_matmul.py on a 2-core AMD EPYC,
# layers + head: float32 at 16 rows 47 ms against XLA's 65, at 32 rows 77 against 91, at 48 rows
# 101 against 110, at 64 rows 132 against 136; bf16 at 16-64 rows 49-138 against 72-199)
AVX2_MAX_ROWS = {"bfloat16": 64, "float32": 48}
MAX_ROWS = 32  # AVX512-BF16 path; larger M: XLA's dot (both are compute-bound there; XLA tiles it better)
AMX_MAX_ROWS = 64  # what `supported` offers the AMX path; larger M: XLA's dot, which uses AMX too and
#                    tiles prompt-sized shapes better (scripts/bench_matmul.py: even at ~96 rows)
INT8_SOURCE = Path(__file__).with_name("cpu_matmul_int8.cc")
_INT8_TARGET, _INT8_SYMBOL = "pagedjax_matmul_int8", "MatmulInt8"
# int8 path (AVX512-VNNI); larger M: the caller's own dot. Set for 16-bit activations (what
# matmul_quantized runs; vpdpwssd does half the products of vpdpbusd, so it turns compute-bound
# sooner). 30-layer stack, wall ms (scripts/bench_matmul.py --dtype int8, 2-core AMD EPYC, Zen 4),
# int8-a16 / W8A8 / XLA's bf16 dot: 14.6 / 11.6 / 23.6 at 16 rows, 44 / 28 / 56 at 64,
# 158 / 93 / 82 at 128. (W8A8 alone was ahead of XLA to 256 rows by process CPU time.)
# The bf16-dot kernel (matmul_int8_bf16, what a bf16 model runs) under the same limit: int8-bf16 /
# int8-a16 / XLA's bf16 dot 84-87 / 84-87 / 106-108 at 64 rows, 38 / 35 / 47-60 at 16 (the same
# script, a contended 2-core Zen 4: within noise of each other, both ahead of XLA at every row count).
INT8_MAX_ROWS = 64
# act_bits=16: a lane of an s32 accumulator sums I / 32 pair products of at most 2 * 32767 * 128
# = 8388352 in magnitude, exact for I <= 8192 (256 * 8388352 = 2147418112 < 2^31); `supported`
# refuses larger I for int8 weights (matmul_quantized's default is 16-bit activations)
INT8_A16_MAX_IN = 8192
FP8_SOURCE = Path(__file__).with_name("cpu_matmul_fp8.cc")
_FP8_TARGET, _FP8_SYMBOL = "pagedjax_matmul_fp8", "MatmulFP8"
_INT8_BF16_TARGET, _INT8_BF16_SYMBOL = "pagedjax_matmul_int8_bf16", "MatmulInt8BF16"  # in FP8_SOURCE
# fp8 path (AVX512-BF16); larger M: the caller's dot. 30-layer stack, median wall ms
# (scripts/bench_matmul.py --dtype fp8, 2-core AMD EPYC, Zen 4), fp8 kernel / bf16 native kernel /
# XLA's bf16 dot on bf16 weights / XLA on the fp8 weights (x, w_q to bf16): 13.7 / 25.4 / 245 / 228
# at 1 row, 27.4 / 40.7 / 43.2 / 152 at 16, 47.0 / 59.8 / 62.5 / 169 at 32, 85.4 / - / 102 / 208 at 64.
FP8_MAX_ROWS = 64
HEAD_MAX_ROWS = 32  # AMX / AVX512-BF16 path on a wide vocab head: from ~48 rows XLA's dot (AMX too) is faster
log = logging.getLogger(__name__)


def _load(source: Path, targets, cpu_flags: set, what: str) -> ctypes.CDLL | None:
    """Build `source` and register its (target, symbol) pairs with XLA: the library, or None
    (with a warning when the build fails) where the CPU or compiler can't serve."""
    if os.environ.get("PAGEDJAX_NATIVE_MATMUL", "1") == "0" or not cpu_flags <= set(
            native_build.cpu_signature().split()):
        return None
    try:
        lib = ctypes.cdll.LoadLibrary(str(native_build.build(source)))
        for target, symbol in targets:
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    except (OSError, RuntimeError, AttributeError) as e:
        log.warning("native CPU %s matmul unavailable, using XLA's dot: %s", what, e)
        return None
    return lib


@functools.cache
def _bf16_lib() -> ctypes.CDLL | None:  # cached: one build per process, the library kept loaded
    return _load(_SOURCE, [(_TARGET, _SYMBOL)], {"avx512_bf16"}, "bf16")


@functools.cache
def _avx2_lib() -> ctypes.CDLL | None:
    return _load(_AVX2_SOURCE, _AVX2_TARGETS.values(), {"avx2", "fma"}, "AVX2")


@functools.cache
def _int8_lib() -> ctypes.CDLL | None:
    return _load(INT8_SOURCE, [(_INT8_TARGET, _INT8_SYMBOL)], {"avx512_vnni", "avx512bw"}, "int8")


@functools.cache
def _fp8_lib() -> ctypes.CDLL | None:
    return _load(FP8_SOURCE, [(_FP8_TARGET, _FP8_SYMBOL), (_INT8_BF16_TARGET, _INT8_BF16_SYMBOL)],
                 {"avx512_bf16", "avx512bw"}, "fp8 / int8-bf16")


def available() -> bool:
    """True when the AVX512-BF16 kernel is built and registered with XLA (one build per process)."""
    return _bf16_lib() is not None


def avx2_available() -> bool:
    """True when the AVX2 kernel is built and registered (a CPU with AVX2 and FMA)."""
    return _avx2_lib() is not None


def int8_available() -> bool:
    """True when the int8 kernel is built and registered (a CPU with AVX512-VNNI and -BW)."""
    return _int8_lib() is not None


def fp8_available() -> bool:
    """True when the float8_e4m3fn kernel is built and registered (a CPU with AVX512-BF16)."""
    return _fp8_lib() is not None


def int8_bf16_available() -> bool:
    """True when the int8-weight bf16-dot kernel is built and registered (the fp8 kernel's
    library: a CPU with AVX512-BF16)."""
    return _fp8_lib() is not None


@functools.cache
def amx_available() -> bool:
    """True when the kernel is built and Linux grants this process the AMX tile state."""
    if os.environ.get("PAGEDJAX_AMX", "1") == "0" or not available():
        return False
    return bool(_bf16_lib().PagedjaxAmxReady())


def supported(m: int, i: int, o: int, dtype=jnp.bfloat16) -> bool:
    """A kernel serves x [m, i] . w [o, i]^T, w in `dtype`, here (CPU backend, kernel built).
    bf16 with AVX512-BF16: i % 32 == 0, and with AMX o % 16 == 0 and m <= AMX_MAX_ROWS, else
    m <= MAX_ROWS and o % 4 == 0. Otherwise (float32 always) the AVX2 path: m at most
    AVX2_MAX_ROWS[dtype] and i % 8 == 0. int8 (w_q for `matmul_quantized`, any x_dtype and
    act_bits: every int8 kernel takes these): m <= INT8_MAX_ROWS, i % 64 == 0, i <= INT8_A16_MAX_IN,
    any o. float8_e4m3fn (w_q for
    `matmul_quantized`): m <= FP8_MAX_ROWS, i % 32 == 0, any o. Other dtypes: none."""
    if m <= 0 or jax.default_backend() != "cpu":
        return False
    if jnp.dtype(dtype) == jnp.int8:
        return m <= INT8_MAX_ROWS and i % 64 == 0 and i <= INT8_A16_MAX_IN and int8_available()
    if jnp.dtype(dtype) == jnp.float8_e4m3fn:
        return m <= FP8_MAX_ROWS and i % 32 == 0 and fp8_available()
    if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float32):
        return False
    if jnp.dtype(dtype) == jnp.float32 or not available():
        return m <= AVX2_MAX_ROWS[jnp.dtype(dtype).name] and i % 8 == 0 and avx2_available()
    if i % 32 != 0:
        return False
    if o % 16 == 0 and amx_available():
        return m <= AMX_MAX_ROWS
    return m <= MAX_ROWS and o % 4 == 0


def target(dtype) -> str | None:
    """The custom-call target that `matmul` (int8, float8_e4m3fn: `matmul_quantized`) runs for weights of
    `dtype` here (None: XLA's dot)."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.int8:
        return _INT8_TARGET if int8_available() else None
    if dtype == jnp.float8_e4m3fn:
        return _FP8_TARGET if fp8_available() else None
    if dtype == jnp.bfloat16 and available():
        return _TARGET
    if dtype.name in _AVX2_TARGETS and avx2_available():
        return _AVX2_TARGETS[dtype.name][0]
    return None


def max_rows(dtype) -> int:
    """The most rows `matmul` (int8, float8_e4m3fn: `matmul_quantized`; int8 either act_bits) takes for weights of
    `dtype` here (0: none)."""
    name = target(dtype)
    if name == _INT8_TARGET:
        return INT8_MAX_ROWS
    if name == _FP8_TARGET:
        return FP8_MAX_ROWS
    if name == _TARGET:
        return AMX_MAX_ROWS if amx_available() else MAX_ROWS
    return AVX2_MAX_ROWS[jnp.dtype(dtype).name] if name else 0


def head_max_rows(dtype) -> int:
    """The most rows `matmul` should take for a wide vocab head of `dtype` here: the AMX and
    AVX512-BF16 path up to HEAD_MAX_ROWS, the AVX2 path as for any matrix."""
    return HEAD_MAX_ROWS if target(dtype) == _TARGET else max_rows(dtype)


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


def matmul_avx2(x, w):
    """x [M, I] float32, w [O, I] float32 or bfloat16 -> [M, O] float32 on the AVX2 path
    (bf16 w: x rounded to bf16 first, as matmul_bf16 does); I % 8 == 0, any M and O."""
    dtype = jnp.dtype(w.dtype).name
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1] or dtype not in _AVX2_TARGETS:
        raise ValueError(f"matmul_avx2: x [M, I] and w [O, I] float32 or bfloat16, got {x.shape} {x.dtype}, "
                         f"{w.shape} {w.dtype}")
    if x.shape[1] % 8:
        raise ValueError(f"matmul_avx2: I must be a multiple of 8, got {x.shape[1]}")
    if not avx2_available():
        raise RuntimeError("matmul_avx2 needs a CPU with AVX2 and FMA and a C++ compiler (see avx2_available())")
    call = jax.ffi.ffi_call(_AVX2_TARGETS[dtype][0], jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32),
                            vmap_method="sequential")
    return call(x.astype(jnp.float32), w)


def matmul(x, w):
    """x [M, I] @ w [O, I]^T -> [M, O] float32 on the native path that serves w's dtype here
    (check `supported` first)."""
    if jnp.dtype(w.dtype) == jnp.bfloat16 and available():
        return matmul_bf16(x, w)
    return matmul_avx2(x, w)


def matmul_int8(x, w_q, w_scale, act_bits: int = 8):
    """x [M, I] float32 (or bf16), w_q [O, I] int8, w_scale [O] float32 -> [M, O] float32
    ~ x @ (w_q * w_scale[:, None]).T, as `matmul_int8_reference` computes it (x quantized per
    row to act_bits: 8 (W8A8, vpdpbusd) or 16 (vpdpwssd; I <= INT8_A16_MAX_IN)); I % 64 == 0,
    any M (`supported` offers M <= INT8_MAX_ROWS) and O."""
    act_bits = _check_act_bits(act_bits, "matmul_int8")
    if (x.ndim != 2 or w_q.ndim != 2 or w_scale.ndim != 1 or x.shape[1] != w_q.shape[1]
            or w_scale.shape[0] != w_q.shape[0]):
        raise ValueError(f"matmul_int8: x [M, I], w_q [O, I] and w_scale [O], got {x.shape}, {w_q.shape}, "
                         f"{w_scale.shape}")
    if jnp.dtype(w_q.dtype) != jnp.int8 or not jnp.issubdtype(x.dtype, jnp.floating) or not jnp.issubdtype(
            w_scale.dtype, jnp.floating):
        raise ValueError(f"matmul_int8: x float, w_q int8 and w_scale float, got {x.dtype}, {w_q.dtype}, "
                         f"{w_scale.dtype}")
    if x.shape[1] % 64:
        raise ValueError(f"matmul_int8: I must be a multiple of 64, got {x.shape[1]}")
    if act_bits == 16 and x.shape[1] > INT8_A16_MAX_IN:
        raise ValueError(f"matmul_int8: act_bits=16 takes I <= {INT8_A16_MAX_IN} (int32 lane sums), got {x.shape[1]}")
    if not int8_available():
        raise RuntimeError("matmul_int8 needs a CPU with AVX512-VNNI and a C++ compiler (see int8_available())")
    call = jax.ffi.ffi_call(_INT8_TARGET, jax.ShapeDtypeStruct((x.shape[0], w_q.shape[0]), jnp.float32),
                            vmap_method="sequential")
    return call(x.astype(jnp.float32), w_q, w_scale.astype(jnp.float32), act_bits=np.int32(act_bits))


def matmul_quantized(x, w_q, w_scale, act_bits: int = 16, x_dtype=jnp.bfloat16):
    """x [M, I] @ (w_q [O, I] * w_scale [O, None])^T -> [M, O] float32 on the native path that
    serves w_q's dtype and the caller's compute dtype x_dtype (bfloat16 or float32) here:
    - int8, x_dtype bfloat16: `matmul_int8_bf16` (x rounded to bf16, bf16 dots; act_bits checked
      but not used), or where that kernel is missing `matmul_int8` as for float32;
    - int8, x_dtype float32 (or float16: any finer than bf16): `matmul_int8`, x quantized per
      row to act_bits (16: near-exact);
    - float8_e4m3fn: `matmul_fp8` for either x_dtype (x rounded to bf16; act_bits checked but
      not used).
    Check `supported(m, i, o, w_q.dtype)` first."""
    _check_act_bits(act_bits, "matmul_quantized")
    if not jnp.issubdtype(x_dtype, jnp.floating):
        raise ValueError(f"matmul_quantized: x_dtype must be a float dtype (bfloat16, float32), got {x_dtype}")
    if jnp.dtype(w_q.dtype) == jnp.float8_e4m3fn:
        return matmul_fp8(x, w_q, w_scale)
    if jnp.dtype(w_q.dtype) != jnp.int8:
        raise ValueError(f"matmul_quantized: no native path for {w_q.dtype} weights (int8 or float8_e4m3fn only)")
    if jnp.dtype(x_dtype) == jnp.bfloat16 and int8_bf16_available():
        return matmul_int8_bf16(x, w_q, w_scale)
    return matmul_int8(x, w_q, w_scale, act_bits=act_bits)


def _matmul_bf16_dot(who: str, x, w_q, w_scale, dtype, target: str):
    """The fp8 source's kernel for w_q in `dtype` (float8_e4m3fn or int8): checks, then the call."""
    if (x.ndim != 2 or w_q.ndim != 2 or w_scale.ndim != 1 or x.shape[1] != w_q.shape[1]
            or w_scale.shape[0] != w_q.shape[0]):
        raise ValueError(f"{who}: x [M, I], w_q [O, I] and w_scale [O], got {x.shape}, {w_q.shape}, "
                         f"{w_scale.shape}")
    if jnp.dtype(w_q.dtype) != dtype or not jnp.issubdtype(x.dtype, jnp.floating) or not (
            jnp.issubdtype(w_scale.dtype, jnp.floating)):
        raise ValueError(f"{who}: x float, w_q {jnp.dtype(dtype).name} and w_scale float, got {x.dtype}, "
                         f"{w_q.dtype}, {w_scale.dtype}")
    if x.shape[1] % 32:
        raise ValueError(f"{who}: I must be a multiple of 32, got {x.shape[1]}")
    if not fp8_available():
        raise RuntimeError(f"{who} needs a CPU with AVX512-BF16 and a C++ compiler (see fp8_available())")
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], w_q.shape[0]), jnp.float32),
                            vmap_method="sequential")
    return call(x.astype(jnp.float32), w_q, w_scale.astype(jnp.float32))


def matmul_fp8(x, w_q, w_scale):
    """x [M, I] float32 (or bf16), w_q [O, I] float8_e4m3fn, w_scale [O] float32 -> [M, O]
    float32 = (x rounded to bf16) . w_q^T in f32, times w_scale: `matmul_fp8_reference` up to
    the order of the f32 sums (NaN codes give NaN); I % 32 == 0, any M (`supported` offers
    M <= FP8_MAX_ROWS) and O."""
    return _matmul_bf16_dot("matmul_fp8", x, w_q, w_scale, jnp.float8_e4m3fn, _FP8_TARGET)


def matmul_int8_bf16(x, w_q, w_scale):
    """x [M, I] float32 (or bf16), w_q [O, I] int8, w_scale [O] float32 -> [M, O] float32 =
    (x rounded to bf16) . w_q^T in f32, times w_scale: `matmul_int8_bf16_reference` up to the
    order of the f32 sums; I % 32 == 0, any M (`supported` offers M <= INT8_MAX_ROWS) and O.
    The fp8 kernel with int8 weights (widened to bf16 exactly); needs `int8_bf16_available()`."""
    return _matmul_bf16_dot("matmul_int8_bf16", x, w_q, w_scale, jnp.int8, _INT8_BF16_TARGET)
