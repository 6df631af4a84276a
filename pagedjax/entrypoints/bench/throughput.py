"""`pagedjax bench throughput`: offline throughput through the LLM API. N random token-id
prompts of --input-len, each generating exactly --output-len tokens (EOS ignored), submitted
at once after the engine's warm-up; requests/s, output tok/s and total tok/s."""
from __future__ import annotations

import argparse
import time

from pagedjax.entrypoints.bench.offline import add_model_arguments, make_llm, positive, random_prompts
from pagedjax.entrypoints.bench.report import json_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload")
    w.add_argument("--num-prompts", type=int, default=64, help="prompts generated for, all submitted at once")
    w.add_argument("--input-len", type=int, default=128, help="tokens of each prompt (random ids)")
    w.add_argument("--output-len", type=int, default=128, help="tokens generated per prompt (EOS ignored)")
    w.add_argument("--output-json", default=None, help="write the result as JSON here")
    w.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_model_arguments(p, lambda args: positive(args, "num_prompts", "input_len", "output_len"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from pagedjax.sampling_params import SamplingParams
    from pagedjax.entrypoints.bench.report import save_json

    llm = make_llm(args, args.input_len, args.output_len)
    if llm is None:
        return 2
    prompts = random_prompts(llm, args.num_prompts, args.input_len, np.random.default_rng(args.seed))
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    compiles = llm.stats()["num_compilations"]
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=not args.no_progress)
    elapsed = time.perf_counter() - t
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tokens = sum(len(o.prompt_token_ids) for o in outs)
    result = {"elapsed_s": elapsed, "num_requests": len(outs), "total_input_tokens": in_tokens,
              "total_output_tokens": out_tokens, "requests_per_second": len(outs) / elapsed,
              "output_tokens_per_second": out_tokens / elapsed,
              "total_tokens_per_second": (in_tokens + out_tokens) / elapsed,
              "compilations_during_run": llm.stats()["num_compilations"] - compiles,
              "dtype": str(llm.engine.model.dtype), "config": json_config(args)}
    print(f"Throughput: {result['requests_per_second']:.2f} requests/s, "
          f"{result['total_tokens_per_second']:.1f} total tokens/s, {result['output_tokens_per_second']:.1f} output "
          f"tokens/s ({len(outs)} requests, {in_tokens} prompt + {out_tokens} output tokens in {elapsed:.2f} s; "
          f"{result['compilations_during_run']} compilations during the run)")
    if args.output_json:
        print(f"wrote {save_json(result, args.output_json)}")
    return 0
