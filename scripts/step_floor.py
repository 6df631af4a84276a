"""Where a decode step's time goes: the engine's decode step against its matmuls alone.

`decode_step_ms`: the median wall time of the engine's decode steps at `rows` running
requests (host work, forward pass, sampler). `matmul_floor_ms`: the same step's matmuls only,
with the model's own weights and dtype (per layer qkv, o, gate/up, down; then the lm_head; the
glue between them is a slice, an add and a multiply), one jitted call at `rows` rows. The gap
is everything else: attention, norms, rope, KV writes, sampling, host.

    python scripts/step_floor.py [--model DIR] [--dtype bfloat16] [--rows 16]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def decode_step_ms(engine, prompts: list[list[int]], steps: int = 24) -> float:
    """Median ms of the engine's last `steps` decode steps of these prompts (all running)."""
    from pagedjax import SamplingParams

    ids = [f"floor-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, SamplingParams(max_tokens=steps + 8, ignore_eos=True))
    times = []
    try:
        for _ in range(steps + 4):  # the prompts take the first step(s)
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
    finally:
        for rid in ids:
            engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()
    return 1e3 * float(np.median(times[-steps:]))


def matmul_floor_ms(model, rows: int = 16, iters: int = 30) -> float:
    """Median ms of the decode step's matmuls alone (see the module doc)."""
    import jax
    import jax.numpy as jnp

    from pagedjax.models.llama import linear

    cfg = model.config
    q_width, inter = cfg.num_heads * cfg.head_dim, cfg.intermediate_size
    names = ("attn.wqkv", "attn.wo", "mlp.w_gate_up", "mlp.w_down")

    def param(layer, name):  # (weight, its scale or None: quantized weights, models/quantization.py)
        mod, attr = name.split(".")
        scale = getattr(getattr(layer, mod), f"{attr}_scale")
        return getattr(getattr(layer, mod), attr)[...], None if scale is None else scale[...]

    if model.scan_layers:  # stacked [L, ...]
        weights = [tuple(jax.tree.map(lambda a: a[i], param(model.layers, n)) for n in names)
                   for i in range(cfg.num_layers)]
    else:
        weights = [tuple(param(layer, n) for n in names) for layer in model.layers]
    head = model.embed[...] if model.lm_head is None else model.lm_head[...]
    first = model.layers if model.scan_layers else model.layers[0]
    native = first.mlp.native  # the engine's path: bf16 decode matmuls in the native CPU kernel

    @jax.jit
    def chain(weights, head, x):
        mm = lambda x, w: linear(x, w[0], native, w[1], model.dtype)  # noqa: E731
        for wqkv, wo, w_gate_up, w_down in weights:
            qkv = mm(x, wqkv)
            x = x + mm(qkv[:, :q_width], wo)
            gu = mm(x, w_gate_up)
            x = x + mm(gu[:, :inter] * gu[:, inter:], w_down)
        return linear(x, head, model.native_head)

    x = jnp.ones((rows, cfg.hidden_size), jnp.float32)
    jax.block_until_ready(chain(weights, head, x))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(chain(weights, head, x))
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF model dir (default: random SmolLM2-135M-shaped Llama)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--quantization", default=None, choices=["int8", "fp8"])
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--prompt-len", type=int, default=128)
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_throughput import make_random_checkpoint

    from pagedjax.engine.llm_engine import LLMEngine

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            model_dir = tmp
            make_random_checkpoint(Path(tmp))
        engine = LLMEngine(model_dir, stream_text=False, max_num_seqs=args.rows, max_model_len=512,
                           enable_prefix_caching=False, dtype=args.dtype, quantization=args.quantization,
                           kv_cache_dtype=args.kv_cache_dtype)
        engine.warmup(progress=False)
        prompts = np.random.default_rng(0).integers(3, 1000, (args.rows, args.prompt_len)).tolist()
        step = decode_step_ms(engine, prompts)
        floor = matmul_floor_ms(engine.model, args.rows)
    what = ", ".join(x for x in (args.dtype, args.quantization and f"{args.quantization} weights",
                                 args.kv_cache_dtype != "auto" and f"{args.kv_cache_dtype} KV") if x)
    print(f"{what}: decode step {step:.1f} ms at {args.rows} rows; its matmuls alone {floor:.1f} ms "
          f"({100 * floor / step:.0f}%)")


if __name__ == "__main__":
    main()
