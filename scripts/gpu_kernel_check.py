"""One-shot device check for the Pallas GPU decode and prefill kernels (about 4-7 minutes).

    PYTHONPATH=. python scripts/gpu_kernel_check.py             # on an NVIDIA GPU machine
    PYTHONPATH=. python scripts/gpu_kernel_check.py --allow-cpu  # dry run of the same steps

1. prints the environment (jax, devices);
2. runs the kernel tests compiled on the GPU (TestDecodeKernels and TestPrefillKernels, not
   the interpret copies; the packed-layout and bf16-KV cases with impl "pallas_gpu"), plus
   the Triton lowering smoke tests;
3. unless --no-bench, runs scripts/bench_kernels.py (bf16, full configs) for decode and for
   prefill and writes results/bench_kernels.json and results/bench_prefill.json.
On a host without a GPU it stops at step 1 unless --allow-cpu, which runs the interpret-mode
GPU tests and the quick CPU benchmark instead. Exit code: 0 when the tests pass.
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
         "tests/pallas_kernels/test_bf16_kv.py"]


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
    py = sys.executable
    if on_gpu:
        tests = [py, "-m", "pytest", *TESTS, "-q", "-rs", "--durations=5", "-n", str(args.workers),
                 "-p", "no:cacheprovider",
                 "-k", "((TestDecodeKernels or TestPrefillKernels) and not Interpret and not tpu)"
                       " or (lowers_for_device and gpu) or (pallas_gpu and not interpret)"]
        bench = [py, "scripts/bench_kernels.py", "--iters", "20"]
    else:
        tests = [py, "-m", "pytest", *TESTS, "-q", "-p", "no:cacheprovider",
                 "-k", "Interpret and gpu and not splits"]
        bench = [py, "scripts/bench_kernels.py", "--quick", "--iters", "2"]
    rc_tests = run(tests, timeout=240)
    if args.no_bench:
        return rc_tests
    rc_bench = run(bench, timeout=150)
    rc_prefill = run(bench + ["--prefill"], timeout=150)
    print(f"\n[check] tests rc={rc_tests}, decode bench rc={rc_bench}, "
          f"prefill bench rc={rc_prefill}")
    return rc_tests or rc_bench or rc_prefill


if __name__ == "__main__":
    sys.exit(main())
