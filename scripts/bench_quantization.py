"""Quantized weights and KV cache against the unquantized engine, side by side in one run.

For each configuration (weights: model dtype / int8 / fp8; KV cache: model dtype / int8 / fp8):
- quality: greedy agreement with the unquantized engine over the first TOKENS tokens of 16
  prompts (the share of positions whose token equals the baseline's), and the mean absolute
  difference of the log-probabilities of a 512-token text scored with prompt_logprobs (echo);
- capacity: KV tokens the pool holds at the same kv_cache_memory_gb;
- speed: decode throughput at batch 16 (16 requests x OUTPUT tokens after a short prompt),
  median of --repeats runs, with the spread, the configurations' runs interleaved (every engine
  kept alive); and the weight bytes.

    python scripts/bench_quantization.py                      # the default model
    python scripts/bench_quantization.py --random             # a random SmolLM2-shaped checkpoint
    python scripts/bench_quantization.py --configs base,w8,kv8,w8kv8 --no-speed
"""
from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

CONFIGS = {  # name -> (quantization, kv_cache_dtype)
    "base": (None, "auto"), "f32": (None, "float32"), "w8": ("int8", "auto"), "fp8w": ("fp8", "auto"), "kv8": (None, "int8"),
    "fp8kv": (None, "fp8"), "w8kv8": ("int8", "int8"), "fp8w_fp8kv": ("fp8", "fp8"),
}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "The best way to learn",
           "In 1969, the first", "Water boils at", "A good breakfast includes", "The theory of relativity",
           "import numpy as np\n", "My favourite season is", "To make bread you need", "The largest planet",
           "Dear hiring manager,", "SELECT name FROM", "The three primary colours are", "Photosynthesis is"]


def score_text(tokenizer, n: int = 512) -> list[int]:
    text = (Path(__file__).parents[1] / "README.md").read_text()
    ids = tokenizer.encode(text) if tokenizer is not None else list(range(1, n + 1))
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def run_config(model, quantization, kv_cache_dtype, args) -> dict:
    from pagedjax import LLM, SamplingParams

    dtype = "float32" if kv_cache_dtype == "float32" else "auto"  # "f32": the float32 model and KV cache
    llm = LLM(model, dtype=dtype, quantization=quantization, kv_cache_dtype=kv_cache_dtype, max_num_seqs=16,
              kv_cache_memory_gb=args.kv_gb, max_model_len=1024)
    # every step shape compiled first: steps then run on their own shapes (not the nearest one compiled
    # so far), so the numbers repeat, and no compile thread runs beside the timed runs
    llm.wait_for_warmup()
    greedy = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    ids = score_text(llm.tokenizer)
    scored = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0),
                          use_tqdm=False)[0]
    logprobs = np.array([entry[t] for entry, t in zip(scored.prompt_logprobs[1:], ids[1:])])
    stats = llm.stats()
    out = {"tokens": tokens, "logprobs": logprobs, "kv_tokens": stats["kv_tokens_capacity"],
           "weight_mb": max(stats["weight_bytes_per_device"].values()) / 2 ** 20, "tok_s": []}
    if args.speed:
        out["llm"] = llm  # kept for the interleaved speed runs
    else:
        del llm
        gc.collect()
    return out


