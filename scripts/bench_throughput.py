"""Offline throughput: pagedjax against transformers' batched generate, same checkpoint, one run.
(A probe that compares engines; pagedjax's own offline throughput is `pagedjax bench throughput`.)

Default workload: a SmolLM2-135M-shaped Llama with random weights, 16 prompts of 128 tokens,
128 new tokens each, greedy, float32 on CPU. Prints both figures and their ratio and writes
JSON (results/bench_throughput.json).

    python scripts/bench_throughput.py [--model DIR] [--num-prompts 16] [--prompt-len 128] [--output-len 128]

`--dtype bfloat16` runs three engines side by side: pagedjax in bf16 (bf16 matrices and KV
cache, float32 activations) and pagedjax in float32, timed alternately `--repeats` times
(median and range), then transformers in bf16 (torch on the same CPU); prints the tok/s of
each, the ratios, how often the first 8 greedy tokens of the bf16 run agree with the float32
run, and each dtype's decode step next to its matmuls alone
(results/bench_throughput_bfloat16.json).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))  # step_floor

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=2048,
                    rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1,
                    eos_token_id=2)


def make_random_checkpoint(path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).save_pretrained(str(path))


def bench_transformers(model_dir: str, prompts: list[list[int]], output_len: int, threads: int | None,
                       dtype: str = "float32") -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    if threads:
        torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
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


def start_pagedjax(model_dir: str, prompts: list[list[int]], output_len: int, args, dtype: str = "float32"):
    """(LLM, SamplingParams) after one untimed run of the workload (compiles its buckets)."""
    from pagedjax import LLM, SamplingParams

    llm = LLM(model_dir, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, dtype=dtype,
              block_size=args.block_size, warmup=False, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    return llm, params


def time_pagedjax(llm, params, prompts: list[list[int]]) -> dict:
    """One timed run of the workload."""
    compiles = llm.stats()["num_compilations"]
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": dt, "output_tokens": n, "tokens_per_s": n / dt,
            "compilations_during_timed_run": llm.stats()["num_compilations"] - compiles,
            "token_ids": [o.outputs[0].token_ids for o in outs]}


def bench_pagedjax(model_dir: str, prompts: list[list[int]], output_len: int, args, dtype: str = "float32") -> dict:
    llm, params = start_pagedjax(model_dir, prompts, output_len, args, dtype)
    return time_pagedjax(llm, params, prompts)


def profile_pagedjax(llm, prompts: list[list[int]]) -> dict:
    """The median decode step at len(prompts) rows and its matmuls alone (step_floor.py)."""
    from step_floor import decode_step_ms, matmul_floor_ms

    return {"decode_step_ms": decode_step_ms(llm.engine, prompts),
            "matmul_floor_ms": matmul_floor_ms(llm.engine.model, len(prompts))}


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
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="bfloat16: pagedjax bf16 vs transformers bf16 vs pagedjax float32")
    p.add_argument("--repeats", type=int, default=3, help="--dtype bfloat16: timed runs of each pagedjax dtype")
    p.add_argument("--out", default=None, help="JSON path (default: results/bench_throughput[_bfloat16].json)")
    args = p.parse_args()
    if args.dtype == "bfloat16":
        return main_bfloat16(args)
    args.out = args.out or "results/bench_throughput.json"

    with tempfile.TemporaryDirectory() as tmp:
        model_dir, prompts = _workload(args, tmp)
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


def _workload(args, tmp: str) -> tuple[str, list[list[int]]]:
    """(model dir: --model, else a random checkpoint written to tmp; the seeded token prompts)."""
    model_dir = args.model
    if model_dir is None:
        model_dir = tmp
        make_random_checkpoint(Path(tmp))
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, 49152 if args.model is None else 1000, size=(args.num_prompts, args.prompt_len)).tolist()
    return model_dir, prompts


def first_tokens_agreement(a: list[list[int]], b: list[list[int]], n: int = 8) -> dict:
    """Of each pair of outputs: are the first n tokens identical; and the fraction of those
    n positions that agree."""
    same = sum(x[:n] == y[:n] for x, y in zip(a, b))
    pos = sum(p == q for x, y in zip(a, b) for p, q in zip(x[:n], y[:n]))
    return {"identical": f"{same}/{len(a)}", "positions": pos / (n * len(a))}


def main_bfloat16(args) -> None:
    """pagedjax bf16 and pagedjax float32 timed alternately (--repeats runs each: median and
    range), and transformers bf16, on the same workload in one process."""
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, prompts = _workload(args, tmp)
        engines = {dt: start_pagedjax(model_dir, prompts, args.output_len, args, dtype=dt)
                   for dt in ("bfloat16", "float32")}
        runs = {dt: [] for dt in engines}
        for rep in range(args.repeats):  # alternating, so a noisy neighbour hits both alike
            for dt in (("bfloat16", "float32") if rep % 2 == 0 else ("float32", "bfloat16")):
                runs[dt].append(time_pagedjax(*engines[dt], prompts))
        ours, f32 = (dict(runs[dt][-1], **profile_pagedjax(engines[dt][0], prompts)) for dt in ("bfloat16", "float32"))
        for dt, run in (("bfloat16", ours), ("float32", f32)):
            rates = [r["tokens_per_s"] for r in runs[dt]]
            run.update(tokens_per_s=float(np.median(rates)), runs_tokens_per_s=rates)
        del engines
        theirs = bench_transformers(model_dir, prompts, args.output_len, args.torch_threads, dtype="bfloat16")
    ids = {name: run.pop("token_ids") for name, run in (("bf16", ours), ("f32", f32), ("hf", theirs))}
    result = {
        "workload": {k: getattr(args, k) for k in ("model", "num_prompts", "prompt_len", "output_len",
                                                    "max_num_seqs", "block_size", "repeats")},
        "pagedjax_bfloat16": ours, "transformers_bfloat16": theirs, "pagedjax_float32": f32,
        "bf16_over_transformers_bf16": ours["tokens_per_s"] / theirs["tokens_per_s"],
        "bf16_over_pagedjax_f32": ours["tokens_per_s"] / f32["tokens_per_s"],
        "bf16_over_pagedjax_f32_per_repeat": [a["tokens_per_s"] / b["tokens_per_s"]
                                              for a, b in zip(runs["bfloat16"], runs["float32"])],
        "first8_bf16_vs_f32": first_tokens_agreement(ids["bf16"], ids["f32"]),
        "first8_bf16_vs_transformers_bf16": first_tokens_agreement(ids["bf16"], ids["hf"]),
    }
    for label, run in (("pagedjax bf16", ours), ("transformers bf16", theirs), ("pagedjax f32", f32)):
        spread = f"  [{min(run['runs_tokens_per_s']):.1f}-{max(run['runs_tokens_per_s']):.1f}, " \
                 f"{len(run['runs_tokens_per_s'])} runs]" if "runs_tokens_per_s" in run else ""
        print(f"{label:18s} {run['tokens_per_s']:8.1f} tok/s{spread}  ({run['output_tokens']} tokens per run)")
    pairs = result["bf16_over_pagedjax_f32_per_repeat"]
    print(f"bf16 / transformers bf16  {result['bf16_over_transformers_bf16']:5.2f}x   (target >= 1.5x)")
    print(f"bf16 / pagedjax f32       {result['bf16_over_pagedjax_f32']:5.2f}x   (target >= 1.8x; per repeat "
          f"{min(pairs):.2f}-{max(pairs):.2f})")
    agree = result["first8_bf16_vs_f32"]
    print(f"first 8 greedy tokens, bf16 vs f32: {agree['identical']} prompts identical, "
          f"{100 * agree['positions']:.0f}% of positions agree")
    for label, run in (("bf16", ours), ("f32 ", f32)):
        print(f"decode step {label}: {run['decode_step_ms']:5.1f} ms at {args.num_prompts} rows; "
              f"its matmuls alone {run['matmul_floor_ms']:5.1f} ms (scripts/step_floor.py)")
    out = Path(args.out or "results/bench_throughput_bfloat16.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
