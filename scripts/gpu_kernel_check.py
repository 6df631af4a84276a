"""One-shot device check for the Pallas GPU decode and prefill kernels (about 4-7 minutes).

    PYTHONPATH=. python scripts/gpu_kernel_check.py             # on an NVIDIA GPU machine
    PYTHONPATH=. python scripts/gpu_kernel_check.py --allow-cpu  # dry run of the same steps
    PYTHONPATH=. python scripts/gpu_kernel_check.py --kv-bench   # step 3 alone

1. prints the environment (jax, devices);
2. runs the kernel tests compiled on the GPU (TestDecodeKernels and TestPrefillKernels, not
   the interpret copies; the packed-layout and bf16-KV cases with impl "pallas_gpu"; the
   quantized-KV cases, int8 and float8_e4m3fn pages against the reference on the dequantized
   pages, TestQuantizedKernelsCompiled), plus the Triton lowering smoke tests;
3. unless --no-bench, times the Pallas GPU decode kernel on bf16 pages against int8 pages
   (the same attention, half the page bytes plus the float16 scales), also checking the int8
   output against the reference on the dequantized pages; writes results/bench_kv_quant.json;
4. unless --no-bench, runs scripts/bench_kernels.py (bf16, full configs) for decode and for
   prefill and writes results/bench_kernels.json and results/bench_prefill.json.
On a host without a GPU it stops at step 1 unless --allow-cpu, which runs the interpret-mode
GPU tests, a tiny interpret-mode step 3 (no file written) and the quick CPU benchmark instead.
Exit code: 0 when the tests pass.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = ["tests/pallas_kernels/test_paged_attention.py",
         "tests/pallas_kernels/test_paged_prefill.py",
         "tests/pallas_kernels/test_packed_attention.py",
         "tests/pallas_kernels/test_bf16_kv.py",
         "tests/pallas_kernels/test_pallas_quantized_kv.py"]


def kv_bench(on_gpu: bool, iters: int) -> int:
    """Decode attention through ops.paged_decode_attention (impl pallas_gpu; interpret mode and
    tiny shapes off a GPU): bf16 pages against int8 pages holding the same values quantized."""
    import json
    import statistics

    import jax
    import jax.numpy as jnp
    import numpy as np

    from pagedjax.pallas_kernels.paged_attention import kv_quant, ops, paged_attention_reference

    if on_gpu:  # a Llama-8B-like layer: 32 heads, 8 kv heads, 128 dims, 64 sequences at ~2k tokens
        s, h, hkv, d, bs, ctx, impl = 64, 32, 8, 128, 16, 2048, "pallas_gpu"
    else:
        s, h, hkv, d, bs, ctx, impl = 2, 4, 2, 64, 16, 48, "pallas_gpu_interpret"
        iters = min(iters, 2)
    mb = ctx // bs
    nb = s * mb
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((hkv, nb, bs, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((hkv, nb, bs, d)), jnp.bfloat16)
    kq, vq = (kv_quant.QuantizedPages(*kv_quant.quantize(x, jnp.int8)) for x in (k, v))
    q = jnp.asarray(rng.standard_normal((s, h, d)), jnp.bfloat16)
    tables = jnp.asarray(rng.permutation(nb).reshape(s, mb).astype(np.int32))
    lens = jnp.asarray(rng.integers(ctx // 2, ctx + 1, s).astype(np.int32))
    fn = jax.jit(lambda q, k, v: ops.paged_decode_attention(q, k, v, tables, lens, impl=impl))
    rows = []
    for name, kp, vp in (("bf16", k, v), ("int8", kq, vq)):
        out = jax.block_until_ready(fn(q, kp, vp))
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(q, kp, vp))
            times.append(time.perf_counter() - t0)
        kd, vd = (kv_quant.load(x, lambda a: a) for x in (kp, vp))  # whole pool f32: the check only
        ref = paged_attention_reference(q.astype(jnp.float32)[:, None], kd, vd, tables, lens,
                                        jnp.ones(s, jnp.int32), scale=d ** -0.5)[:, 0]
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)))
        page_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves((kp, vp)))
        rows.append(dict(pages=name, ms_median=round(statistics.median(times) * 1e3, 3),
                         ms_min=round(min(times) * 1e3, 3), pool_mib=round(page_bytes / 2 ** 20, 1),
                         max_abs_err_vs_reference=err))
        print(f"[kv-bench] {name:>5} pages: median {rows[-1]['ms_median']:.3f} ms, min {rows[-1]['ms_min']:.3f} ms, "
              f"pool {rows[-1]['pool_mib']} MiB, max|out - ref(dequantized)| {err:.2e}", flush=True)
    print(f"[kv-bench] int8 / bf16 time: {rows[1]['ms_median'] / rows[0]['ms_median']:.2f}x "
          f"({impl}, S={s} H={h} Hkv={hkv} D={d} BS={bs} ctx<={ctx})")
    ok = all(r["max_abs_err_vs_reference"] < 3e-2 for r in rows)  # bf16 dots (q is bf16)
    if on_gpu:
        os.makedirs(os.path.join(ROOT, "results"), exist_ok=True)
        with open(os.path.join(ROOT, "results", "bench_kv_quant.json"), "w") as f:
            json.dump(dict(backend=jax.default_backend(), impl=impl, iters=iters,
                           config=dict(s=s, h=h, hkv=hkv, d=d, bs=bs, ctx=ctx), results=rows), f, indent=2)
        print("[kv-bench] wrote results/bench_kv_quant.json")
    return 0 if ok else 1


def run(cmd, timeout):
    print(f"\n$ {' '.join(cmd)}", flush=True)
    t0 = time.time()
    try:
        rc = subprocess.run(cmd, cwd=ROOT, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        print(f"[check] timed out after {timeout}s")
        rc = 124
    print(f"[check] rc={rc} in {time.time() - t0:.0f}s", flush=True)
    return rc


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--allow-cpu", action="store_true")
    ap.add_argument("--no-bench", action="store_true", help="the tests only")
    ap.add_argument("--kv-bench", action="store_true",
                    help="only the bf16 vs int8 pages decode timing (step 3)")
    ap.add_argument("--kv-iters", type=int, default=20, help="timed calls per page dtype in step 3")
    ap.add_argument("--workers", type=int, default=4, help="pytest-xdist workers")
    args = ap.parse_args()
    os.environ["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # several workers share one GPU
    import jax
    backend = jax.default_backend()
    print(f"[check] jax {jax.__version__}, backend={backend}, devices={jax.devices()}")
    on_gpu = backend in ("gpu", "cuda")
    if not on_gpu and not args.allow_cpu:
        print("[check] no GPU backend: install jax[cuda12] on a GPU host, or pass --allow-cpu")
        return 2
    if args.kv_bench:
        sys.path.insert(0, ROOT)
        return kv_bench(on_gpu, args.kv_iters)
    py = sys.executable
    if on_gpu:
        tests = [py, "-m", "pytest", *TESTS, "-q", "-rs", "--durations=5", "-n", str(args.workers),
                 "-p", "no:cacheprovider",
                 "-k", "((TestDecodeKernels or TestPrefillKernels) and not Interpret and not tpu)"
                       " or (lowers_for_device and gpu) or (pallas_gpu and not interpret)"
                       " or (TestQuantizedKernelsCompiled and gpu)"]
        bench = [py, "scripts/bench_kernels.py", "--iters", "20"]
    else:
        tests = [py, "-m", "pytest", *TESTS, "-q", "-p", "no:cacheprovider",
                 "-k", "(Interpret and gpu and not splits)"
                       " or (TestQuantizedKernels and not Compiled and gpu)"]
        bench = [py, "scripts/bench_kernels.py", "--quick", "--iters", "2"]
    rc_tests = run(tests, timeout=240)
    if args.no_bench:
        return rc_tests
    kv = [py, os.path.abspath(__file__), "--kv-bench", "--kv-iters", str(args.kv_iters)]
    rc_kv = run(kv + ([] if on_gpu else ["--allow-cpu"]), timeout=150)
    rc_bench = run(bench, timeout=150)
    rc_prefill = run(bench + ["--prefill"], timeout=150)
    print(f"\n[check] tests rc={rc_tests}, kv-quant bench rc={rc_kv}, decode bench rc={rc_bench}, "
          f"prefill bench rc={rc_prefill}")
    return rc_tests or rc_kv or rc_bench or rc_prefill


if __name__ == "__main__":
    sys.exit(main())
