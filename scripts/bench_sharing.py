"""What prefix sharing and forking save, measured on the block pool of a real run.

1. Shared system prompt: N requests share one S-token system prompt, each with a short
   distinct question. Runs with prefix caching on and off; reports prefill tokens computed,
   prefix-cache hit tokens (against the shareable ones) and peak KV blocks held.
2. Parallel sampling (n=4) and beam search (width 4): peak KV blocks held with block sharing
   against what the same live sequences would hold unshared (each its own blocks), sampled
   every step.

    python scripts/bench_sharing.py [--model DIR] [--num-requests 100] [--system-len 500]
Writes results/bench_sharing.json.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from pagedjax import LLM, BeamSearchParams, SamplingParams


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def run_tracking(llm: LLM, submit) -> dict:
    """Steps the engine until idle; tracks peak held blocks and the unshared counterfactual."""
    eng = llm.engine
    submit(eng)
    bs = eng.pool.block_size
    peak_held = peak_unshared = 0
    t = time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
        live = eng.scheduler.running
        peak_held = max(peak_held, eng.pool.num_blocks - eng.pool.num_free)
        peak_unshared = max(peak_unshared, sum(cdiv(r.num_tokens, bs) for r in live))
    return {"peak_blocks_held": peak_held, "peak_blocks_unshared": peak_unshared,
            "saving": 1 - peak_held / peak_unshared if peak_unshared else 0.0,
            "seconds": time.perf_counter() - t}


def system_prompt_scenario(args, tokenizer_vocab: int) -> dict:
    rng = np.random.default_rng(0)
    system = rng.integers(10, tokenizer_vocab, size=args.system_len).tolist()
    prompts = [system + rng.integers(10, tokenizer_vocab, size=int(rng.integers(8, 24))).tolist()
               for _ in range(args.num_requests)]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    out = {}
    for caching in (True, False):
        llm = LLM(args.model, enable_prefix_caching=caching, max_num_seqs=args.max_num_seqs,
                  max_model_len=args.max_model_len, warmup=False)
        before = llm.stats()

        def submit(eng):
            for i, p in enumerate(prompts):
                eng.add_request(f"r{i}", p, params)

        track = run_tracking(llm, submit)
        s = llm.stats()
        bs = s["block_size"]
        shareable = (args.num_requests - 1) * (args.system_len // bs) * bs
        out["caching_on" if caching else "caching_off"] = {
            "prefill_tokens_computed": s["num_computed_prompt_tokens"] - before["num_computed_prompt_tokens"],
            "prompt_tokens": sum(map(len, prompts)),
            "prefix_cache_hit_tokens": s["prefix_cache_hit_tokens"],
            "shareable_tokens": shareable,
            "hit_fraction_of_shareable": s["prefix_cache_hit_tokens"] / shareable,
            "peak_blocks_held": track["peak_blocks_held"],
            "seconds": round(track["seconds"], 2),
        }
        del llm
    return out


def fork_scenarios(args, vocab: int) -> dict:
    rng = np.random.default_rng(1)
    prompts = [rng.integers(10, vocab, size=int(rng.integers(100, 300))).tolist() for _ in range(4)]
    llm = LLM(args.model, max_num_seqs=16, max_model_len=args.max_model_len, warmup=False)

    def parallel(eng):
        for i, p in enumerate(prompts):
            eng.add_request(f"n{i}", p, SamplingParams(n=4, max_tokens=args.fork_output_len, temperature=1.0,
                                                        seed=i, ignore_eos=True))

    def beams(eng):
        for i, p in enumerate(prompts):
            eng.add_beam_search(f"b{i}", p, BeamSearchParams(beam_width=4, max_tokens=args.fork_output_len))

    result = {"parallel_sampling_n4": run_tracking(llm, parallel)}
    result["beam_search_w4"] = run_tracking(llm, beams)
    result["beam_search_w4"]["cow_copies_total"] = llm.stats()["num_cow_copies"]
    result["workload"] = {"prompts": len(prompts), "prompt_lens": [len(p) for p in prompts],
                          "output_len": args.fork_output_len}
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF model dir (default: the embedded default model)")
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--system-len", type=int, default=500)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--fork-output-len", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--out", default="results/bench_sharing.json")
    args = p.parse_args()
    from pagedjax.models.config import load_config
    from pagedjax.models.loader import resolve_model_dir

    vocab = load_config(resolve_model_dir(args.model)).vocab_size
    result = {"args": vars(args), "system_prompt": system_prompt_scenario(args, vocab),
              "forks": fork_scenarios(args, vocab)}
    sp = result["system_prompt"]
    print(f"shared {args.system_len}-token system prompt, {args.num_requests} requests:")
    for k in ("caching_on", "caching_off"):
        r = sp[k]
        print(f"  {k:12s} prefill tokens {r['prefill_tokens_computed']:7d} / {r['prompt_tokens']}  "
              f"hits {r['prefix_cache_hit_tokens']:6d} ({100 * r['hit_fraction_of_shareable']:.1f}% of shareable)  "
              f"peak blocks {r['peak_blocks_held']}")
    for k in ("parallel_sampling_n4", "beam_search_w4"):
        r = result["forks"][k]
        print(f"  {k:22s} peak blocks {r['peak_blocks_held']} shared vs {r['peak_blocks_unshared']} unshared "
              f"-> {100 * r['saving']:.1f}% saved")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
