"""Load generator for a running OpenAI-compatible server (`pagedjax serve` or any other).

Sends streaming /v1/completions requests whose prompts are random token ids (so prompt
lengths are exact without a tokenizer) and, by default, `ignore_eos` so output lengths are
exact too. Arrivals are Poisson at --request-rate (default: all at once), optionally capped
at --concurrency requests in flight. Reports throughput and mean/p50/p90/p99 of time to first
token (TTFT), time per output token after the first (TPOT) and end-to-end latency as JSON.

    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --num-requests 200 \
        --concurrency 32 --input-len 256 --output-len 128 --shared-prefix-len 64

--structured json asks every request for JSON matching a schema (structured outputs);
--penalties adds presence, frequency and repetition penalties and a logit bias. With either,
the same load runs twice in one invocation, without and with the feature, and the two are
printed side by side (the cost of the feature in output tokens/s).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
from tqdm import tqdm


@dataclass
class Result:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float = 0.0
    error: str | None = None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second")
    p.add_argument("--concurrency", type=int, default=None, help="max requests in flight")
    p.add_argument("--input-len", type=int, default=128, help="mean prompt tokens (shared prefix included)")
    p.add_argument("--input-len-range", type=float, default=0.0, help="uniform spread: len * (1 +- range)")
    p.add_argument("--output-len", type=int, default=128, help="mean max_tokens")
    p.add_argument("--output-len-range", type=float, default=0.0)
    p.add_argument("--shared-prefix-len", type=int, default=0, help="tokens every prompt starts with")
    p.add_argument("--token-id-range", type=int, nargs=2, default=[1000, 20000], metavar=("LO", "HI"),
                   help="prompt token ids are drawn from [LO, HI)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--structured", choices=["json"], default=None, help="constrain outputs to a JSON schema")
    p.add_argument("--penalties", action="store_true", help="presence/frequency/repetition penalties + logit_bias")
    p.add_argument("--repeats", type=int, default=3, help="with --structured/--penalties: alternating rounds")
    p.add_argument("--output", default="results/bench_serving.json")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def _lengths(rng: random.Random, mean: int, spread: float, n: int, low: int) -> list[int]:
    lo, hi = max(low, int(mean * (1 - spread))), max(low, int(mean * (1 + spread)))
    return [rng.randint(lo, hi) for _ in range(n)]


def make_requests(args: argparse.Namespace) -> list[tuple[list[int], int]]:
    """(prompt token ids, max_tokens) per request, reproducible from --seed."""
    rng = random.Random(args.seed)
    lo, hi = args.token_id_range
    prefix = [rng.randrange(lo, hi) for _ in range(args.shared_prefix_len)]
    in_lens = _lengths(rng, args.input_len, args.input_len_range, args.num_requests, len(prefix) + 1)
    out_lens = _lengths(rng, args.output_len, args.output_len_range, args.num_requests, 1)
    return [(prefix + [rng.randrange(lo, hi) for _ in range(n - len(prefix))], m) for n, m in zip(in_lens, out_lens)]


async def one_request(client: httpx.AsyncClient, args: argparse.Namespace, prompt: list[int],
                      max_tokens: int) -> Result:
    body = {"model": args.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": args.temperature,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": not args.no_ignore_eos,
            **feature_fields(args)}
    start = time.perf_counter()
    res = Result(ok=False, prompt_tokens=len(prompt))
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"].get("message")
                    return res
                if res.ttft is None and any(c.get("text") for c in chunk.get("choices", [])):
                    res.ttft = time.perf_counter() - start
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.output_tokens = chunk["usage"]["completion_tokens"]
        res.e2e = time.perf_counter() - start
        res.ok = True
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = repr(exc)
    return res


JSON_SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string"}, "summary": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string"}}, "score": {"type": "number"}},
    "required": ["title", "summary", "tags", "score"], "additionalProperties": False}


def feature_fields(args: argparse.Namespace) -> dict:
    """Request fields of the features under test (none for the baseline run)."""
    fields = {}
    if args.structured == "json":
        fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "doc", "schema": JSON_SCHEMA}}
    if args.penalties:
        fields.update(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1,
                      logit_bias={str(t): -5.0 for t in range(100, 110)})
    return fields


def _summary(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    a = np.asarray(values) * 1000.0
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99))}


async def run(args: argparse.Namespace) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency or args.num_requests, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=httpx.Timeout(600.0),
                                 limits=limits) as client:
        if args.model is None:
            args.model = (await client.get("/v1/models")).json()["data"][0]["id"]
        requests = make_requests(args)
        sem = asyncio.Semaphore(args.concurrency or len(requests))
        bar = tqdm(total=len(requests), disable=args.no_progress, desc="requests")
        rng = random.Random(args.seed + 1)

        async def limited(prompt, max_tokens):
            async with sem:
                res = await one_request(client, args, prompt, max_tokens)
            bar.update(1)
            return res

        start = time.perf_counter()
        tasks = []
        for prompt, max_tokens in requests:
            tasks.append(asyncio.create_task(limited(prompt, max_tokens)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    return {
        "config": {k: v for k, v in vars(args).items() if k not in ("api_key", "no_progress")},
        "num_requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "errors": [r.error for r in results if not r.ok][:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput_tok_s": out_tokens / duration,
        "total_token_throughput_tok_s": (in_tokens + out_tokens) / duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "ttft_ms": _summary([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": _summary([(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok
                             if r.ttft is not None and r.output_tokens > 1]),
        "e2e_ms": _summary([r.e2e for r in ok]),
    }


def compare(args: argparse.Namespace) -> dict:
    """The same load without and with the features, alternating for --repeats rounds after
    one discarded warm-up run; medians (and ranges) side by side."""
    import copy

    plain = copy.copy(args)
    plain.structured, plain.penalties = None, False
    asyncio.run(run(plain))  # warm-up: the server may still be compiling in the background
    runs: dict[str, list[dict]] = {"without": [], "with": []}
    for rep in range(args.repeats):
        for mode in (("without", "with") if rep % 2 == 0 else ("with", "without")):
            runs[mode].append(asyncio.run(run(plain if mode == "without" else args)))
    label = " + ".join(x for x in (f"structured {args.structured}" if args.structured else "",
                                     "penalties" if args.penalties else "") if x)
    med = {m: {k: float(np.median([r[k] for r in rs])) for k in ("output_throughput_tok_s", "total_output_tokens",
                                                                   "duration_s", "completed")}
           for m, rs in runs.items()}
    rng = {m: [r["output_throughput_tok_s"] for r in rs] for m, rs in runs.items()}
    print(f"\n{'':22s} {'without':>22s} {'with ' + label:>28s}")
    print(f"{'output tok/s':22s} {med['without']['output_throughput_tok_s']:9.1f} "
          f"[{min(rng['without']):5.1f}-{max(rng['without']):5.1f}] "
          f"{med['with']['output_throughput_tok_s']:15.1f} [{min(rng['with']):5.1f}-{max(rng['with']):5.1f}]")
    for key, name in (("total_output_tokens", "output tokens"), ("duration_s", "duration s"), ("completed", "completed")):
        print(f"{name:22s} {med['without'][key]:22.1f} {med['with'][key]:28.1f}")
    cost = 1 - med["with"]["output_throughput_tok_s"] / med["without"]["output_throughput_tok_s"]
    print(f"cost of {label}: {100 * cost:.1f}% of output tokens/s (medians of {args.repeats} alternating runs)")
    return {"config": runs["with"][0]["config"], "runs": runs, "throughput_cost": cost}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.structured or args.penalties:
        result = compare(args)
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2, default=str))
        return result
    result = asyncio.run(run(args))
    if args.request_rate == float("inf"):
        result["config"]["request_rate"] = "inf"  # JSON has no infinity
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "config"}, indent=2))
    return result


if __name__ == "__main__":
    main()
