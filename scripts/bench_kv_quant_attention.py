"""Decode attention on the native CPU kernel: bfloat16 pages vs int8 / float8_e4m3fn pages
(kv_quant.py, float16 scales per token and kv head), same shapes.

    python scripts/bench_kv_quant_attention.py [--seqs 16 --kv-len 1024 --kv-heads 3 --group 3
                                                --head-dim 64 --block 16 --repeats 50]

One call = one layer's decode attention (1 query token per sequence). The page kinds are timed
in alternation (each round calls every kind once, in a rotating order) so that drift in the
machine's speed hits them alike; prints median, p10-p90 and min per call, in ms.
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.pallas_kernels.paged_attention import cpu_native
from pagedjax.pallas_kernels.paged_attention.kv_quant import quantize


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--kv-len", type=int, default=1024)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--group", type=int, default=3, help="query heads per kv head")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--f32", action="store_true", help="also time float32 pages")
    a = ap.parse_args()
    if not cpu_native.available():
        raise SystemExit("the native kernel is unavailable (no C++ compiler, or PAGEDJAX_NATIVE_ATTENTION=0)")

    rng = np.random.default_rng(0)
    s, hkv, g, d, bs = a.seqs, a.kv_heads, a.group, a.head_dim, a.block
    mb = -(-a.kv_len // bs)
    nb = s * mb + 8  # a few blocks no sequence uses
    q = jnp.asarray(rng.standard_normal((s, 1, hkv * g, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((hkv, nb, bs, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((hkv, nb, bs, d)), jnp.float32)
    tables = jnp.asarray(rng.permutation(nb)[: s * mb].reshape(s, mb), jnp.int32)  # scattered pages
    kv_lens = jnp.full((s,), a.kv_len, jnp.int32)
    q_lens = jnp.ones((s,), jnp.int32)
    scale = d ** -0.5

    attend = jax.jit(lambda q, k, v, ks, vs: cpu_native.paged_attention_native(
        q, k, v, tables, kv_lens, q_lens, scale=scale, k_scales=ks, v_scales=vs))
    kinds = {}
    if a.f32:
        kinds["float32"] = (k, v, None, None)
    kinds["bfloat16"] = (k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), None, None)
    for dtype in (jnp.int8, jnp.float8_e4m3fn):
        (kq, ks), (vq, vs) = quantize(k, dtype), quantize(v, dtype)
        kinds[jnp.dtype(dtype).name] = (kq, vq, ks, vs)
    for pages in kinds.values():  # compile, warm the caches
        for _ in range(3):
            attend(q, *pages).block_until_ready()

    times = {name: [] for name in kinds}
    names = list(kinds)
    for r in range(a.repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            t0 = time.perf_counter()
            attend(q, *kinds[name]).block_until_ready()
            times[name].append((time.perf_counter() - t0) * 1e3)

    page_bytes = lambda pages: sum(x.nbytes for x in pages if x is not None)
    print(f"decode attention, native CPU kernel: {s} sequences x {a.kv_len} tokens, {hkv} kv heads x {g} q "
          f"heads, D {d}, block {bs}; {a.repeats} calls each ({jax.device_count()} device, {jax.devices()[0]})")
    print(f"{'pages':<15}{'median ms':>10}{'p10-p90 ms':>16}{'min ms':>9}{'pool MiB':>10}{'vs bf16':>9}")
    base = float(np.median(times["bfloat16"]))
    for name, ts in times.items():
        ts = np.asarray(ts)
        med, p10, p90 = np.median(ts), np.percentile(ts, 10), np.percentile(ts, 90)
        print(f"{name:<15}{med:>10.3f}{f'{p10:.3f}-{p90:.3f}':>16}{ts.min():>9.3f}"
              f"{page_bytes(kinds[name]) / 2**20:>10.1f}{med / base:>8.2f}x")


if __name__ == "__main__":
    main()
