"""`pagedjax bench latency`: the time one batch takes end to end. A batch of --batch-size
random prompts of --input-len, each generating exactly --output-len tokens, run
--num-iters-warmup times untimed and then --num-iters times timed (fresh prompts every
iteration, so no prefix is ever cached); mean, spread and percentiles of the batch latency."""
from __future__ import annotations

import argparse
import time

from pagedjax.entrypoints.bench.offline import add_model_arguments, make_llm, positive, random_prompts
from pagedjax.entrypoints.bench.report import json_config

PERCENTILES = (10, 25, 50, 75, 90, 99)


def add_arguments(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload")
    w.add_argument("--batch-size", type=int, default=8, help="prompts in the batch")
    w.add_argument("--input-len", type=int, default=32, help="tokens of each prompt (random ids)")
    w.add_argument("--output-len", type=int, default=128, help="tokens generated per prompt (EOS ignored)")
    w.add_argument("--num-iters-warmup", type=int, default=3, help="untimed iterations first")
    w.add_argument("--num-iters", type=int, default=10, help="timed iterations")
    w.add_argument("--output-json", default=None, help="write the result as JSON here")
    w.add_argument("--no-progress", action="store_true", help="no progress bar")

    def check(args: argparse.Namespace) -> None:
        positive(args, "batch_size", "input_len", "output_len", "num_iters")
        if args.num_iters_warmup < 0:
            raise ValueError(f"--num-iters-warmup must be 0 or more, got {args.num_iters_warmup}")

    add_model_arguments(p, check)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import numpy as np
    from tqdm import tqdm

    from pagedjax.sampling_params import SamplingParams
    from pagedjax.entrypoints.bench.report import save_json

    llm = make_llm(args, args.input_len, args.output_len)
    if llm is None:
        return 2
    rng = np.random.default_rng(args.seed)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)

    def one_batch() -> tuple[float, int]:
        """(seconds, output tokens) of one batch."""
        prompts = random_prompts(llm, args.batch_size, args.input_len, rng)
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t, sum(len(o.outputs[0].token_ids) for o in outs)

    for _ in tqdm(range(args.num_iters_warmup), desc="warm-up iterations", disable=args.no_progress):
        one_batch()
    compiles = llm.stats()["num_compilations"]
    runs = [one_batch() for _ in tqdm(range(args.num_iters), desc="timed iterations", disable=args.no_progress)]
    latencies = np.array([dt for dt, _ in runs])
    tokens = sum(n for _, n in runs)
    pct = dict(zip((f"p{p}" for p in PERCENTILES), np.percentile(latencies, PERCENTILES).tolist()))
    result = {"mean_s": float(latencies.mean()), "std_s": float(latencies.std()), "min_s": float(latencies.min()),
              "max_s": float(latencies.max()), "percentiles_s": pct, "latencies_s": latencies.tolist(),
              "batch_size": args.batch_size, "input_len": args.input_len, "output_len": args.output_len,
              "output_tokens_per_iter": tokens / args.num_iters,
              "output_tokens_per_second": tokens / float(latencies.sum()),
              "compilations_during_timed_iters": llm.stats()["num_compilations"] - compiles,
              "dtype": str(llm.engine.model.dtype), "config": json_config(args)}
    print(f"Latency of a batch of {args.batch_size} ({args.input_len} prompt + {args.output_len} output tokens "
          f"each), {args.num_iters} iterations:")
    print(f"  mean {result['mean_s']:.4f} s, std {result['std_s']:.4f} s, min {result['min_s']:.4f} s, "
          f"max {result['max_s']:.4f} s")
    for name in ("p10", "p50", "p90", "p99"):
        print(f"  {name:>4}: {pct[name]:.4f} s")
    if args.output_json:
        print(f"wrote {save_json(result, args.output_json)}")
    return 0
