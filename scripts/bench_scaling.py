"""Tensor and data parallelism on virtual CPU devices: tokens/s, per-device weight and KV
bytes, and what fits a per-device memory budget, for tp 1/2/4/8 and dp 1/2.

The virtual devices (XLA_FLAGS=--xla_force_host_platform_device_count=8) share this
machine's cores, so the tokens/s column measures the overhead of splitting (collectives,
shard_map, smaller matmuls), not a speed-up. The bytes are read from the arrays' shards.
Each layout runs in a fresh subprocess on the same random Llama-shaped checkpoint (8 query
heads, 2 KV heads: tp 4 and 8 replicate KV heads), the same requests, greedy; the outputs
are checked against tp 1 x dp 1. Writes JSON and a markdown table.

    python scripts/bench_scaling.py [--layouts 1x1,2x1,4x1,8x1,1x2,2x2] [--budget-gib 16]
        [--num-prompts 16] [--prompt-len 64] [--output-len 32] [--out results/bench_scaling.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=12,
             num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
             rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)

CHILD = r"""
import json, os, sys, time
import numpy as np
tp, dp, model, n, plen, olen = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], *map(int, sys.argv[4:7])
from pagedjax import LLM, SamplingParams
llm = LLM(model, tensor_parallel_size=tp, data_parallel_size=dp, max_num_seqs=16, max_model_len=512,
          max_num_batched_tokens=256, num_blocks=256, enable_prefix_caching=False)
llm.wait_for_warmup()
rng = np.random.default_rng(0)
prompts = [rng.integers(3, 32000, plen).tolist() for _ in range(n)]
params = SamplingParams(max_tokens=olen, ignore_eos=True)
llm.generate(prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
times = []
for _ in range(2):
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    times.append(time.perf_counter() - t)
s = llm.stats()
print("RESULT " + json.dumps({"tp": tp, "dp": dp, "seconds": times, "tokens": n * olen,
      "weights_per_device": max(s["weight_bytes_per_device"].values()),
      "kv_pool_per_device": max(s["kv_pool_bytes_per_device"].values()),
      "kv_blocks_per_rank": s["data_parallel_ranks"][0]["kv_blocks_total"], "block_size": s["block_size"],
      "kv_bytes_per_token": s["kv_bytes_per_token"], "outputs": [list(o.outputs[0].token_ids) for o in outs]}))
"""


def run_layout(tp: int, dp: int, model: str, args) -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tp), str(dp), model, str(args.num_prompts),
                           str(args.prompt_len), str(args.output_len)], capture_output=True, text=True, env=env)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise RuntimeError(f"tp={tp} dp={dp} failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def fits(r: dict, budget: int) -> dict:
    """What a per-device budget holds in this layout: KV tokens per device once the weights
    are in, the batch of 512-token sequences that makes per data rank, and the largest model
    of this shape family (weights only, float32) the tp devices hold together."""
    per_token_per_device = r["kv_pool_per_device"] / (r["kv_blocks_per_rank"] * r["block_size"])
    kv_tokens = max(0, budget - r["weights_per_device"]) / per_token_per_device
    return {"kv_tokens_per_device": int(kv_tokens), "seqs_of_512_per_rank": int(kv_tokens // 512),
            "largest_model_params_billion": round(budget * r["tp"] / 4 / 1e9, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", default="1x1,2x1,4x1,8x1,1x2,2x2", help="comma list of TPxDP")
    p.add_argument("--budget-gib", type=float, default=16.0, help="per-device memory for the fit columns")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--out", default="results/bench_scaling.json")
    args = p.parse_args()
    budget = int(args.budget_gib * (1 << 30))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**MODEL)).save_pretrained(tmp)
        for layout in args.layouts.split(","):
            tp, dp = (int(x) for x in layout.split("x"))
            t = time.perf_counter()
            r = run_layout(tp, dp, tmp, args)
            r.update(fits(r, budget), process_seconds=time.perf_counter() - t)
            rows.append(r)
            print(f"tp={tp} dp={dp}: {r['tokens'] / min(r['seconds']):.1f} tok/s", flush=True)
    ref = rows[0]["outputs"]
    lines = ["| tp x dp | devices | tok/s (best of 2) | weights / device (MiB) | KV pool / device (MiB) | "
             f"KV tokens / device in {args.budget_gib:g} GiB | 512-token seqs / rank | largest f32 model (B params) "
             "| outputs = first row |", "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['tp']} x {r['dp']} | {r['tp'] * r['dp']} | {r['tokens'] / min(r['seconds']):.1f} | "
                     f"{r['weights_per_device'] / 2**20:.1f} | {r['kv_pool_per_device'] / 2**20:.1f} | "
                     f"{r['kv_tokens_per_device']:,} | {r['seqs_of_512_per_rank']:,} | "
                     f"{r['largest_model_params_billion']} | {'yes' if r['outputs'] == ref else 'NO'} |")
    table = "\n".join(lines)
    print("virtual CPU devices share 2 cores: tok/s shows the cost of splitting, not a speed-up")
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for r in rows:
        r.pop("outputs")
    out.write_text(json.dumps({"model": MODEL, "budget_gib": args.budget_gib, "rows": rows}, indent=1))
    out.with_suffix(".md").write_text(table + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
