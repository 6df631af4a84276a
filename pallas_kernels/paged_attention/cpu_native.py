"""Native paged attention for the CPU backend: cpu_attention.cc through the XLA FFI.

XLA:CPU runs the jnp paths as many small fused loops; for decode (a few query rows per
sequence) their fixed costs dominate. The C++ kernel walks each sequence's pages once with
an online softmax, on XLA's intra-op thread pool. It is compiled at first use with the
system C++ compiler (`g++ -O3 -march=native`, about 10 s) into
~/.cache/pagedjax/native/ (PAGEDJAX_CACHE moves the root); `available()` is False (and the
engine keeps the XLA path) when there is no compiler, the build fails, or
PAGEDJAX_NATIVE_ATTENTION=0.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

_SOURCE = Path(__file__).with_name("cpu_attention.cc")
_TARGET = "pagedjax_paged_attention_f32"
_FLAGS = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fopenmp-simd", "-w"]
log = logging.getLogger(__name__)


def _cache_dir() -> Path:
    root = os.environ.get("PAGEDJAX_CACHE") or Path.home() / ".cache" / "pagedjax"
    return Path(root) / "native"


def _cpu_signature() -> str:
    try:  # -march=native code is only valid on a CPU with the same features
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()


def build() -> Path:
    """Compiles cpu_attention.cc (once per source, jaxlib and CPU); returns the library path."""
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        raise RuntimeError("no C++ compiler found (set CXX or install g++)")
    include = jax.ffi.include_dir()
    key = hashlib.sha256("\0".join([_SOURCE.read_text(), jax.__version__, include, compiler, *_FLAGS,
                                    _cpu_signature()]).encode()).hexdigest()[:16]
    lib = _cache_dir() / f"cpu_attention_{key}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        out = Path(tmp) / lib.name
        cmd = [compiler, *_FLAGS, f"-I{include}", str(_SOURCE), "-o", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"building the native attention kernel failed:\n{' '.join(cmd)}\n{proc.stderr[-2000:]}")
        os.replace(out, lib)  # atomic: concurrent builders never load a half-written file
    return lib


@functools.cache
def available() -> bool:
    """True when the kernel is built and registered with XLA (at most one build per process)."""
    if os.environ.get("PAGEDJAX_NATIVE_ATTENTION", "1") == "0":
        return False
    try:
        lib = ctypes.cdll.LoadLibrary(str(build()))
        jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.PagedAttentionF32), platform="cpu")
    except (OSError, RuntimeError, AttributeError) as e:
        log.warning("native CPU paged attention unavailable, using the XLA path: %s", e)
        return False
    return True


def native_supported(q_dtype, page_dtype) -> bool:
    """The kernel serves this call: CPU backend, float32 q and pages, kernel built."""
    f32 = jnp.dtype(jnp.float32)
    return (jax.default_backend() == "cpu" and jnp.dtype(q_dtype) == f32 and jnp.dtype(page_dtype) == f32
            and available())


def packed_attention_native(q, k_pages, v_pages, block_tables, kv_lens, q_starts, q_lens, *, scale):
    """Packed layout: q [T, H, D]; sequence s owns tokens [q_starts[s], q_starts[s] + q_lens[s]).
    Same result as `packed_attention_reference` (float32 only); needs `available()`."""
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32), vmap_method="sequential")
    i32 = lambda x: x.astype(jnp.int32)
    return call(q, k_pages, v_pages, i32(block_tables), i32(kv_lens), i32(q_starts), i32(q_lens),
                scale=np.float32(scale))


def paged_attention_native(q, k_pages, v_pages, block_tables, kv_lens, q_lens, *, scale):
    """Padded layout q [S, Q, H, D]: same result as `paged_attention_reference`."""
    s, nq, h, d = q.shape
    starts = jnp.arange(s, dtype=jnp.int32) * nq
    out = packed_attention_native(q.reshape(s * nq, h, d), k_pages, v_pages, block_tables, kv_lens, starts,
                                  q_lens, scale=scale)
    return out.reshape(s, nq, h, d)
