"""Builds the native CPU kernels (C++ through the XLA FFI) at first use.

Each source is compiled with the system C++ compiler (`g++ -O3 -march=native`) into
~/.cache/pagedjax/native/ (PAGEDJAX_CACHE moves the root), once per source text, shared
header, jaxlib and CPU; concurrent builders never load a half-written file.
"""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax

_HEADER_DIR = Path(__file__).parent  # parallel_for.h
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-std=c++17", "-shared", "-fPIC", "-fopenmp-simd", "-w"]


def cache_dir() -> Path:
    root = os.environ.get("PAGEDJAX_CACHE") or Path.home() / ".cache" / "pagedjax"
    return Path(root) / "native"


def cpu_signature() -> str:
    try:  # -march=native code is only valid on a CPU with the same features
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()


def build(source: Path) -> Path:
    """Compiles `source` (once per source, headers, jaxlib and CPU); returns the library path."""
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        raise RuntimeError("no C++ compiler found (set CXX or install g++)")
    include = jax.ffi.include_dir()
    headers = [p.read_text() for p in sorted(_HEADER_DIR.glob("*.h"))]
    key = hashlib.sha256("\0".join([source.read_text(), *headers, jax.__version__, include, compiler, *FLAGS,
                                    cpu_signature()]).encode()).hexdigest()[:16]
    lib = cache_dir() / f"{source.stem}_{key}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        out = Path(tmp) / lib.name
        cmd = [compiler, *FLAGS, f"-I{include}", f"-I{_HEADER_DIR}", str(source), "-o", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"building {source.name} failed:\n{' '.join(cmd)}\n{proc.stderr[-2000:]}")
        os.replace(out, lib)
    return lib
