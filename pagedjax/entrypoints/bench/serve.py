"""`pagedjax bench serve`: a load generator against any OpenAI-compatible server (pagedjax,
vLLM, llama.cpp's server, ...). Sends streamed /v1/completions or /v1/chat/completions
requests at a Poisson (or gamma, --burstiness) arrival rate and/or under a concurrency cap,
and reports TTFT, TPOT, ITL and end-to-end latency, throughputs and goodput."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from pagedjax.entrypoints.bench.datasets import ENDPOINT_TYPES, file_requests, prefix_requests, random_requests
from pagedjax.entrypoints.bench.metrics import goodput_item


def add_arguments(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("server")
    s.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server's root URL (a trailing /v1 is "
                   "dropped: the endpoint paths carry it)")
    s.add_argument("--endpoint-type", choices=ENDPOINT_TYPES, default="completions",
                   help="completions: /v1/completions; chat: /v1/chat/completions")
    s.add_argument("--model", default=None, help="model name sent (default: the first one /v1/models lists)")
    s.add_argument("--api-key", default=None,
                   help="sent as `Authorization: Bearer KEY` (default: $OPENAI_API_KEY, else none)")
    s.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take")
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset", choices=("random", "prefix", "file"), default=None,
                   help="random: prompts of --input-len; prefix: --num-prefixes shared prefixes of --prefix-len "
                        "then --input-len of their own; file: chats read from --dataset-path (default: file when "
                        "--dataset-path is given, else random)")
    d.add_argument("--dataset-path", default=None, help="a .json list or .jsonl file of chats (docs/bench.md)")
    d.add_argument("--num-requests", "--num-prompts", type=int, default=100, help="requests sent")
    d.add_argument("--input-len", type=int, default=128, help="prompt tokens (prefix: after the shared prefix)")
    d.add_argument("--input-len-range", type=float, default=0.0, help="uniform spread: len * (1 +- RANGE)")
    d.add_argument("--output-len", type=int, default=128, help="max_tokens of each request (file: unless the "
                   "record says max_tokens)")
    d.add_argument("--output-len-range", type=float, default=0.0, help="uniform spread: len * (1 +- RANGE)")
    d.add_argument("--num-prefixes", type=int, default=4, help="prefix: distinct shared prefixes")
    d.add_argument("--prefix-len", type=int, default=256, help="prefix: tokens of each shared prefix")
    d.add_argument("--token-id-range", type=int, nargs=2, default=[1000, 20000], metavar=("LO", "HI"),
                   help="completions: prompt token ids are drawn from [LO, HI)")
    d.add_argument("--seed", type=int, default=0, help="seed of the prompts, lengths and arrival times")
    t = p.add_argument_group("load")
    t.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second (arrivals Poisson, or gamma with --burstiness); inf: all at once")
    t.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the inter-arrival times: 1 is "
                   "Poisson, below 1 burstier, above 1 more even")
    t.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no cap)")
    t.add_argument("--num-warmups", type=int, default=0, help="requests sent and waited for before the timed run")
    r = p.add_argument_group("requests")
    r.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="send ignore_eos, so every output has its max_tokens (vLLM and llama.cpp know it too)")
    r.add_argument("--temperature", type=float, default=0.0, help="sampling temperature sent")
    r.add_argument("--no-stream", dest="stream", action="store_false",
                   help="non-streamed requests: E2E only (no TTFT, TPOT or ITL)")
    r.add_argument("--extra-body", type=_json_object, default=None, metavar="JSON",
                   help="fields merged into every request body, e.g. '{\"top_p\": 0.9}'")
    o = p.add_argument_group("results")
    o.add_argument("--goodput", nargs="+", type=goodput_item, default=None, metavar="METRIC:MS",
                   help="SLOs (ttft, tpot, e2e in ms) for goodput, e.g. ttft:500 tpot:50")
    o.add_argument("--result-file", default=None, help="write the JSON result here (and the plot beside it)")
    o.add_argument("--save-result", action="store_true", help="write the JSON result to --result-dir")
    o.add_argument("--result-dir", default="results", help="where --save-result writes")
    o.add_argument("--no-plot", dest="plot", action="store_false", help="no PNG of the latency CDFs beside the JSON")
    o.add_argument("--save-detailed", action="store_true", help="per-request times and token counts in the JSON")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(_parser=p, _check=check_arguments, func=run)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def check_arguments(args: argparse.Namespace) -> None:
    """ValueErrors naming the flag (a usage error, exit code 2)."""
    if not args.base_url.startswith(("http://", "https://")):
        raise ValueError(f"--base-url must start with http:// or https://, got {args.base_url!r} (e.g. "
                         f"http://{args.base_url})")
    if args.dataset is None:
        args.dataset = "file" if args.dataset_path else "random"
    if (args.dataset == "file") != (args.dataset_path is not None):
        raise ValueError("--dataset file and --dataset-path go together")
    for flag, value in (("--num-requests", args.num_requests), ("--input-len", args.input_len),
                        ("--output-len", args.output_len), ("--num-prefixes", args.num_prefixes),
                        ("--prefix-len", args.prefix_len)):
        if value < 1:
            raise ValueError(f"{flag} must be a positive integer, got {value}")
    for flag, value in (("--input-len-range", args.input_len_range), ("--output-len-range", args.output_len_range)):
        if not 0 <= value < 1:
            raise ValueError(f"{flag} must be in [0, 1), got {value}")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be positive (inf: all at once), got {args.request_rate}")
    if not 0 < args.burstiness < float("inf"):
        raise ValueError(f"--burstiness must be a positive number, got {args.burstiness}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be a positive integer, got {args.max_concurrency}")
    if args.num_warmups < 0:
        raise ValueError(f"--num-warmups must be 0 or more, got {args.num_warmups}")
    if not args.request_timeout > 0:
        raise ValueError(f"--request-timeout must be positive, got {args.request_timeout}")
    lo, hi = args.token_id_range
    if not 0 <= lo < hi:
        raise ValueError(f"--token-id-range needs 0 <= LO < HI, got {lo} {hi}")
    if args.goodput and not args.stream and any(k != "e2e" for k, _ in args.goodput):
        raise ValueError("--goodput ttft / tpot need streamed requests (leave out --no-stream)")


def make_requests(args: argparse.Namespace) -> list:
    """The dataset's requests (ValueError: a bad dataset file)."""
    n, kind = args.num_requests, args.endpoint_type
    if args.dataset == "file":
        return file_requests(args.dataset_path, n, kind, args.output_len, args.seed)
    lens = (args.input_len, args.input_len_range, args.output_len, args.output_len_range, kind)
    if args.dataset == "prefix":
        return prefix_requests(n, args.num_prefixes, args.prefix_len, *lens, seed=args.seed,
                               id_range=tuple(args.token_id_range))
    return random_requests(n, *lens, seed=args.seed, id_range=tuple(args.token_id_range))


