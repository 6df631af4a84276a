"""Time paged decode attention: the backend's Pallas kernel vs the jnp reference / chunked.

    PYTHONPATH=. python scripts/bench_kernels.py [--quick] [--iters N] [--out PATH]

Every implementation is jitted and timed on the current backend (median of N calls after
a warm-up). On CPU only "reference" and "chunked" run: compiled Pallas kernels need a GPU
or TPU. Prints a table and writes JSON (default results/bench_kernels.json).
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

from pallas_kernels import paged_decode_attention

# (batch, context, q heads, kv heads, head dim, page size)
FULL = [(8, 1024, 32, 8, 128, 16), (32, 2048, 32, 8, 128, 16), (64, 4096, 32, 8, 128, 16),
        (16, 8192, 16, 16, 128, 32), (128, 1024, 32, 4, 64, 16), (4, 16384, 32, 8, 128, 16)]
QUICK = [(4, 256, 8, 2, 64, 16), (8, 512, 16, 4, 128, 16), (2, 2048, 8, 8, 64, 32)]


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
              "timing reference vs chunked only")
        return ["reference", "chunked"]
    return [kernel, "chunked", "reference"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small configs (default on CPU)")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--out", default="results/bench_kernels.json")
    args = ap.parse_args(argv)
    backend = jax.default_backend()
    quick = args.quick or backend == "cpu"
    configs = QUICK if quick else FULL
    iters = args.iters or (3 if backend == "cpu" else 20)
    dtype = jnp.dtype(args.dtype)
    impls = impls_for_backend(backend)
    rows = []
    print(f"[bench] backend={backend} device={jax.devices()[0].device_kind} dtype={dtype.name}")
    header = f"{'batch':>5} {'ctx':>6} {'H/Hkv':>6} {'D':>4} {'BS':>3} " + " ".join(
        f"{name + ' ms':>14}" for name in impls) + "  max|diff| vs reference"
    print(header)
    for cfg in configs:
        batch, ctx, h, hkv, d, bs = cfg
        inputs = make_inputs(*cfg, dtype)
        kv_bytes = 2 * int(jnp.sum(inputs[4])) * hkv * d * dtype.itemsize  # K+V actually read
        row = dict(batch=batch, context=ctx, heads=h, kv_heads=hkv, head_dim=d, page_size=bs,
                   dtype=dtype.name, backend=backend, ms={}, gbps={}, max_abs_diff={})
        outs = {}
        for name in impls:
            fn = jax.jit(functools.partial(paged_decode_attention, impl=name))
            try:
                outs[name], sec = time_fn(fn, inputs, iters)
            except Exception as e:  # keep going: one failing impl should not hide the rest
                print(f"[bench] {name} failed on {cfg}: {type(e).__name__}: {str(e)[:300]}")
                continue
            row["ms"][name] = round(sec * 1e3, 4)
            row["gbps"][name] = round(kv_bytes / sec / 1e9, 2)
        ref = outs.get("reference")
        for name, out in outs.items():
            if ref is not None:
                diff = jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32)))
                row["max_abs_diff"][name] = float(diff)
        rows.append(row)
        cells = " ".join(f"{row['ms'].get(n, float('nan')):>14.3f}" for n in impls)
        diffs = ", ".join(f"{n}={v:.2e}" for n, v in row["max_abs_diff"].items()
                          if n != "reference")
        print(f"{batch:>5} {ctx:>6} {f'{h}/{hkv}':>6} {d:>4} {bs:>3} {cells}  {diffs}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(backend=backend, device=jax.devices()[0].device_kind, iters=iters,
                       impls=impls, results=rows), f, indent=2)
    print(f"[bench] wrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
