"""Command line: `pagedjax generate ...`, `pagedjax serve ...` and `pagedjax bench compare ...`."""
from __future__ import annotations

import argparse
import os
import sys


def add_engine_arguments(p: argparse.ArgumentParser, overrides: dict[str, dict] | None = None) -> None:
    """A flag for every EngineConfig field (but `model`, which each subcommand takes its own
    way), generated from the fields: `--block-size`, `--enable-prefix-caching` /
    `--no-enable-prefix-caching`, ...; the help shows each default. overrides: field name ->
    add_argument keywords (default, help) a subcommand sets its own way."""
    g = p.add_argument_group("engine (EngineConfig; the same names are LLM(...) keyword arguments)")
    for f in engine_fields():
        meta = dict(f.metadata)
        flags = [*meta.pop("flags", ()), "--" + f.name.replace("_", "-")]
        kind, help_text, negative = meta.pop("type"), meta.pop("help"), meta.pop("negative", None)
        if "(default:" not in help_text:
            help_text += " (default: %(default)s)"
        if kind is bool:
            g.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default,
                           help=help_text)
            if negative:
                g.add_argument(negative, dest=f.name, action="store_false", help=f"the same as --no-{flags[-1][2:]}")
        else:
            kwargs = {"type": kind, "default": f.default, "help": help_text, **meta, **(overrides or {}).get(f.name, {})}
            g.add_argument(*flags, dest=f.name, **kwargs)
    m = p.add_argument_group("several processes (every process runs the same command, its own --process-id)")
    m.add_argument("--coordinator-address", default=None, metavar="HOST:PORT", help="process 0's address")
    m.add_argument("--num-processes", type=int, default=1, help="(default: %(default)s)")
    m.add_argument("--process-id", type=int, default=0, help="(default: %(default)s)")


def engine_fields(with_model: bool = False):
    from dataclasses import fields

    from pagedjax.config import EngineConfig

    return [f for f in fields(EngineConfig) if with_model or f.name != "model"]


def model_help() -> str:
    """EngineConfig.model's help, for the subcommands' own model argument."""
    return engine_fields(with_model=True)[0].metadata["help"]


def init_processes(args: argparse.Namespace) -> None:
    """jax.distributed.initialize for a multi-process run (before anything touches JAX)."""
    if args.num_processes > 1:
        if not args.coordinator_address:
            raise ValueError("--num-processes > 1 needs --coordinator-address HOST:PORT (process 0's)")
        from pagedjax.parallel.distributed import initialize

        initialize(args.coordinator_address, args.num_processes, args.process_id)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The EngineConfig keyword arguments of parsed engine flags."""
    return {f.name: getattr(args, f.name) for f in engine_fields()}


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text for one or more prompts, streaming it",
                       description="Generate text with the embedded default model or a local HF model dir.")
    p.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompts (default: read one from stdin)")
    p.add_argument("--model", default=None, help=model_help())
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    # max_num_seqs None: as many as the prompts (at most 64)
    add_engine_arguments(p, {"max_num_seqs": {"default": None, "help": "most requests running at once (default: the "
                                                                      "number of prompts, at most 64)"}})
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from pagedjax.engine.llm_engine import LLMEngine
    from pagedjax.sampling_params import SamplingParams

    prompts = args.prompts or ([sys.stdin.read().strip()] if not sys.stdin.isatty() else [])
    if not prompts or not all(prompts):
        print("error: give at least one non-empty PROMPT (or pipe one on stdin)", file=sys.stderr)
        return 2
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, min_p=args.min_p, seed=args.sample_seed, stop=args.stop,
                                ignore_eos=args.ignore_eos)
        init_processes(args)
        kwargs = engine_kwargs(args)
        if args.max_num_seqs is None:  # no bigger batch than the prompts: fewer, smaller shapes to compile
            kwargs["max_num_seqs"] = min(len(prompts), 64)
        engine = LLMEngine(args.model, stream_text=True, **kwargs)
        for i, prompt in enumerate(prompts):
            if args.chat:
                prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                              add_generation_prompt=True, tokenize=False)
            engine.add_request(str(i), prompt, params)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _stream(engine, len(prompts))
    return 0


def _stream(engine, n: int) -> None:
    """Prints text as it is produced: live for one prompt, per prompt when it ends otherwise."""
    shown = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
            if n == 1:
                sys.stdout.write(text[shown:])
                sys.stdout.flush()
                shown = len(text)
            elif out.finished:
                print(f"--- [{out.request_id}] ---\n{text}")
    if n == 1:
        print()


def main(argv: list[str] | None = None) -> int:
    # transformers without torch advises on import that its models are unavailable; pagedjax
    # uses only its tokenizers and configs, so the line would only alarm a command-line user
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    parser = argparse.ArgumentParser(prog="pagedjax", description="JAX/Pallas LLM inference with a paged KV cache")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    try:
        from pagedjax.entrypoints.openai.api_server import add_serve_arguments, run_serve
    except ImportError:
        pass
    else:
        serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
        add_serve_arguments(serve)
        serve.set_defaults(func=run_serve)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    from pagedjax.compare import cli as compare_cli

    compare = bench.add_parser("compare", help="dense vs paged KV cache on one workload and KV budget",
                               description="Dense vs paged KV cache: same model, workload and KV memory budget; "
                                           "writes JSON, a markdown table and PNG plots.")
    compare_cli.add_arguments(compare)
    compare.set_defaults(func=compare_cli.run)
    args = parser.parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