def arrival_times(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: gamma-distributed gaps of mean
    1 / rate (shape `burstiness`; 1: Poisson arrivals), all 0 for an infinite rate."""
    if rate == float("inf"):
        return [0.0] * n
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


async def benchmark(args: argparse.Namespace, requests: list) -> tuple[dict, list]:
    """Runs the load; (the result without the config, the per-request results)."""
    import httpx
    from tqdm import tqdm

    from pagedjax.entrypoints.bench.metrics import serve_metrics
    from pagedjax.entrypoints.bench.serve_client import ENDPOINTS, ServerUnreachable, check_server, request_body, send

    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency, max_keepalive_connections=None)
    path = ENDPOINTS[args.endpoint_type]
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(args.request_timeout, connect=15.0)) as client:
        model = await check_server(client, args.model)
        bodies = [request_body(r, args.endpoint_type, model, args.stream, args.ignore_eos, args.temperature,
                               args.extra_body) for r in requests]
        if args.num_warmups:
            t = time.perf_counter()
            warm = await asyncio.gather(*(send(client, path, bodies[i % len(bodies)], None, t)
                                          for i in range(args.num_warmups)))
            if failed := [w.error for w in warm if not w.ok]:
                raise ServerUnreachable(f"{len(failed)} of {len(warm)} warm-up requests failed: {failed[0]}")
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        bar = tqdm(total=len(requests), desc="requests", unit="req", disable=args.no_progress)
        in_flight, peak = 0, 0

        async def one(body: dict, prompt_len: int | None, t0: float):
            nonlocal in_flight, peak
            if sem is not None:
                await sem.acquire()
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                return await send(client, path, body, prompt_len, t0)
            finally:
                in_flight -= 1
                if sem is not None:
                    sem.release()
                bar.update(1)

        arrivals = arrival_times(len(requests), args.request_rate, args.burstiness, args.seed + 1)
        t0 = time.perf_counter()
        tasks = []
        for at, body, req in zip(arrivals, bodies, requests):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(body, req.prompt_len, t0)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        bar.close()
    slos = dict(args.goodput) if args.goodput else None
    out = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "base_url": args.base_url,
           "endpoint": path, "model": model, **serve_metrics(results, duration, slos),
           "max_concurrent_requests_seen": peak}
    return out, results


def _config(args: argparse.Namespace) -> dict:
    from pagedjax.entrypoints.bench.report import json_config

    config = json_config(args)
    config["goodput"] = dict(args.goodput) if args.goodput else None
    return config


def result_path(args: argparse.Namespace) -> Path | None:
    if args.result_file:
        return Path(args.result_file)
    if args.save_result:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        rate = "inf" if args.request_rate == float("inf") else f"{args.request_rate:g}"
        return Path(args.result_dir) / f"bench_serve_{args.endpoint_type}_{args.dataset}_rate{rate}_{stamp}.json"
    return None


def run(args: argparse.Namespace) -> int:
    from pagedjax.entrypoints.bench.report import plot_latency_cdfs, save_json, serve_table
    from pagedjax.entrypoints.bench.serve_client import ServerUnreachable, base_url

    args.base_url = base_url(args.base_url)
    try:
        requests = make_requests(args)
    except ValueError as e:
        args._parser.error(str(e))
    try:
        result, results = asyncio.run(benchmark(args, requests))
    except ServerUnreachable as e:
        print(f"{args._parser.prog}: error: {e}", file=sys.stderr)
        return 1
    result = {**result, "config": _config(args)}
    if args.save_detailed:
        result["requests"] = [{"ok": r.ok, "start_s": r.start, "ttft_s": r.ttft, "e2e_s": r.e2e, "itl_s": r.itl,
                               "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens, "error": r.error}
                              for r in results]
    print(serve_table(result))
    path = result_path(args)
    if path is not None:
        print(f"wrote {save_json(result, path)}")
        if args.plot:
            ok = [r for r in results if r.ok]
            samples = {"ttft_ms": [r.ttft * 1e3 for r in ok if r.ttft is not None],
                       "tpot_ms": [r.tpot * 1e3 for r in ok if r.tpot is not None],
                       "itl_ms": [g * 1e3 for r in ok for g in r.itl],
                       "e2e_ms": [r.e2e * 1e3 for r in ok if r.e2e is not None]}
            title = (f"{result['model']} at {result['base_url']}: {args.endpoint_type}, {args.dataset}, rate "
                     f"{args.request_rate:g}/s, max concurrency {args.max_concurrency or '-'}; "
                     f"{result['completed']} requests, {result['output_throughput']:.1f} output tok/s")
            slos = dict(args.goodput) if args.goodput else None
            print(f"wrote {plot_latency_cdfs(samples, path.with_suffix('.png'), title, slos)}")
    if not result["completed"]:
        print(f"{args._parser.prog}: error: every request failed", file=sys.stderr)
        return 1
    return 0
