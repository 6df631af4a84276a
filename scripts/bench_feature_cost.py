"""What a request feature costs through a running server: the same `pagedjax bench serve` load
without and with structured outputs (--structured json: every request asks for JSON matching
a schema) and/or penalties (--penalties: presence, frequency and repetition penalties and a
logit bias), one discarded warm-up run, then --repeats alternating rounds of each; prints the
median output tokens/s of each side [range] and the cost. Takes every `pagedjax bench serve`
flag for the load itself.

    python scripts/bench_feature_cost.py --base-url http://127.0.0.1:8123 --num-requests 32 \
        --max-concurrency 16 --input-len 128 --output-len 64 --structured json
"""
from __future__ import annotations

import argparse
import asyncio
import copy
from pathlib import Path

import numpy as np

from pagedjax.entrypoints.bench.report import save_json
from pagedjax.entrypoints.bench.serve import add_arguments, benchmark, check_arguments, make_requests
from pagedjax.entrypoints.bench.serve_client import base_url
from pagedjax.entrypoints.cli_args import HelpFormatter

JSON_SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string"}, "summary": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string"}}, "score": {"type": "number"}},
    "required": ["title", "summary", "tags", "score"], "additionalProperties": False}


def feature_fields(args: argparse.Namespace) -> dict:
    """The request fields of the features under test."""
    fields = {}
    if args.structured == "json":
        fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "doc", "schema": JSON_SCHEMA}}
    if args.penalties:
        fields.update(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1,
                      logit_bias={str(t): -5.0 for t in range(100, 110)})
    return fields


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    add_arguments(p)
    f = p.add_argument_group("features")
    f.add_argument("--structured", choices=["json"], default=None, help="constrain outputs to a JSON schema")
    f.add_argument("--penalties", action="store_true", help="presence/frequency/repetition penalties + logit_bias")
    f.add_argument("--repeats", type=int, default=3, help="alternating rounds of each side")
    f.add_argument("--output", default="results/bench_feature_cost.json", help="JSON path")
    args = p.parse_args(argv)
    try:
        check_arguments(args)
    except ValueError as e:
        p.error(str(e))
    if not (args.structured or args.penalties):
        p.error("name a feature: --structured json and/or --penalties")
    if args.repeats < 1:
        p.error(f"--repeats must be a positive integer, got {args.repeats}")
    args.base_url = base_url(args.base_url)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    requests = make_requests(args)
    plain, featured = copy.copy(args), copy.copy(args)
    featured.extra_body = {**(args.extra_body or {}), **feature_fields(args)}
    asyncio.run(benchmark(plain, requests))  # warm-up: the server may still be compiling in the background
    runs: dict[str, list[dict]] = {"without": [], "with": []}
    for rep in range(args.repeats):  # alternating, so a noisy neighbour hits both alike
        for mode in (("without", "with") if rep % 2 == 0 else ("with", "without")):
            run = asyncio.run(benchmark(plain if mode == "without" else featured, requests))[0]
            if run["failed"]:
                raise SystemExit(f"{run['failed']} of {run['num_requests']} requests failed {mode} the features: "
                                 f"{run['errors'][0]['error']}")
            runs[mode].append(run)
    label = " + ".join(x for x in (f"structured {args.structured}" if args.structured else "",
                                     "penalties" if args.penalties else "") if x)
    keys = ("output_throughput", "total_output_tokens", "duration_s", "completed")
    med = {m: {k: float(np.median([r[k] for r in rs])) for k in keys} for m, rs in runs.items()}
    rates = {m: [r["output_throughput"] for r in rs] for m, rs in runs.items()}
    print(f"\n{'':22s} {'without':>22s} {'with ' + label:>28s}")
    print(f"{'output tok/s':22s} {med['without']['output_throughput']:9.1f} "
          f"[{min(rates['without']):5.1f}-{max(rates['without']):5.1f}] "
          f"{med['with']['output_throughput']:15.1f} [{min(rates['with']):5.1f}-{max(rates['with']):5.1f}]")
    for key, name in (("total_output_tokens", "output tokens"), ("duration_s", "duration s"), ("completed", "completed")):
        print(f"{name:22s} {med['without'][key]:22.1f} {med['with'][key]:28.1f}")
    cost = 1 - med["with"]["output_throughput"] / med["without"]["output_throughput"]
    print(f"cost of {label}: {100 * cost:.1f}% of output tokens/s (medians of {args.repeats} alternating runs)")
    config = {k: v for k, v in vars(args).items() if not k.startswith("_") and k not in ("api_key", "func")}
    result = {"config": config, "feature_fields": feature_fields(args), "runs": runs, "throughput_cost": cost}
    print(f"wrote {save_json(result, Path(args.output))}")
    return result


if __name__ == "__main__":
    main()
