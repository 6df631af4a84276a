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

--dtype int8: the same stack with per-output-channel int8 weights (w_q [O, I] int8, w_scale
[O] float32; 106 MB, head 28 MB): the bf16-dot kernel ("int8-bf16", matmul_int8_bf16: the
weights widened to bf16 in registers, x rounded to bf16, vdpbf16ps; what matmul_quantized runs
for a bf16 model), the int8 kernel with 16-bit activations ("int8-a16", matmul_int8(act_bits=16),
vpdpwssd: what matmul_quantized runs for a float32 model) and as W8A8 ("int8", act_bits=8,
vpdpbusd) on AVX512-VNNI against the bf16 native kernel (AVX512-BF16) and XLA's bf16 dot on bf16 weights, and "xla-deq" (w_q
widened to bf16 in the call, XLA's bf16 dot, then w_scale: what a caller without the kernel
does). The int8 kernels (each mode) run at every row count asked for (supported() offers it up to
INT8_MAX_ROWS, chosen from this table). Each cell: median ms of --iters calls [min - max], --repeats times over (the rows in turn).

    python scripts/bench_matmul.py --dtype int8 --rows 1,8,16,32 --iters 15 --repeats 3

--dtype fp8: the same stack with float8_e4m3fn weights and a float32 scale per output row (what
quantization="fp8" stores): the fp8 kernel ("fp8", matmul_fp8: the weights widened to bf16 in
registers, vdpbf16ps) against the bf16 native kernel and XLA's bf16 dot on bf16 weights, and
"xla-fp8" (x and w_q converted to bf16 in the call, XLA's bf16 dot, then w_scale: what runs
without the kernel). The fp8 kernel runs at every row count asked for (supported() offers it up
to FP8_MAX_ROWS, chosen from this table).

    python scripts/bench_matmul.py --dtype fp8 --rows 1,8,16,32,64 --iters 15 --repeats 3
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.pallas_kernels import cpu_matmul

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


