"""Command line: `pagedjax generate ...`, `pagedjax serve ...` and `pagedjax bench compare ...`."""
from __future__ import annotations

import argparse
import sys

from pagedjax.entrypoints.cli_args import (HelpFormatter, add_engine_arguments, check_arguments,
                                          check_engine_arguments, engine_flags, engine_kwargs, flag_names,
                                          init_processes, model_help)

# generate's sampling flags: SamplingParams field -> (flag, add_argument keywords); the flag's
# dest is its name with underscores (--sample-seed: the engine has a --seed of its own)
SAMPLING_OPTIONS = {
    "max_tokens": ("--max-tokens", dict(type=int, default=128, help="most tokens generated per prompt")),
    "temperature": ("--temperature", dict(type=float, default=0.0, help="sampling temperature; 0: greedy")),
    "top_p": ("--top-p", dict(type=float, default=1.0, help="sample from the fewest most likely tokens whose "
                                                           "probabilities add up to P; 1: off")),
    "top_k": ("--top-k", dict(type=int, default=0, help="sample from the K most likely tokens; 0: off")),
    "min_p": ("--min-p", dict(type=float, default=0.0, help="drop the tokens less likely than P times the most "
                                                           "likely one; 0: off")),
    "seed": ("--sample-seed", dict(type=int, default=None, help="sampling seed of every prompt (default: each "
                                                               "draws its own from the engine's --seed)")),
    "stop": ("--stop", dict(action="append", default=None, help="a stop string; repeat the flag for several (default: "
                                                                "none)")),
    "ignore_eos": ("--ignore-eos", dict(action="store_true", help="go on past the end-of-sequence token")),
}


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text for one or more prompts, streaming it",
                       description="Generate text with the embedded default model or a local HF model dir.",
                       formatter_class=HelpFormatter)
    p.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompts (default: read one from stdin)")
    p.add_argument("--model", default=None, help=model_help())
    g = p.add_argument_group("sampling (SamplingParams)")
    for flag, kwargs in SAMPLING_OPTIONS.values():
        g.add_argument(flag, **kwargs)
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    # max_num_seqs None: as many as the prompts (at most 64)
    add_engine_arguments(p, {"max_num_seqs": {"default": None, "help": "most requests running at once (default: the "
                                                                      "number of prompts, at most 64)"}})
    p.set_defaults(func=run_generate, _check=_check_generate)


def _sampling_params(args: argparse.Namespace):
    """generate's SamplingParams; a ValueError names the flag."""
    from pagedjax.sampling_params import SamplingParams

    kwargs = {name: getattr(args, flag[2:].replace("-", "_")) for name, (flag, _) in SAMPLING_OPTIONS.items()}
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        raise ValueError(flag_names(str(e), {name: flag for name, (flag, _) in SAMPLING_OPTIONS.items()})) from None


def _check_generate(args: argparse.Namespace) -> None:
    _sampling_params(args)
    check_engine_arguments(args)


def run_generate(args: argparse.Namespace) -> int:
    from pagedjax.engine.llm_engine import LLMEngine

    prompts = args.prompts or ([sys.stdin.read().strip()] if not sys.stdin.isatty() else [])
    if not prompts or not all(prompts):
        print(f"{args._parser.prog}: error: give at least one non-empty PROMPT (or pipe one on stdin)",
              file=sys.stderr)
        return 2
    try:
        params = _sampling_params(args)
        init_processes(args)
        kwargs = engine_kwargs(args)
        if args.max_num_seqs is None:  # no bigger batch than the prompts: fewer, smaller shapes to compile
            kwargs["max_num_seqs"] = min(len(prompts), 64)
        engine = LLMEngine(args.model, stream_text=True, **kwargs)
        for i, prompt in enumerate(prompts):
            if args.chat:
                if not getattr(engine.tokenizer, "chat_template", None):
                    raise ValueError("this model has no chat template; leave out --chat (the prompt is then "
                                     "given to the model as it is)")
                prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                              add_generation_prompt=True, tokenize=False)
            engine.add_request(str(i), prompt, params)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"{args._parser.prog}: error: {flag_names(str(e), engine_flags())}", file=sys.stderr)
        return 2
    _stream(engine, len(prompts))
    return 0


def _stream(engine, n: int) -> None:
    """Prints text as it is produced: live for one prompt; for several, each prompt's text
    when it ends, in prompt order (one that ends early waits for those before it)."""
    shown, done, next_up = 0, {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
            if n == 1:
                sys.stdout.write(text[shown:])
                sys.stdout.flush()
                shown = len(text)
            elif out.finished:
                done[int(out.request_id)] = text
        while next_up in done:
            print(f"--- [{next_up}] ---\n{done.pop(next_up)}", flush=True)
            next_up += 1
    if n == 1:
        print()


def package_version() -> str:
    """The installed distribution's version (`pagedjax.__version__`); "unknown" when run from
    a source tree that was never installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pagedjax")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    """`pagedjax` and its subcommands."""
    parser = argparse.ArgumentParser(prog="pagedjax", description="JAX/Pallas LLM inference with a paged KV cache",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    try:
        from pagedjax.entrypoints.openai.api_server import add_serve_arguments, run_serve
    except ImportError:
        pass
    else:
        serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server", formatter_class=HelpFormatter,
                               description="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, "
                                           "...) over the embedded default model or a local HF model dir.")
        add_serve_arguments(serve)
        serve.set_defaults(func=run_serve)
    bench = sub.add_parser("bench", help="benchmarks", formatter_class=HelpFormatter)
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    from pagedjax.compare import cli as compare_cli

    compare = bench_sub.add_parser("compare", help="dense vs paged KV cache on one workload and KV budget",
                                   description="Dense vs paged KV cache: same model, workload and KV memory budget; "
                                               "writes JSON, a markdown table and PNG plots.",
                                   formatter_class=HelpFormatter)
    compare_cli.add_arguments(compare)
    compare.set_defaults(func=compare_cli.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_arguments(args)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
