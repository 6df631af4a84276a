"""Mixture-of-experts cost: one model step computing only the chosen experts against the same
model computing every expert for every token, side by side in one run.

A random Mixtral-shaped checkpoint (transformers, float32 on disk; --dtype for the run) with
--experts experts, top --top-k, is loaded once per expert matmul (models/moe.py):
- sorted: the (token, expert) pairs sorted by expert, a loop over the chosen experts' rows
          (XLA:CPU's default);
- ragged: the same rows through jax.lax.ragged_dot (the accelerators' default);
- dense:  every expert on every token, the unchosen weighted 0 (the baseline).
Each step is the whole model (embedding, attention over a paged cache, the MoE layers, final
norm) at a fixed token count: decode steps (T sequences, one token each, 64 tokens of context)
and prefill chunks (one sequence, T new tokens). Timings interleave the three models, median
of --repeats with the min-max spread. "floor" is the step time of dense scaled by the share of
expert FLOPs top-k needs (k / X of the MLP), with the attention and the rest as measured: what
a perfect grouped matmul would reach if the MLP dominated.

    python scripts/bench_moe.py                      # 8 experts, top-2, hidden 512, expert 1024
    python scripts/bench_moe.py --tokens 8,64,512 --repeats 9 --json out.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def make_checkpoint(path: Path, args) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=4096, hidden_size=args.hidden, intermediate_size=args.expert_size,
                                     num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2,
                                     num_local_experts=args.experts, num_experts_per_tok=args.top_k,
                                     max_position_embeddings=4096, tie_word_embeddings=False)
    transformers.MixtralForCausalLM(cfg).save_pretrained(str(path))


def step_inputs(kind: str, t: int, block_size: int = 16, context: int = 64):
    """(tokens [T], AttentionMetadata, blocks needed) of a decode step of T sequences or a
    prefill chunk of T tokens."""
    import jax.numpy as jnp
    import numpy as np

    from pagedjax.models.kv_cache import AttentionMetadata

    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(2, 4096, size=t), jnp.int32)
    if kind == "decode":  # sequence s owns blocks [s * nb, (s + 1) * nb), its token at position `context`
        nb = -(-(context + 1) // block_size)
        tables = np.arange(t * nb, dtype=np.int32).reshape(t, nb)
        pos = np.full(t, context, np.int32)
        slots = tables[:, context // block_size] * block_size + context % block_size
        md = AttentionMetadata(jnp.asarray(pos), jnp.asarray(slots, jnp.int32), jnp.asarray(tables),
                               jnp.full(t, context + 1, jnp.int32), jnp.arange(t + 1, dtype=jnp.int32))
        return tokens, md, t * nb
    nb = -(-t // block_size)
    md = AttentionMetadata(jnp.arange(t, dtype=jnp.int32), jnp.arange(t, dtype=jnp.int32),
                           jnp.arange(nb, dtype=jnp.int32)[None], jnp.asarray([t], jnp.int32),
                           jnp.asarray([0, t], jnp.int32))
    return tokens, md, nb


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--expert-size", type=int, default=1024, help="each expert's intermediate size")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", default="8,32,128,512", help="step sizes (decode: sequences; prefill: tokens)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import jax
    import numpy as np
    from flax import nnx

    from pagedjax.models.kv_cache import PagedKVCache, init_kv_cache
    from pagedjax.models.loader import load_model

    impls = ("sorted", "ragged", "dense")
    path = Path(tempfile.mkdtemp(prefix="bench-moe-"))
    make_checkpoint(path, args)
    models = {impl: load_model(path, args.dtype, scan_layers=False, moe_impl=impl)[0] for impl in impls}
    cfg = models["dense"].config
    sizes = [int(x) for x in args.tokens.split(",")]
    print(f"# {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_experts} experts of "
          f"{cfg.moe_intermediate_size}, top-{cfg.num_experts_per_tok}, {args.dtype}, backend {jax.default_backend()}")
    print(f"{'step':>16} " + " ".join(f"{i + ' ms':>22}" for i in impls) + f" {'sorted/dense':>13} {'floor ms':>9}")
    results = []
    for kind in ("decode", "prefill"):
        for t in sizes:
            tokens, md, blocks = step_inputs(kind, t)
            cache = PagedKVCache(blocks, 16)
            kv = init_kv_cache(cache, cfg.num_layers, models["dense"].num_kv_heads, cfg.head_dim,
                               models["dense"].dtype)
            steps = {}
            for impl, model in models.items():
                graphdef, state = nnx.split(model)

                def run(state, kv, tokens, md, graphdef=graphdef):
                    m = nnx.merge(graphdef, state)
                    hidden, kv = m(tokens, md, kv, cache)
                    return m.logits(hidden[-1:]), kv

                fn = jax.jit(run)
                jax.block_until_ready(fn(state, kv, tokens, md))  # compile
                steps[impl] = (fn, state)
            times = {impl: [] for impl in impls}
            for _ in range(args.repeats):
                for impl, (fn, state) in steps.items():
                    t0 = time.perf_counter()
                    jax.block_until_ready(fn(state, kv, tokens, md))
                    times[impl].append((time.perf_counter() - t0) * 1e3)
            med = {i: statistics.median(v) for i, v in times.items()}
            # the MLP's share of dense, scaled to k of X experts (attention and the rest unchanged)
            mlp_share = _mlp_share(cfg, kind, t)
            floor = med["dense"] * (1 - mlp_share + mlp_share * cfg.num_experts_per_tok / cfg.num_experts)
            cells = " ".join(f"{med[i]:9.2f} [{min(times[i]):6.2f}-{max(times[i]):6.2f}]" for i in impls)
            print(f"{kind + ' T=' + str(t):>16} {cells} {med['sorted'] / med['dense']:13.2f} {floor:9.2f}")
            results.append({"kind": kind, "tokens": t, "median_ms": med, "all_ms": times, "floor_ms": floor,
                            "mlp_flop_share_dense": mlp_share})
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


def _mlp_share(cfg, kind: str, t: int) -> float:
    """The experts' share of the dense model's FLOPs in this step (matmuls and attention scores)."""
    e, d = cfg.hidden_size, cfg.head_dim
    attn_proj = 2 * t * e * (cfg.num_heads + 2 * cfg.num_kv_heads) * d + 2 * t * cfg.num_heads * d * e
    ctx = 65 if kind == "decode" else t / 2
    attn = 4 * t * ctx * cfg.num_heads * d
    experts = 2 * t * e * 3 * cfg.moe_intermediate_size * cfg.num_experts
    return experts / (experts + attn_proj + attn)


if __name__ == "__main__":
    main()
