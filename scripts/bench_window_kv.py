"""KV blocks held over a long generation by a model whose every layer has a sliding window,
with the blocks outside the window returned to the pool (release_window_blocks, the default)
and kept (--keep-window-blocks), side by side in one run on the same requests.

A random Mistral-shaped checkpoint (every layer slides over --window tokens) generates
--output-len tokens greedily after --prompt-len-token prompts, --num-requests at once; the
engine is stepped by hand and the pool's held blocks read after every step (float32: a
random model's near-tied logits would otherwise let batching differences flip tokens). Prints, for each
mode: peak blocks held (and KV MiB), mean blocks held, preemptions, wall time; and checks the
two modes produced the same tokens. The physical floor is the window itself: a request needs
at least cdiv(window, block_size) + 1 blocks at a time.

    python scripts/bench_window_kv.py [--window 256] [--prompt-len 512] [--output-len 1536]
        [--num-requests 8] [--block-size 16] [--num-blocks 2048]
"""
from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np

MODEL = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=8192,
             rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def run(path: str, release: bool, args) -> dict:
    from pagedjax import LLM, SamplingParams

    llm = LLM(path, block_size=args.block_size, num_blocks=args.num_blocks, max_num_seqs=args.num_requests,
              max_model_len=args.prompt_len + args.output_len + 1, max_num_batched_tokens=512,
              enable_prefix_caching=False, release_window_blocks=release, dtype="float32")
    llm.wait_for_warmup()
    engine, pool = llm.engine, llm.engine.pool
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    for i in range(args.num_requests):
        engine.add_request(str(i), rng.integers(3, MODEL["vocab_size"], args.prompt_len).tolist(), params)
    held, outputs = [], {}
    t = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        held.append(pool.num_blocks - pool.num_free)
    seconds = time.perf_counter() - t
    stats = llm.stats()
    return {"peak": max(held), "mean": float(np.mean(held)), "seconds": seconds,
            "preemptions": stats["num_preemptions"], "bytes_per_block": stats["kv_bytes_per_token"] * args.block_size,
            "free_at_end": pool.num_free == pool.num_blocks, "outputs": [outputs[str(i)] for i in range(len(outputs))]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=1536)
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=2048)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        import torch
        from transformers import MistralConfig, MistralForCausalLM

        torch.manual_seed(0)
        MistralForCausalLM(MistralConfig(**MODEL, sliding_window=args.window)).save_pretrained(tmp)
        rows = {"release": run(tmp, True, args), "keep": run(tmp, False, args)}
    floor = args.num_requests * (-(-args.window // args.block_size) + 1)
    mib = rows["keep"]["bytes_per_block"] / 2**20
    print(f"{args.num_requests} requests x ({args.prompt_len} prompt + {args.output_len} output) tokens, window "
          f"{args.window}, block_size {args.block_size}, {rows['keep']['bytes_per_block']} KV bytes per block")
    print(f"{'mode':<8} {'peak blocks':>11} {'peak KV MiB':>11} {'mean blocks':>11} {'preempt':>7} {'seconds':>8}")
    for name, r in rows.items():
        print(f"{name:<8} {r['peak']:>11} {r['peak'] * mib:>11.1f} {r['mean']:>11.1f} {r['preemptions']:>7} "
              f"{r['seconds']:>8.1f}")
    print(f"{'floor':<8} {floor:>11} {floor * mib:>11.1f}   (window blocks + 1 per request)")
    saved = 1 - rows["release"]["peak"] / rows["keep"]["peak"]
    same = rows["release"]["outputs"] == rows["keep"]["outputs"]
    print(f"peak KV saved: {saved:.1%}; same tokens: {same}; every block free at the end: "
          f"{rows['release']['free_at_end'] and rows['keep']['free_at_end']}")
    if not same:
        raise SystemExit("the two modes generated different tokens")


if __name__ == "__main__":
    main()
