"""`pagedjax bench`: serve (load against any OpenAI-compatible server), throughput and latency
(offline, through the LLM API), startup (time to the first token from process start) and
compare (dense vs paged KV cache). One module per subcommand; datasets, metrics and report
are shared. Parsers import only what they need to be built: each subcommand's `run` imports
the rest."""
from __future__ import annotations

import argparse

from pagedjax.entrypoints.cli_args import HelpFormatter

SUBCOMMANDS = {
    "serve": "load-test an OpenAI-compatible server: TTFT, TPOT, ITL, E2E, throughput, goodput",
    "throughput": "offline throughput through the LLM API (random prompts, exact lengths)",
    "latency": "latency of one batch through the LLM API, repeated: mean, spread, percentiles",
    "startup": "seconds from process start to the first token (generate, serve, LLM), cold and warm compile cache",
}  # subcommand (and its module's name) -> help


def add_bench_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`pagedjax bench` and its subcommands, under the top-level subparsers `sub`."""
    import importlib

    bench = sub.add_parser("bench", help="benchmarks: serve, throughput, latency, startup, compare",
                           description="Benchmarks (docs/bench.md).", formatter_class=HelpFormatter)
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name, help_text in SUBCOMMANDS.items():
        mod = importlib.import_module(f"pagedjax.entrypoints.bench.{name}")
        p = bench_sub.add_parser(name, help=help_text, description=(mod.__doc__ or help_text).split("\n\n")[0],
                                 formatter_class=HelpFormatter)
        mod.add_arguments(p)
    from pagedjax.compare import cli as compare_cli

    compare = bench_sub.add_parser("compare", help="dense vs paged KV cache on one workload and KV budget",
                                   description="Dense vs paged KV cache: same model, workload and KV memory budget; "
                                               "writes JSON, a markdown table and PNG plots.",
                                   formatter_class=HelpFormatter)
    compare_cli.add_arguments(compare)
    compare.set_defaults(func=compare_cli.run)
    return bench
