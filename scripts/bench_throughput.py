"""Offline throughput: pagedjax against transformers' batched generate, same checkpoint, one run.

Default workload: a SmolLM2-135M-shaped Llama with random weights, 16 prompts of 128 tokens,
128 new tokens each, greedy, float32 on CPU. Prints both figures and their ratio and writes
JSON (results/bench_throughput.json).

    python scripts/bench_throughput.py [--model DIR] [--num-prompts 16] [--prompt-len 128] [--output-len 128]
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=2048,
                    rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1,
                    eos_token_id=2)


def make_random_checkpoint(path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).save_pretrained(str(path))


def bench_transformers(model_dir: str, prompts: list[list[int]], output_len: int, threads: int | None) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    if threads:
        torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor(prompts)
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids[:2, :8], max_new_tokens=4, **kw)  # warm-up
        t = time.perf_counter()
        out = model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, **kw)
        dt = time.perf_counter() - t
    gen = out[:, ids.shape[1]:]
    return {"seconds": dt, "output_tokens": int(gen.numel()), "tokens_per_s": gen.numel() / dt,
            "token_ids": gen.tolist()}


def bench_pagedjax(model_dir: str, prompts: list[list[int]], output_len: int, args) -> dict:
    from pagedjax import LLM, SamplingParams

    llm = LLM(model_dir, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
              block_size=args.block_size, warmup=False, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # compiles the buckets this workload uses
    compiles = llm.stats()["num_compilations"]
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": dt, "output_tokens": n, "tokens_per_s": n / dt,
            "compilations_during_timed_run": llm.stats()["num_compilations"] - compiles,
            "token_ids": [o.outputs[0].token_ids for o in outs]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF model dir (default: random SmolLM2-135M-shaped Llama)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--torch-threads", type=int, default=None)
    p.add_argument("--out", default="results/bench_throughput.json")
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            model_dir = tmp
            make_random_checkpoint(Path(tmp))
        rng = np.random.default_rng(0)
        prompts = rng.integers(3, 49152 if args.model is None else 1000, size=(args.num_prompts, args.prompt_len)).tolist()
        ours = bench_pagedjax(model_dir, prompts, args.output_len, args)
        theirs = bench_transformers(model_dir, prompts, args.output_len, args.torch_threads)
    same = sum(a == b for a, b in zip(ours.pop("token_ids"), theirs.pop("token_ids")))
    result = {
        "workload": {k: getattr(args, k) for k in ("model", "num_prompts", "prompt_len", "output_len",
                                                    "max_num_seqs", "block_size")},
        "pagedjax": ours, "transformers": theirs,
        "speedup": ours["tokens_per_s"] / theirs["tokens_per_s"],
        "identical_greedy_outputs": f"{same}/{args.num_prompts}",
    }
    print(f"pagedjax      {ours['tokens_per_s']:9.1f} tok/s  ({ours['output_tokens']} tokens in {ours['seconds']:.2f} s)")
    print(f"transformers  {theirs['tokens_per_s']:9.1f} tok/s  ({theirs['output_tokens']} tokens in {theirs['seconds']:.2f} s)")
    print(f"ratio         {result['speedup']:9.2f}x   identical greedy outputs: {result['identical_greedy_outputs']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
