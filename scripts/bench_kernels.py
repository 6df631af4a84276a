"""Time paged attention: the backend's Pallas kernels vs the jnp/XLA paths.

    PYTHONPATH=. python scripts/bench_kernels.py [--quick] [--iters N] [--out PATH]   # decode
    PYTHONPATH=. python scripts/bench_kernels.py --prefill [--quick] [--iters N]      # Q > 1
    PYTHONPATH=. python scripts/bench_kernels.py --cpu-decode [--iters N] [--skew N]  # XLA

Decode / prefill: every implementation is jitted and timed on the current backend (median
of N calls after a warm-up) and compared with the reference. On CPU the native C++ kernel
(the CPU default) and the XLA paths run ("ragged", "chunked", "reference"): compiled Pallas
kernels need a GPU or TPU. --cpu-decode times one decode step's attention of a SmolLM2-135M-shaped model (30
layers, 9 q / 3 kv heads, head dim 64, batch 16, ~190-token contexts, 16-token pages, a
512-page pool per layer, f32): one jitted function making the 30 calls, each layer on its own
pools, chained through q; it reports wall and process CPU time per step for each CPU path
("native", and "chunked" and "ragged", the XLA paths the engine used before it). --skew N
also runs the batch with one sequence N tokens long. Prints a table and writes JSON (default
results/bench_kernels.json, results/bench_prefill.json, results/bench_cpu_decode.json).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.pallas_kernels import paged_attention, paged_decode_attention

# decode: (batch, context, q heads, kv heads, head dim, page size)
FULL = [(8, 1024, 32, 8, 128, 16), (32, 2048, 32, 8, 128, 16), (64, 4096, 32, 8, 128, 16),
        (16, 8192, 16, 16, 128, 32), (128, 1024, 32, 4, 64, 16), (4, 16384, 32, 8, 128, 16)]
QUICK = [(4, 256, 8, 2, 64, 16), (8, 512, 16, 4, 128, 16), (2, 2048, 8, 8, 64, 32)]
# prefill: (batch, query slots, cached prefix, q heads, kv heads, head dim, page size)
PREFILL_FULL = [(1, 2048, 0, 32, 8, 128, 16), (4, 512, 1536, 32, 8, 128, 16),
                (8, 256, 0, 32, 8, 128, 16), (2, 128, 8064, 32, 8, 128, 16),
                (16, 64, 448, 16, 4, 64, 16), (1, 1024, 3072, 32, 8, 128, 32)]
PREFILL_QUICK = [(2, 64, 0, 8, 2, 64, 16), (4, 32, 100, 9, 3, 64, 16), (1, 128, 256, 8, 8, 64, 32)]
# --cpu-decode: SmolLM2-135M
SMOL = dict(layers=30, batch=16, heads=9, kv_heads=3, head_dim=64, page_size=16,
            num_pages=512, max_blocks=512, ctx=(170, 211))


def make_inputs(batch, ctx, h, hkv, d, bs, dtype, seed=0):
    """Pool sized to the batch; tables shuffled; lengths spread over (ctx/2, ctx]."""
    rng = np.random.default_rng(seed)
    mb = -(-ctx // bs)
    nb = batch * mb
    q = jnp.asarray(rng.standard_normal((batch, h, d)), dtype)  # [S, H, D]
    k = jnp.asarray(rng.standard_normal((hkv, nb, bs, d)), dtype)  # [Hkv, NB, BS, D]
    v = jnp.asarray(rng.standard_normal((hkv, nb, bs, d)), dtype)
    tables = jnp.asarray(rng.permutation(nb).reshape(batch, mb), jnp.int32)  # [S, MB]
    lens = jnp.asarray(rng.integers(ctx // 2 + 1, ctx + 1, batch), jnp.int32)  # [S]
    return q, k, v, tables, lens


def make_prefill_inputs(batch, nq, prefix, h, hkv, d, bs, dtype, seed=0):
    """q_lens spread over (Q/2, Q], prefixes over [prefix/2, prefix]; pool sized to the batch."""
    rng = np.random.default_rng(seed)
    mb = -(-(nq + prefix) // bs)
    nb = batch * mb
    q = jnp.asarray(rng.standard_normal((batch, nq, h, d)), dtype)  # [S, Q, H, D]
    k = jnp.asarray(rng.standard_normal((hkv, nb, bs, d)), dtype)
    v = jnp.asarray(rng.standard_normal((hkv, nb, bs, d)), dtype)
    tables = jnp.asarray(rng.permutation(nb).reshape(batch, mb), jnp.int32)
    q_lens = rng.integers(nq // 2 + 1, nq + 1, batch)
    kv_lens = q_lens + rng.integers(prefix // 2, prefix + 1, batch)
    return q, k, v, tables, jnp.asarray(kv_lens, jnp.int32), jnp.asarray(q_lens, jnp.int32)


def time_fn(fn, args, iters):
    out = jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return out, statistics.median(times)


def impls_for_backend(backend):
    kernel = {"tpu": "pallas_tpu", "gpu": "pallas_gpu", "cuda": "pallas_gpu"}.get(backend)
    if kernel is None:
        print(f"[bench] backend {backend!r}: compiled Pallas kernels need a GPU/TPU; "
              "timing the XLA paths only")
        from pagedjax.pallas_kernels.paged_attention.ops import native_supported

        native = ["native"] if native_supported(jnp.float32, jnp.float32) else []
        return native + ["ragged", "chunked", "reference"]
    return [kernel, "chunked", "reference"]


def _run_table(label, configs, make, call, work, impls, iters, dtype, backend):
    """Times call(impl) on make(cfg) for each config; work(cfg, inputs) -> (bytes, flops)."""
    rows = []
    print(f"{label:>34} " + " ".join(f"{n + ' ms':>14}" for n in impls) + "  max|diff| vs ref")
    for cfg in configs:
        inputs = make(*cfg, dtype)
        nbytes, flops = work(cfg, inputs)
        row = dict(config=list(cfg), dtype=dtype.name, backend=backend, ms={}, gbps={},
                   tflops={}, max_abs_diff={})
        outs = {}
        for name in impls:
            fn = jax.jit(functools.partial(call, impl=name))
            try:
                outs[name], sec = time_fn(fn, inputs, iters)
            except Exception as e:  # keep going: one failing impl should not hide the rest
                print(f"[bench] {name} failed on {cfg}: {type(e).__name__}: {str(e)[:300]}")
                continue
            row["ms"][name] = round(sec * 1e3, 4)
            row["gbps"][name] = round(nbytes / sec / 1e9, 2)
            row["tflops"][name] = round(flops / sec / 1e12, 3)
        ref = outs.get("reference")
        for name, out in outs.items():
            if ref is not None:
                diff = jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32)))
                row["max_abs_diff"][name] = float(diff)
        rows.append(row)
        cells = " ".join(f"{row['ms'].get(n, float('nan')):>14.3f}" for n in impls)
        diffs = ", ".join(f"{n}={v:.2e}" for n, v in row["max_abs_diff"].items()
                          if n != "reference")
        print(f"{str(cfg):>34} {cells}  {diffs}")
    return rows


def decode_work(cfg, inputs):
    batch, ctx, h, hkv, d, bs = cfg
    toks = int(jnp.sum(inputs[4]))
    itemsize = inputs[1].dtype.itemsize
    return 2 * toks * hkv * d * itemsize, 4 * toks * h * d  # K+V read, QK + PV flops


def prefill_work(cfg, inputs):
    _, _, _, h, hkv, d, _ = cfg
    kv_lens, q_lens = np.asarray(inputs[4]), np.asarray(inputs[5])
    seen = sum(int(np.sum(np.arange(kv - ql, kv) + 1)) for kv, ql in zip(kv_lens, q_lens))
    return 2 * int(kv_lens.sum()) * hkv * d * inputs[1].dtype.itemsize, 4 * seen * h * d


def bench_cpu_decode(iters, skew, out_path):
    """One decode step's attention (30 layers) of a SmolLM2-135M-shaped model, XLA paths."""
    c = SMOL
    rng = np.random.default_rng(0)
    s, bs, nb, mb = c["batch"], c["page_size"], c["num_pages"], c["max_blocks"]
    hkv, h, d = c["kv_heads"], c["heads"], c["head_dim"]
    ks = [jnp.asarray(rng.standard_normal((hkv, nb, bs, d)), jnp.float32)
          for _ in range(c["layers"])]
    vs = [jnp.asarray(rng.standard_normal((hkv, nb, bs, d)), jnp.float32)
          for _ in range(c["layers"])]
    q = jnp.asarray(rng.standard_normal((s, 1, h, d)), jnp.float32)
    base_lens = rng.integers(*c["ctx"], s).astype(np.int32)
    scenarios = {"uniform": base_lens}
    if skew:
        skewed = base_lens.copy()
        skewed[3] = skew
        scenarios[f"one_at_{skew}"] = skewed
    results = []
    from pagedjax.pallas_kernels.paged_attention.ops import native_supported

    impls = ["chunked", "ragged"] + (["native"] if native_supported(jnp.float32, jnp.float32) else [])
    print(f"[bench] cpu-decode {c}; per step = {c['layers']} attention calls")
    print(f"{'scenario':>16} {'impl':>8} {'wall min':>9} {'wall med':>9} {'cpu med':>9} ms"
          f"  max|diff| vs reference (layer 0)")
    for scen, lens in scenarios.items():
        need = -(-lens // bs)
        assert need.sum() <= nb, "pool too small for the scenario"
        tables = np.zeros((s, mb), np.int32)
        perm = rng.permutation(nb)
        tables[np.arange(mb)[None, :] < need[:, None]] = perm[:need.sum()]
        args = (jnp.asarray(tables), jnp.asarray(lens), jnp.ones((s,), jnp.int32))
        ref = paged_attention(q, ks[0], vs[0], *args, scale=d ** -0.5, impl="reference")
        for impl in impls:
            @jax.jit
            def step(q, ks, vs, tables, kv_lens, q_lens, impl=impl):
                x = q
                for k, v in zip(ks, vs):  # chained like the layers of one step
                    x = paged_attention(x, k, v, tables, kv_lens, q_lens, scale=d ** -0.5,
                                        impl=impl)
                return x
            layer0 = paged_attention(q, ks[0], vs[0], *args, scale=d ** -0.5, impl=impl)
            diff = float(jnp.max(jnp.abs(layer0 - ref)))
            jax.block_until_ready(step(q, ks, vs, *args))
            wall, cpu = [], []
            for _ in range(iters):
                t0, c0 = time.perf_counter(), time.process_time()
                jax.block_until_ready(step(q, ks, vs, *args))
                wall.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
            row = dict(scenario=scen, impl=impl, kv_lens=lens.tolist(),
                       wall_ms_min=round(min(wall) * 1e3, 2),
                       wall_ms_median=round(statistics.median(wall) * 1e3, 2),
                       cpu_ms_median=round(statistics.median(cpu) * 1e3, 2),
                       max_abs_diff=diff)
            results.append(row)
            print(f"{scen:>16} {impl:>8} {row['wall_ms_min']:>9.2f} "
                  f"{row['wall_ms_median']:>9.2f} {row['cpu_ms_median']:>9.2f}     {diff:.1e}")
    _write(out_path, dict(backend=jax.default_backend(), config=c, iters=iters,
                          results=results))
    return results


def _write(path, payload):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    print(f"[bench] wrote {path}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small configs (default on CPU)")
    ap.add_argument("--prefill", action="store_true", help="Q > 1 (prefill) instead of decode")
    ap.add_argument("--cpu-decode", action="store_true",
                    help="XLA decode attention of one SmolLM2-135M-shaped step")
    ap.add_argument("--skew", type=int, default=2000,
                    help="--cpu-decode: also run with one sequence this long (0: skip)")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    backend = jax.default_backend()
    if args.cpu_decode:
        return bench_cpu_decode(args.iters or 20, args.skew,
                                args.out or "results/bench_cpu_decode.json")
    quick = args.quick or backend == "cpu"
    iters = args.iters or (3 if backend == "cpu" else 20)
    dtype = jnp.dtype(args.dtype)
    impls = impls_for_backend(backend)
    print(f"[bench] backend={backend} device={jax.devices()[0].device_kind} dtype={dtype.name}")
    if args.prefill:
        label = "(batch,Q,prefix,H,Hkv,D,BS)"
        rows = _run_table(label, PREFILL_QUICK if quick else PREFILL_FULL, make_prefill_inputs,
                          paged_attention, prefill_work, impls, iters, dtype, backend)
        out = args.out or "results/bench_prefill.json"
    else:
        label = "(batch,ctx,H,Hkv,D,BS)"
        rows = _run_table(label, QUICK if quick else FULL, make_inputs, paged_decode_attention,
                          decode_work, impls, iters, dtype, backend)
        out = args.out or "results/bench_kernels.json"
    _write(out, dict(backend=backend, device=jax.devices()[0].device_kind, iters=iters,
                     impls=impls, results=rows))
    return rows


if __name__ == "__main__":
    main()
