"""GRPO-shaped rollouts, side by side in one run: Tunix's own VanillaRollout against
pagedjax's PagedJaxRollout on the same actor.

The batch: P prompts x G samples x N new tokens (default 8 x 8 x 128), temperature 1, a
SmolLM2-135M-shaped Tunix Llama 3 (30 layers, hidden 576, 9 heads / 3 KV heads, vocab 49152,
tied embeddings; random weights, float32, the actor's dtype). Reports, each over --repeats
timed runs after one warm-up run (median and spread):
- rollout tokens/s of both engines;
- a full weight sync (update_params with the actor's whole state) against the floor, one
  jitted device copy of the same bytes;
- peak KV blocks held during a rollout with prompt sharing (equal prompts as one request of
  G samples, prefix caching on) and without (G separate requests, prefix caching off);
- compilations after the first rollout (further rollouts and a sync);
- PagedJaxRollout again with rollout_config.data_type=bfloat16 (its matrices in bf16, the
  native CPU kernels), beside the float32 figures.

    python scripts/bench_rollout.py [--prompts 8] [--samples 8] [--new-tokens 128] [--repeats 3]
Writes results/bench_rollout.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

SMOLLM2 = dict(num_layers=30, vocab_size=49152, embed_dim=576, hidden_dim=1536, num_heads=9, head_dim=64,
               num_kv_heads=3, rope_theta=100_000, norm_eps=1e-5, weight_tying=True)
WORDS = ("the model samples many answers for every prompt and the trainer scores them before the next step "
         "of reinforcement learning with group relative policy optimization on a small language model").split()


def build(args):
    from tunix.models.llama3 import model as llama3

    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    cfg = llama3.ModelConfig(**dict(SMOLLM2, num_layers=args.layers))
    with jax.set_mesh(mesh):
        actor = llama3.Llama3(cfg, rngs=nnx.Rngs(params=0))
    return mesh, actor


def prompts(args) -> list[str]:
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(WORDS, size=int(rng.integers(24, 40)))) for _ in range(args.prompts)]
    return [t for t in texts for _ in range(args.samples)]  # as Tunix hands them: each repeated G times


def timed(fn, repeats: int) -> tuple[list[float], object]:
    fn()  # warm-up (compiles)
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return times, out


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def peak_blocks(rollout, batch, config) -> int:
    engine = rollout.llm.engine
    peak = [0]

    def observe(_record):
        peak[0] = max(peak[0], sum(p.num_blocks - p.num_free for p in engine.pools))

    engine.step_observers.append(observe)
    try:
        rollout.generate(batch, config)
    finally:
        engine.step_observers.remove(observe)
    return peak[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="results/bench_rollout.json")
    args = ap.parse_args()

    from tunix.generate.tokenizer_adapter import TokenizerAdapter
    from tunix.rl.rollout import base_rollout, vanilla_rollout

    from pagedjax.integrations.tunix import PagedJaxRollout
    from pagedjax.models.default_model import default_model_dir
    from pagedjax.models.loader import load_tokenizer

    tokenizer = TokenizerAdapter(load_tokenizer(default_model_dir()))
    mesh, actor = build(args)
    batch = prompts(args)
    config = base_rollout.RolloutConfig(max_tokens_to_generate=args.new_tokens, max_prompt_length=64,
                                        kv_cache_size=64 + args.new_tokens, temperature=1.0, top_p=1.0, seed=0)
    c = actor.config
    n_tokens = lambda out: sum(len(t) for t in out.tokens)  # noqa: E731
    results = {"batch": f"{args.prompts} prompts x {args.samples} samples x {args.new_tokens} new tokens",
               "model": f"Tunix Llama 3, SmolLM2-135M shape, {args.layers} layers, float32, random weights",
               "backend": jax.default_backend(), "devices": str(jax.devices()[0])}
    with jax.set_mesh(mesh):
        vanilla = vanilla_rollout.VanillaRollout(actor, tokenizer, base_rollout.CacheConfig(
            cache_size=64 + args.new_tokens, num_layers=c.num_layers, num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim))
        times, out = timed(lambda: vanilla.generate(batch, config), args.repeats)
        results["vanilla"] = {"seconds": spread(times), "tokens": n_tokens(out),
                              "tokens_per_s": n_tokens(out) / statistics.median(times)}
        print(f"Tunix VanillaRollout : {results['vanilla']['tokens_per_s']:8.1f} tok/s  "
              f"(median {statistics.median(times):.2f} s, {min(times):.2f}-{max(times):.2f})", flush=True)
        del vanilla

        engine = dict(max_num_seqs=args.prompts * args.samples, block_size=16)
        ours = PagedJaxRollout(rollout_actor=actor, tokenizer=tokenizer, mesh=mesh, rollout_config=config, **engine)
        times, out = timed(lambda: ours.generate(batch, config), args.repeats)
        results["pagedjax"] = {"seconds": spread(times), "tokens": n_tokens(out),
                               "tokens_per_s": n_tokens(out) / statistics.median(times)}
        speedup = results["pagedjax"]["tokens_per_s"] / results["vanilla"]["tokens_per_s"]
        print(f"PagedJaxRollout      : {results['pagedjax']['tokens_per_s']:8.1f} tok/s  "
              f"(median {statistics.median(times):.2f} s, {min(times):.2f}-{max(times):.2f})  "
              f"{speedup:.2f}x vanilla (target >= 3x)", flush=True)
        state = nnx.state(actor, nnx.Param)
        nbytes = sum(x.nbytes for x in jax.tree.leaves(state))

        def sync():
            ours.update_params(state)
            jax.block_until_ready(ours.llm.engine.runner._weights)

        copy = jax.jit(lambda leaves: [x.copy() for x in leaves])
        leaves = jax.tree.leaves(state)
        floor_times, _ = timed(lambda: jax.block_until_ready(copy(leaves)), args.repeats)
        compiles = ours.llm.stats()["num_compilations"]  # (process-wide: after the floor's copy compiled)
        sync_times, _ = timed(sync, args.repeats)
        results["weight_sync"] = {"bytes": nbytes, "sync_seconds": spread(sync_times),
                                  "device_copy_seconds": spread(floor_times),
                                  "ratio": statistics.median(sync_times) / statistics.median(floor_times)}
        print(f"weight sync          : {statistics.median(sync_times) * 1e3:8.1f} ms for {nbytes / 2**20:.0f} MiB "
              f"({min(sync_times) * 1e3:.1f}-{max(sync_times) * 1e3:.1f}); plain device copy "
              f"{statistics.median(floor_times) * 1e3:.1f} ms: {results['weight_sync']['ratio']:.2f}x the floor "
              "(target <= 2x)", flush=True)

        ours.generate(batch, config)  # after a sync: still nothing to compile
        results["compilations_after_first_rollout"] = ours.llm.stats()["num_compilations"] - compiles
        print(f"compilations after the first rollout (rollouts and syncs): "
              f"{results['compilations_after_first_rollout']}", flush=True)

        shared = peak_blocks(ours, batch, config)
        del ours
        bf16 = dataclasses.replace(config, data_type=jnp.bfloat16)  # the engine's matrices in bf16 (native kernels)
        ours_bf16 = PagedJaxRollout(rollout_actor=actor, tokenizer=tokenizer, mesh=mesh, rollout_config=bf16, **engine)
        times, out = timed(lambda: ours_bf16.generate(batch, bf16), args.repeats)
        results["pagedjax_bf16"] = {"seconds": spread(times), "tokens": n_tokens(out),
                                    "tokens_per_s": n_tokens(out) / statistics.median(times)}
        print(f"PagedJaxRollout bf16 : {results['pagedjax_bf16']['tokens_per_s']:8.1f} tok/s  "
              f"(median {statistics.median(times):.2f} s, {min(times):.2f}-{max(times):.2f})  "
              f"{results['pagedjax_bf16']['tokens_per_s'] / results['vanilla']['tokens_per_s']:.2f}x vanilla "
              "(rollout_config.data_type=bfloat16; vanilla stays float32)", flush=True)
        del ours_bf16
        unshared_rollout = PagedJaxRollout(rollout_actor=actor, tokenizer=tokenizer, mesh=mesh, rollout_config=config,
                                           share_prompts=False, enable_prefix_caching=False, **engine)
        unshared = peak_blocks(unshared_rollout, batch, config)
        results["peak_kv_blocks"] = {"shared": shared, "unshared": unshared, "block_size": 16}
        print(f"peak KV blocks held  : {shared} with prompt sharing, {unshared} without "
              f"({1 - shared / unshared:.0%} fewer)", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