def decode_rate(llm, args) -> float:
    """Output tok/s of 16 requests x args.output greedy tokens (batch 16 while they all decode)."""
    from pagedjax import SamplingParams

    decode = SamplingParams(max_tokens=args.output, temperature=0, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate([f"{p} and then" for p in PROMPTS], decode, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF model dir (default: the embedded default model)")
    p.add_argument("--random", action="store_true", help="a random SmolLM2-135M-shaped checkpoint instead")
    p.add_argument("--configs", default="base,w8,fp8w,kv8,fp8kv,w8kv8")
    p.add_argument("--tokens", type=int, default=16, help="greedy tokens compared per prompt")
    p.add_argument("--output", type=int, default=64, help="decode tokens per request in the speed run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-gb", type=float, default=0.1, help="kv_cache_memory_gb of every configuration")
    p.add_argument("--no-speed", dest="speed", action="store_false")
    p.add_argument("--workload", action="store_true", help="also the mixed workload of scripts/bench_workload.py "
                   "(its defaults: 96 requests, prompts 32-384, outputs 16-192, 32 seats) for each configuration")
    args = p.parse_args(argv)
    model = args.model
    if args.random:
        from bench_throughput import make_random_checkpoint

        model = str(Path(tempfile.mkdtemp()) / "random-smollm2")
        make_random_checkpoint(Path(model))
        for f in default_model_path().glob("*token*"):  # the same vocabulary: the default model's tokenizer
            shutil.copy(f, model)
    names = args.configs.split(",")
    if names[0] != "base":
        names = ["base", *[n for n in names if n != "base"]]
    results = {}
    for name in names:
        quantization, kv = CONFIGS[name]
        print(f"[{name}] quantization={quantization} kv_cache_dtype={kv}", flush=True)
        results[name] = run_config(model, quantization, kv, args)
    if args.speed:  # the configurations interleaved, repeat by repeat: drift of a shared machine falls on all alike
        for r in results.values():
            decode_rate(r["llm"], args)  # warm
        for _ in range(args.repeats):
            for r in results.values():
                r["tok_s"].append(decode_rate(r["llm"], args))
    base = results["base"]
    print(f"\nmodel: {model or 'default (SmolLM2-135M-Instruct)'}; {len(PROMPTS)} prompts x {args.tokens} greedy "
          f"tokens; {len(base['logprobs']) + 1}-token text scored; kv_cache_memory_gb={args.kv_gb}")
    head = f"{'config':<11} {'weights MB':>10} {'greedy agree':>12} {'|dlogp| nats':>12} {'KV tokens':>10} {'x base':>7}"
    if args.speed:
        head += f" {'decode tok/s (median, min-max)':>32} {'x base':>7}"
    print(head)
    for name, r in results.items():
        agree = np.mean([np.mean(np.array(a) == np.array(b)) for a, b in zip(r["tokens"], base["tokens"])])
        dlogp = float(np.mean(np.abs(r["logprobs"] - base["logprobs"])))
        line = (f"{name:<11} {r['weight_mb']:>10.1f} {agree:>12.1%} {dlogp:>12.4f} {r['kv_tokens']:>10} "
                f"{r['kv_tokens'] / base['kv_tokens']:>7.2f}")
        if args.speed:
            med, b = statistics.median(r["tok_s"]), statistics.median(base["tok_s"])
            line += f" {med:>12.1f} ({min(r['tok_s']):.1f}-{max(r['tok_s']):.1f}){'':>6} {med / b:>7.2f}"
        print(line, flush=True)
    if args.workload:
        run_workload(model, names, args)


def run_workload(model, names, args) -> None:
    """The mixed workload, each configuration in turn (bf16 first), output tok/s side by side."""
    import bench_workload
    from types import SimpleNamespace

    w = SimpleNamespace(n=96, prompt_min=32, prompt_max=384, output_min=16, output_max=192, seed=0,
                        max_num_seqs=32, max_model_len=1024, no_async_scheduling=False, skip_floor=True)
    model_dir = model or str(default_model_path())
    prompts, output_lens = bench_workload.make_workload(w, bench_workload._model_limits(model_dir)[0])
    rows = {}
    for name in names:
        quantization, kv = CONFIGS[name]
        dtype = "float32" if kv == "float32" else "auto"
        print(f"[workload {name}] ...", flush=True)
        r = bench_workload.bench_pagedjax(model_dir, prompts, output_lens, w, dtype=dtype, quantization=quantization,
                                          kv_cache_dtype=kv)
        rows[name] = r
        gc.collect()
    base = rows[names[0]]["tokens_per_s"]
    print(f"\nmixed workload: {w.n} requests, prompts {w.prompt_min}-{w.prompt_max}, outputs {w.output_min}-"
          f"{w.output_max}, {w.max_num_seqs} seats")
    print(f"{'config':<11} {'output tok/s':>12} {'x base':>7} {'TTFT p50 s':>10} {'latency mean s':>14}")
    for name, r in rows.items():
        print(f"{name:<11} {r['tokens_per_s']:>12.1f} {r['tokens_per_s'] / base:>7.2f} {r['ttft_p50_s']:>10.2f} "
              f"{r['latency_mean_s']:>14.2f}", flush=True)


def default_model_path() -> Path:
    from pagedjax.models.default_model import default_model_dir

    return default_model_dir(progress=False)


if __name__ == "__main__":
    main()
