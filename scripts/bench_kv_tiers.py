"""The KV tiers (kv_offload_gb, kv_offload_dir) on a multi-turn chat whose shared prefixes exceed
the device pool 4x (issue 50): no tier, host tier, host + disk tiers side by side in one run,
and the first-turn TTFT of an engine restarted on the disk tier's folder against a warm one's.

C conversations, each a long document of its own (the shared prefix: a system prompt, a RAG
document) and T turns; the turns go round-robin over the conversations, one request at a
time, so by the time a conversation speaks again every other one has been through the pool
and its prefix was evicted from the device. Each turn's prompt is the document, the earlier
turns (questions and answers) and a new question. Per configuration it prints:
  recomputed   prompt tokens the engine computed (stats' num_computed_prompt_tokens)
  turns 2+     the same, first turns left out (their prompts are new: no tier can save them)
  host hit     prompt tokens loaded back from the host tier instead
  disk hit     prompt tokens loaded back from the disk tier instead
  TTFT p50/p90 time from add_request to the first token, per turn (first turns included)
  tok/s        (prompt + generated tokens) / wall time of the whole workload
  req/s        requests / wall time
Each engine runs a warm-up workload of the same shapes (another seed) first, so compiles are
out of the timings. Outputs are greedy: the configurations' tokens are compared.

Restart: the host + disk engine is closed (its pending writes flushed) and a new engine (host +
disk, same folder) is made and warmed up on other documents; then every conversation's first
turn is asked again, one at a time: "restarted" is their TTFT there (the documents come from
disk), "warm" their TTFT asked again on the first engine before it closed (device or host
hits), "cold" the first turns' TTFT of the no-tier run (computed).

    python scripts/bench_kv_tiers.py [--model DIR] [--conversations 6] [--turns 3] [--doc-len 512]
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
import time

import numpy as np

from pagedjax import SamplingParams
from pagedjax.engine.llm_engine import LLMEngine


def conversation_prompts(engine, rng, conversations: int, doc_len: int):
    """Each conversation's document, as token ids (random in-vocabulary tokens)."""
    vocab = engine.model_config.vocab_size
    return [rng.integers(100, vocab - 100, doc_len).tolist() for _ in range(conversations)]


def run(engine, args, seed: int, turns: int | None = None) -> dict:
    """The workload once (its first `turns` turns); -> timings, counts and every turn's output tokens."""
    rng = np.random.default_rng(seed)
    docs = conversation_prompts(engine, rng, args.conversations, args.doc_len)
    history = [list(d) for d in docs]
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    before = engine.stats()
    ttft, outputs, tokens, first_turn = [], [], 0, 0
    began = time.perf_counter()
    for turn in range(args.turns if turns is None else turns):
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
            "disk_hit": delta("kv_offload_disk_hit_tokens"), "read_s": delta("disk_kv_read_seconds"),
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
    p.add_argument("--max-model-len", type=int, default=None, help="default: max(1024, twice the longest turn)")
    args = p.parse_args()

    total_prefix = args.conversations * args.doc_len
    longest = args.doc_len + args.turns * (args.question_len + args.output_len) + args.output_len
    bs = args.block_size
    num_blocks = max(int(total_prefix / args.prefix_to_pool) // bs, -(-longest // bs) + 1)
    print(f"{args.conversations} conversations x {args.turns} turns, documents of {args.doc_len} tokens "
          f"({total_prefix} shared prefix tokens), device pool {num_blocks} blocks x {bs} = {num_blocks * bs} tokens "
          f"({total_prefix / (num_blocks * bs):.1f}x), output {args.output_len} tokens, one request at a time")
    folder = tempfile.mkdtemp(prefix="pagedjax-kv-disk-")
    make = lambda gb, disk: LLMEngine(  # noqa: E731
        args.model, stream_text=True, block_size=bs, num_blocks=num_blocks, max_num_seqs=4,
        max_model_len=args.max_model_len or max(1024, 2 * longest), dtype=args.dtype, kv_offload_gb=gb, kv_offload_dir=disk)
    results, restart = {}, {}
    for name, gb, disk in (("no tiers", None, None), ("host", args.kv_offload_gb, None),
                           ("host+disk", args.kv_offload_gb, folder)):
        engine = make(gb, disk)
        run(engine, args, seed=1)  # warm-up: the same shapes, other tokens (compiles here, not below)
        results[name] = run(engine, args, seed=0)
        if disk is not None:
            restart["warm"] = run(engine, args, seed=0, turns=1)  # the first turns again, on the warm engine
            engine.close_kv_tiers()  # as LLM.close() and the server's shutdown: the disk writes flushed
        del engine
    engine = make(args.kv_offload_gb, folder)  # restarted on the same folder
    run(engine, args, seed=2)  # warm-up: compiles (other documents)
    restart["restarted"] = run(engine, args, seed=0, turns=1)
    engine.close_kv_tiers()
    del engine
    shutil.rmtree(folder, ignore_errors=True)
    print(f"{'':10} {'recomputed':>10} {'turns 2+':>9} {'host hit':>9} {'disk hit':>9} {'dev hit':>8} "
          f"{'TTFT p50':>9} {'TTFT p90':>9} {'tok/s':>8} {'req/s':>6} {'copy s':>7}")
    for name, r in results.items():
        p50, p90 = np.percentile(r["ttft"], [50, 90])
        print(f"{name:10} {r['recomputed']:>10} {r['later']:>9} {r['host_hit']:>9} {r['disk_hit']:>9} "
              f"{r['device_hit']:>8} {p50 * 1e3:>7.0f}ms {p90 * 1e3:>7.0f}ms {r['tokens'] / r['wall']:>8.0f} "
              f"{r['requests'] / r['wall']:>6.2f} {r['copy_s']:>7.2f}")
    base = results["no tiers"]
    for name in ("host", "host+disk"):
        r = results[name]
        p50 = np.percentile(base["ttft"], 50) / np.percentile(r["ttft"], 50)
        print(f"{name}: {1 - r['recomputed'] / base['recomputed']:.0%} fewer recomputed prompt tokens "
              f"({1 - r['later'] / base['later']:.0%} fewer in turns 2+); TTFT p50 {p50:.2f}x lower; "
              f"greedy outputs identical: {r['outputs'] == base['outputs']}")
    cold = base["ttft"][:args.conversations]
    print(f"first-turn TTFT p50 (the {args.conversations} documents): cold (no tiers) "
          f"{np.percentile(cold, 50) * 1e3:.0f}ms, warm engine {np.percentile(restart['warm']['ttft'], 50) * 1e3:.0f}ms, "
          f"restarted on the disk tier {np.percentile(restart['restarted']['ttft'], 50) * 1e3:.0f}ms "
          f"({np.percentile(restart['restarted']['ttft'], 50) / np.percentile(restart['warm']['ttft'], 50):.2f}x warm; "
          f"disk hit {restart['restarted']['disk_hit']} tokens read in {restart['restarted']['read_s'] * 1e3:.0f}ms "
          f"while the engine waited, recomputed {restart['restarted']['recomputed']}); "
          f"outputs equal to the first run's: {restart['restarted']['outputs'] == restart['warm']['outputs']}")


if __name__ == "__main__":
    main()
