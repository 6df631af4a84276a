"""The layer matmuls of a decode or prompt step on CPU: the native kernel's AMX, AVX512-BF16
and AVX2 paths against XLA's dot, side by side in one run (bf16 weights, or --dtype float32:
the AVX2 path and XLA). With bf16 also "xla-f32": the weights widened to f32 in the call, then
XLA's float32 dot (what models.llama.linear does for prompt-sized bf16 matmuls on AVX2 CPUs).

A SmolLM2-135M-shaped stack (30 layers of q/k/v [960, 576], o [576, 576], gate/up
[3072, 576], down [576, 1536], random weights, every matrix its own as in a real step:
212 MB, past any L2) and the [49152, 576] vocab head, chained in one jitted call at each row count;
median of --iters calls, with the weight bytes read per ms (GB/s). A path that does not serve
a shape prints "-".

    python scripts/bench_matmul.py [--rows 1,8,16,32,64,512] [--iters 7] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_matmul

LAYERS, HIDDEN, INTER, QKV, VOCAB = 30, 576, 1536, 960, 49152


def matmul(path: str):
    if path == "xla":
        return lambda x, w: jnp.einsum("mi,oi->mo", x.astype(w.dtype), w, preferred_element_type=jnp.float32)
    if path == "xla-f32":  # bf16 weights widened to f32 in the call, then XLA's f32 dot (models.llama.linear)
        return lambda x, w: jnp.einsum("mi,oi->mo", x.astype(w.dtype).astype(jnp.float32), w.astype(jnp.float32))
    if path == "avx2":
        return cpu_matmul.matmul_avx2
    return lambda x, w: cpu_matmul.matmul_bf16(x, w, amx=path == "amx")


def serves(path: str, rows: int, dtype) -> bool:
    if path == "xla" or path == "xla-f32":
        return True
    if path == "avx2":
        return cpu_matmul.avx2_available() and rows <= 64
    if dtype != jnp.bfloat16 or not cpu_matmul.available() or (path == "amx" and not cpu_matmul.amx_available()):
        return False
    return path == "amx" or rows <= cpu_matmul.MAX_ROWS


def timed(fn, args, iters: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,8,16,32,64,512")
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = p.parse_args(argv)
    dtype = jnp.dtype(args.dtype)
    rng = np.random.default_rng(0)
    shapes = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]
    layers = [[jnp.asarray(rng.standard_normal(s) * 0.02, dtype) for s in shapes] for _ in range(LAYERS)]
    head = jnp.asarray(rng.standard_normal((VOCAB, HIDDEN)) * 0.02, dtype)
    layer_mb = sum(w.size * dtype.itemsize for ws in layers for w in ws) / 1e6
    head_mb = head.size * dtype.itemsize / 1e6
    print(f"AMX: {cpu_matmul.amx_available()}, AVX512-BF16: {cpu_matmul.available()}, AVX2: "
          f"{cpu_matmul.avx2_available()}; layers {layer_mb:.0f} MB, head {head_mb:.0f} MB of {dtype.name}")
    paths = (["amx", "avx512"] if dtype == jnp.bfloat16 else []) + ["avx2", "xla"]
    paths += ["xla-f32"] if dtype == jnp.bfloat16 else []
    print(f"{'rows':>5s} " + " ".join(f"{p + ' layers':>22s} {p + ' head':>18s}" for p in paths))
    for rows in [int(r) for r in args.rows.split(",")]:
        x = jnp.asarray(rng.standard_normal((rows, HIDDEN)), jnp.float32)
        cells = []
        for path in paths:
            if not serves(path, rows, dtype):
                cells.append(f"{'-':>22s} {'-':>18s}")
                continue
            mm = matmul(path)

            def stack(x, layers, mm=mm):
                for wqkv, wo, wgu, wd in layers:
                    h = mm(mm(x, wqkv)[:, :HIDDEN], wo)
                    x = x + 1e-3 * mm(mm(h, wgu)[:, :INTER], wd)
                return x

            ms = timed(jax.jit(stack), (x, layers), args.iters)
            head_ms = timed(jax.jit(lambda x, mm=mm: mm(x, head)), (x,), args.iters)
            cells.append(f"{ms:8.1f} ms {layer_mb / ms:5.1f} GB/s {head_ms:6.1f} ms "
                         f"{head_mb / head_ms:4.1f} GB/s")
        print(f"{rows:5d} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
