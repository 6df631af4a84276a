"""The host KV tier (kv_offload_gb) on a multi-turn chat whose shared prefixes exceed the device
pool 4x (issue 50): no tier vs host tier, side by side in one run.

C conversations, each a long document of its own (the shared prefix: a system prompt, a RAG
document) and T turns; the turns go round-robin over the conversations, one request at a
time, so by the time a conversation speaks again every other one has been through the pool
and its prefix was evicted from the device. Each turn's prompt is the document, the earlier
turns (questions and answers) and a new question. Per configuration it prints:
  recomputed   prompt tokens the engine computed (stats' num_computed_prompt_tokens)
  turns 2+     the same, first turns left out (their prompts are new: no tier can save them)
  host hit     prompt tokens loaded back from the host tier instead
  TTFT p50/p90 time from add_request to the first token, per turn (first turns included)
  tok/s        (prompt + generated tokens) / wall time of the whole workload
  req/s        requests / wall time
Each engine runs a warm-up workload of the same shapes (another seed) first, so compiles are
out of the timings. Outputs are greedy: the two configurations' tokens are compared.

    python scripts/bench_kv_tiers.py [--model DIR] [--conversations 6] [--turns 3] [--doc-len 512]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from pagedjax import SamplingParams
from pagedjax.engine.llm_engine import LLMEngine


def conversation_prompts(engine, rng, conversations: int, doc_len: int):
    """Each conversation's document, as token ids (random in-vocabulary tokens)."""
    vocab = engine.model_config.vocab_size
    return [rng.integers(100, vocab - 100, doc_len).tolist() for _ in range(conversations)]


def run(engine, args, seed: int) -> dict:
    """The workload once; -> timings, counts and every turn's output tokens."""
    rng = np.random.default_rng(seed)
    docs = conversation_prompts(engine, rng, args.conversations, args.doc_len)
    history = [list(d) for d in docs]
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    before = engine.stats()
    ttft, outputs, tokens, first_turn = [], [], 0, 0
    began = time.perf_counter()
    for turn in range(args.turns):
        if turn == 1:  # later turns: what the tier can save (a first turn computes its prompt anyway)
            first_turn = engine.stats()["num_computed_prompt_tokens"] - before["num_computed_prompt_tokens"]
        for c in range(args.conversations):
            prompt = history[c] + rng.integers(100, vocab - 100, args.question_len).tolist()
            rid = f"s{seed}-t{turn}-c{c}"
            t0 = time.perf_counter()
            engine.add_request(rid, prompt, params)
            first, out = None, None
            while engine.has_unfinished_requests():
                for o in engine.step():
                    if first is None and o.outputs and o.outputs[0].token_ids:
                        first = time.perf_counter() - t0
                    if o.finished:
                        out = list(o.outputs[0].token_ids)
            ttft.append(first)
            outputs.append(out)
            history[c] = prompt + out
            tokens += len(prompt) + len(out)
    wall = time.perf_counter() - began
    after = engine.stats()
    delta = lambda k: after.get(k, 0) - before.get(k, 0)  # noqa: E731
    return {"wall": wall, "ttft": ttft, "outputs": outputs, "tokens": tokens, "requests": len(ttft),
            "recomputed": delta("num_computed_prompt_tokens"),
            "later": delta("num_computed_prompt_tokens") - first_turn, "host_hit": delta("kv_offload_host_hit_tokens"),
            "device_hit": delta("prefix_cache_hit_tokens"), "copy_s": delta("kv_offload_copy_seconds")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF model dir (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--doc-len", type=int, default=512, help="tokens of each conversation's shared document")
    p.add_argument("--question-len", type=int, default=24)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prefix-to-pool", type=float, default=4.0, help="all documents' tokens / device pool tokens")
    p.add_argument("--kv-offload-gb", type=float, default=1.0)
    p.add_argument("--dtype", default="auto")
    args = p.parse_args()

    total_prefix = args.conversations * args.doc_len
    longest = args.doc_len + args.turns * (args.question_len + args.output_len) + args.output_len
    bs = args.block_size
    num_blocks = max(int(total_prefix / args.prefix_to_pool) // bs, -(-longest // bs) + 1)
    print(f"{args.conversations} conversations x {args.turns} turns, documents of {args.doc_len} tokens "
          f"({total_prefix} shared prefix tokens), device pool {num_blocks} blocks x {bs} = {num_blocks * bs} tokens "
          f"({total_prefix / (num_blocks * bs):.1f}x), output {args.output_len} tokens, one request at a time")
    results = {}
    for name, gb in (("no tiers", None), ("host tier", args.kv_offload_gb)):
        engine = LLMEngine(args.model, stream_text=True, block_size=bs, num_blocks=num_blocks, max_num_seqs=4,
                           max_model_len=max(1024, 2 * longest), dtype=args.dtype, kv_offload_gb=gb)
        run(engine, args, seed=1)  # warm-up: the same shapes, other tokens (compiles here, not below)
        results[name] = run(engine, args, seed=0)
        del engine
    print(f"{'':10} {'recomputed':>10} {'turns 2+':>9} {'host hit':>9} {'dev hit':>8} {'TTFT p50':>9} {'TTFT p90':>9} "
          f"{'tok/s':>8} {'req/s':>6} {'copy s':>7}")
    for name, r in results.items():
        p50, p90 = np.percentile(r["ttft"], [50, 90])
        print(f"{name:10} {r['recomputed']:>10} {r['later']:>9} {r['host_hit']:>9} {r['device_hit']:>8} {p50 * 1e3:>7.0f}ms "
              f"{p90 * 1e3:>7.0f}ms {r['tokens'] / r['wall']:>8.0f} {r['requests'] / r['wall']:>6.2f} "
              f"{r['copy_s']:>7.2f}")
    base, host = results["no tiers"], results["host tier"]
    same = base["outputs"] == host["outputs"]
    p50 = np.percentile(base["ttft"], 50) / np.percentile(host["ttft"], 50)
    print(f"recomputed prompt tokens: {1 - host['recomputed'] / base['recomputed']:.0%} fewer with the host tier "
          f"({1 - host['later'] / base['later']:.0%} fewer in turns 2+); "
          f"TTFT p50 {p50:.2f}x lower; greedy outputs identical: {same}")


if __name__ == "__main__":
    main()
