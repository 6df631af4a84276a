"""Command line: `pagedjax generate ...`, `pagedjax serve ...` and `pagedjax bench ...` (serve, throughput,
latency, startup, compare)."""
from __future__ import annotations

import argparse
import sys

from pagedjax.entrypoints.cli_args import (HelpFormatter, add_engine_arguments, check_arguments,
                                          check_engine_arguments, engine_flags, engine_kwargs, flag_names,
                                          init_processes, model_help)

# generate's own defaults of the flags a model's generation_config.json may set instead
# (--generation-config): the flags default to None, "not given"
GENERATE_DEFAULTS = {"max_tokens": 128, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}
# generate's sampling flags: SamplingParams field -> (flag, add_argument keywords); the flag's
# dest is its name with underscores (--sample-seed: the engine has a --seed of its own)
SAMPLING_OPTIONS = {
    "max_tokens": ("--max-tokens", dict(type=int, default=None, help="most tokens generated per prompt (default: "
                                                                     "128)")),
    "temperature": ("--temperature", dict(type=float, default=None, help="sampling temperature; 0: greedy (default: "
                                                                         "0.0)")),
    "top_p": ("--top-p", dict(type=float, default=None, help="sample from the fewest most likely tokens whose "
                                                            "probabilities add up to P; 1: off (default: 1.0)")),
    "top_k": ("--top-k", dict(type=int, default=None, help="sample from the K most likely tokens; 0: off (default: "
                                                          "0)")),
    "min_p": ("--min-p", dict(type=float, default=None, help="drop the tokens less likely than P times the most "
                                                            "likely one; 0: off (default: 0.0)")),
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
    g = p.add_argument_group("sampling (SamplingParams; a flag left out takes the model's generation_config.json "
                             "value where it has one, see --generation-config)")
    for flag, kwargs in SAMPLING_OPTIONS.values():
        g.add_argument(flag, **kwargs)
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    # max_num_seqs None: as many as the prompts (at most 64)
    add_engine_arguments(p, {"max_num_seqs": {"default": None, "help": "most requests running at once (default: the "
                                                                      "number of prompts, at most 64)"}})
    p.set_defaults(func=run_generate, _check=_check_generate)


def _sampling_params(args: argparse.Namespace, model_defaults: dict | None = None):
    """generate's SamplingParams: the flags given, else the model's generation config
    (model_defaults: LLMEngine.sampling_defaults), else generate's own defaults; a ValueError
    names the flag."""
    from pagedjax.sampling_params import SamplingParams

    given = {name: getattr(args, flag[2:].replace("-", "_")) for name, (flag, _) in SAMPLING_OPTIONS.items()}
    kwargs = {**GENERATE_DEFAULTS, **(model_defaults or {}), **{k: v for k, v in given.items() if v is not None}}
    try:
        params = SamplingParams(**kwargs)
    except ValueError as e:
        raise ValueError(flag_names(str(e), {name: flag for name, (flag, _) in SAMPLING_OPTIONS.items()})) from None
    return params if given.get("max_tokens") is not None else params.held_to_room()


def _check_generate(args: argparse.Namespace) -> None:
    _sampling_params(args)
    check_engine_arguments(args)


def run_generate(args: argparse.Namespace) -> int:
    from pagedjax.engine.llm_engine import LLMEngine
    from pagedjax.entrypoints.chat_template import chat_prompt_ids, render_chat

    prompts = args.prompts or ([sys.stdin.read().strip()] if not sys.stdin.isatty() else [])
    if not prompts or not all(prompts):
        print(f"{args._parser.prog}: error: give at least one non-empty PROMPT (or pipe one on stdin)",
              file=sys.stderr)
        return 2
    try:
        _sampling_params(args)  # the flags' own errors before anything loads
        init_processes(args)
        kwargs = engine_kwargs(args)
        if args.max_num_seqs is None:  # no bigger batch than the prompts: fewer, smaller shapes to compile
            kwargs["max_num_seqs"] = min(len(prompts), 64)
        engine = LLMEngine(args.model, stream_text=True, **kwargs)
        params = _sampling_params(args, engine.sampling_defaults)
        for i, prompt in enumerate(prompts):
            if args.chat:
                if not getattr(engine.tokenizer, "chat_template", None):
                    raise ValueError("this model has no chat template; leave out --chat (the prompt is then "
                                     "given to the model as it is)")
                text = render_chat(engine.tokenizer, [{"role": "user", "content": prompt}])
                prompt = chat_prompt_ids(engine.tokenizer, text)
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
                                           "/v1/responses, ...) over the embedded default model, a local HF model "
                                           "dir or a Hugging Face id.")
        add_serve_arguments(serve)
        serve.set_defaults(func=run_serve)
    from pagedjax.entrypoints.bench import add_bench_parser

    add_bench_parser(sub)  # serve, throughput, latency, startup, compare
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_arguments(args)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
