"""Speculative decoding's draft allocation under a fixed step-cost table: noise-free figures.

On a shared machine a run's wall time moves by 10-50% from minute to minute, too much to
compare two ways of choosing drafts. This script runs bench_speculative.py's cases (copy
prompts at batch 1, a closed batch of 8, 12 prompts 8 at a time, random-token prompts) with
and without prompt lookup, with every engine's cost model pinned to one table of step times
by size (`--costs`, ms for every step size the engine has; measured once in a quiet minute, e.g. bench_speculative.py's "step
wall time by size"), and prints the steps each run took and its modeled time: the sum of the
table's time for every step it ran. Greedy outputs make the step sequence deterministic, so two
policies (or two tables) compare exactly.

    python scripts/spec_policy_model.py [--k 4] \
        [--costs 8:33,16:47,32:79,48:106,64:142,96:190,128:240,256:420,512:730,1024:1450]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_speculative import benchmark_cases, run  # noqa: E402

from pagedjax import LLM  # noqa: E402

DEFAULT_COSTS = "8:33,16:47,32:79,48:106,64:142,96:190,128:240,256:420,512:730,1024:1450"


def parse_costs(text: str) -> dict[int, float]:
    """'8:33,16:47' -> {8: 33.0, 16: 47.0} (ms by step size)."""
    costs = {}
    for item in text.split(","):
        size, _, ms = item.partition(":")
        costs[int(size)] = float(ms)
    return costs


def run_steps(llm: LLM, prompts: list[list[int]], batch: int, max_tokens: int) -> list[int]:
    """The size T of every step `bench_speculative.run` takes for `prompts` in batches of `batch`."""
    sizes = []
    dispatch = llm.engine.runner.dispatch

    def record(*args, **kwargs):
        pending = dispatch(*args, **kwargs)
        sizes.append(pending.t)
        return pending

    llm.engine.runner.dispatch = record
    try:
        run(llm, prompts, batch, max_tokens)
    finally:
        llm.engine.runner.dispatch = dispatch
    return sizes


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--costs", default=DEFAULT_COSTS, help="step time (ms) by size: 8:33,16:47,...")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args(argv)
    table = parse_costs(args.costs)
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    kw = dict(max_num_seqs=8, max_model_len=1024, max_num_batched_tokens=1024)
    engines = {"off": LLM(args.model, **kw), "on": LLM(args.model, speculative_config=spec, **kw)}
    missing = [t for t in engines["on"].engine.buckets.token_buckets() if t not in table]
    if missing:
        raise SystemExit(f"--costs has no time for step sizes {missing}")
    for llm in engines.values():
        llm.wait_for_warmup()
        for sched in llm.engine.schedulers:  # the pinned table, in seconds, for every allocation
            sched.step_cost = lambda t: table[t] / 1e3
    cases = benchmark_cases(engines["off"].tokenizer)
    print(f"step costs (ms): {table}")
    print(f"{'case':28s} {'steps off/on':>13s} {'modeled ms off/on':>18s} {'modeled speed-up':>17s}")
    for name, case_prompts, batch in cases:
        for llm in engines.values():  # the prompts' prefixes cached, as in bench_speculative's repeats
            run_steps(llm, case_prompts, batch, args.max_tokens)
        off, on = (run_steps(llm, case_prompts, batch, args.max_tokens) for llm in engines.values())
        ms_off, ms_on = sum(table[t] for t in off), sum(table[t] for t in on)
        print(f"{name:28s} {len(off):>6d}/{len(on):<6d} {ms_off:>8.0f}/{ms_on:<9.0f} {ms_off / ms_on:16.2f}x")


if __name__ == "__main__":
    main()