def call_times(fn, args, iters: int) -> np.ndarray:
    """ms of each of `iters` calls, after one to compile and warm up."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return 1e3 * np.asarray(times)


def timed(fn, args, iters: int) -> float:
    return float(np.median(call_times(fn, args, iters)))


def stack_fn(mm):
    """The 30 layers chained, mm(x, weights) for each matrix (a tuple per layer)."""
    def stack(x, layers):
        for wqkv, wo, wgu, wd in layers:
            h = mm(mm(x, wqkv)[:, :HIDDEN], wo)
            x = x + 1e-3 * mm(mm(h, wgu)[:, :INTER], wd)
        return x
    return stack


def quantize(w):
    """w [O, I] float32 -> (w_q [O, I] int8, w_scale [O] float32), per output channel, symmetric."""
    scale = np.maximum(np.abs(w).max(axis=1), 1e-12) / 127
    return jnp.asarray(np.clip(np.round(w / scale[:, None]), -127, 127), jnp.int8), jnp.asarray(scale, jnp.float32)


def quantize_fp8(w):
    """w [O, I] float32 -> (w_q [O, I] float8_e4m3fn, w_scale [O] float32): per output row, max |w| -> 448."""
    scale = np.maximum(np.abs(w).max(axis=1), 1e-12) / 448
    return jnp.asarray(w / scale[:, None], jnp.float8_e4m3fn), jnp.asarray(scale, jnp.float32)


def int8_main(args) -> None:
    """The int8 kernel (16- and 8-bit activations) or the fp8 kernel (--dtype fp8) against the
    bf16 native kernel and XLA's bf16 dot (and xla-deq / xla-fp8), side by side."""
    fp8 = args.dtype == "fp8"
    rng = np.random.default_rng(0)
    shapes = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]
    floats = [[(rng.standard_normal(s) * 0.02).astype(np.float32) for s in shapes] for _ in range(LAYERS)]
    head_f = (rng.standard_normal((VOCAB, HIDDEN)) * 0.02).astype(np.float32)
    bf16 = [[jnp.asarray(w, jnp.bfloat16) for w in ws] for ws in floats]
    head_bf16 = jnp.asarray(head_f, jnp.bfloat16)
    q8 = [[(quantize_fp8 if fp8 else quantize)(w) for w in ws] for ws in floats]
    head_q8 = (quantize_fp8 if fp8 else quantize)(head_f)
    del floats, head_f
    mb = lambda ws: sum(a.size * a.dtype.itemsize for w in ws for a in (w if isinstance(w, tuple) else (w,))) / 1e6
    kind = "fp8" if fp8 else "int8"
    print(f"{kind}: {cpu_matmul.fp8_available() if fp8 else cpu_matmul.int8_available()}, AVX512-BF16: {cpu_matmul.available()}; layers "
          f"{mb([w for ws in q8 for w in ws]):.0f} MB {kind} / {mb([w for ws in bf16 for w in ws]):.0f} MB bf16, "
          f"head {mb([head_q8]):.0f} / {mb([head_bf16]):.0f} MB")
    xla_bf16 = lambda x, w: jnp.einsum("mi,oi->mo", x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)
    paths = {  # name: (matmul on (x, weights), layer weights, head weights, serves(rows))
        "int8-bf16": (lambda x, w: cpu_matmul.matmul_int8_bf16(x, *w), q8, head_q8,
                      lambda m: cpu_matmul.int8_bf16_available()),  # any M here, past INT8_MAX_ROWS too
        "int8-a16": (lambda x, w: cpu_matmul.matmul_int8(x, *w, act_bits=16), q8, head_q8,
                     lambda m: cpu_matmul.int8_available()),  # any M here, past INT8_MAX_ROWS too
        "int8": (lambda x, w: cpu_matmul.matmul_int8(x, *w, act_bits=8), q8, head_q8,
                 lambda m: cpu_matmul.int8_available()),
        "bf16-native": (cpu_matmul.matmul_bf16, bf16, head_bf16, lambda m: cpu_matmul.supported(m, HIDDEN, QKV)),
        "xla-bf16": (xla_bf16, bf16, head_bf16, lambda m: True),
        "xla-deq": (lambda x, w: xla_bf16(x, w[0].astype(jnp.bfloat16)) * w[1], q8, head_q8, lambda m: True),
    }
    if fp8:
        paths = {
            "fp8": (lambda x, w: cpu_matmul.matmul_fp8(x, *w), q8, head_q8, lambda m: cpu_matmul.fp8_available()),
            "bf16-native": paths["bf16-native"],
            "xla-bf16": paths["xla-bf16"],
            "xla-fp8": paths["xla-deq"],  # x and w_q in bf16, XLA's dot, then w_scale (matmul_fp8_reference)
        }
    paths = {p: paths[p] for p in args.paths.split(",")} if args.paths else paths
    rows = [int(r) for r in args.rows.split(",")]
    cell = lambda t: f"{np.median(t):7.2f} [{t.min():6.2f}-{t.max():6.2f}]"
    print(f"{'rows':>4s} {'rep':>3s} " + " ".join(f"{p + ' layers ms':>24s} {p + ' head ms':>24s}" for p in paths))
    fns = {p: (jax.jit(stack_fn(mm)), jax.jit(mm)) for p, (mm, *_rest) in paths.items()}
    for rep in range(args.repeats):
        for m in rows:
            x = jnp.asarray(rng.standard_normal((m, HIDDEN)), jnp.float32)
            cells = []
            for p, (mm, layers, head, serves) in paths.items():
                if not serves(m):
                    cells.append(f"{'-':>24s} {'-':>24s}")
                    continue
                stack, one = fns[p]
                cells.append(f"{cell(call_times(stack, (x, layers), args.iters)):>24s} "
                             f"{cell(call_times(one, (x, head), args.iters)):>24s}")
            print(f"{m:4d} {rep:3d} " + " ".join(cells), flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,8,16,32,64,512")
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "int8", "fp8"])
    p.add_argument("--repeats", type=int, default=1, help="--dtype int8 / fp8: rounds over the rows")
    p.add_argument("--paths", default="", help="--dtype int8: a subset of int8-bf16,int8-a16,int8,bf16-native,xla-bf16,xla-deq; fp8: of fp8,bf16-native,xla-bf16,xla-fp8")
    args = p.parse_args(argv)
    if args.dtype in ("int8", "fp8"):
        return int8_main(args)
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
            ms = timed(jax.jit(stack_fn(mm)), (x, layers), args.iters)
            head_ms = timed(jax.jit(lambda x, mm=mm: mm(x, head)), (x,), args.iters)
            cells.append(f"{ms:8.1f} ms {layer_mb / ms:5.1f} GB/s {head_ms:6.1f} ms "
                         f"{head_mb / head_ms:4.1f} GB/s")
        print(f"{rows:5d} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
