"""Command line: `pagedjax generate ...`, `pagedjax serve ...` and `pagedjax bench compare ...`."""
from __future__ import annotations

import argparse
import copy
import os
import re
import sys

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


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default: `(default: 16)`, `(default: on)`, `(default:
    off)` for a switch that is not given, unless the help says it in words already
    (`(default: the model's max_position_embeddings)`)."""

    def _format_action(self, action: argparse.Action) -> str:
        if action.help is None and action.option_strings:  # argparse prints no help line for these
            action = copy.copy(action)
            action.help = ""
            action.help = self._get_help_string(action)
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help
        if (text is None or text is argparse.SUPPRESS or not action.option_strings or "(default" in text
                or action.default is argparse.SUPPRESS
                or isinstance(action, (argparse._HelpAction, argparse._VersionAction))):
            return text
        # store_true / store_false: a switch, off unless given
        default = "off" if isinstance(action, argparse._StoreConstAction) else "%(default)s"
        return f"{text} (default: {default})".lstrip()

    def _expand_help(self, action: argparse.Action) -> str:
        default = action.default
        if isinstance(default, bool):
            shown = "on" if default else "off"
        elif default is None:
            shown = "none"
        elif isinstance(default, (list, tuple)):
            shown = " ".join(map(str, default))
        else:
            return super()._expand_help(action)
        action = copy.copy(action)
        action.default = shown
        return super()._expand_help(action)


def flag_names(message: str, names: dict[str, str]) -> str:
    """`message` with the Python names in `names` (field -> flag) written as their flags:
    "max_tokens must be ..." -> "--max-tokens must be ..."."""
    if not names:
        return message
    pattern = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
    return re.sub(rf"(?<![\w-])({pattern})(?!\w)", lambda m: names[m.group(1)], message)


def engine_flags() -> dict[str, str]:
    """EngineConfig field -> its long flag."""
    return {f.name: "--" + f.name.replace("_", "-") for f in engine_fields()}


def check_arguments(args: argparse.Namespace) -> None:
    """The flag values that the parser's types cannot check alone (SamplingParams and
    EngineConfig validate them), checked before anything loads: a bad one is a usage error
    that names its flag (exit code 2), like a malformed value."""
    check = getattr(args, "_check", None)
    if check is not None:
        try:
            check(args)
        except ValueError as e:
            args._parser.error(str(e))


def check_engine_arguments(args: argparse.Namespace) -> None:
    """Raises ValueError naming the flag when the engine flags are not a valid EngineConfig."""
    from pagedjax.config import EngineConfig

    try:
        EngineConfig(model=args.model, **engine_kwargs(args))
    except ValueError as e:
        raise ValueError(flag_names(str(e), engine_flags())) from None
    if args.num_processes < 1:
        raise ValueError(f"--num-processes must be a positive integer, got {args.num_processes}")
    if args.num_processes > 1 and not args.coordinator_address:
        raise ValueError("--num-processes > 1 needs --coordinator-address HOST:PORT (process 0's)")
    if not 0 <= args.process_id < args.num_processes:
        raise ValueError(f"--process-id must be in [0, --num-processes={args.num_processes}), got {args.process_id}")


def add_engine_arguments(p: argparse.ArgumentParser, overrides: dict[str, dict] | None = None) -> None:
    """A flag for every EngineConfig field (but `model`, which each subcommand takes its own
    way), generated from the fields: `--block-size`, `--enable-prefix-caching` /
    `--no-enable-prefix-caching`, ...; the help shows each default. overrides: field name ->
    add_argument keywords (default, help) a subcommand sets its own way. `check_arguments`
    then checks the values as EngineConfig does, naming the flags."""
    p.set_defaults(_parser=p, _check=check_engine_arguments)
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
    m.add_argument("--coordinator-address", default=None, metavar="HOST:PORT",
                   help="process 0's address (default: none, one process)")
    m.add_argument("--num-processes", type=int, default=1, help="processes in all")
    m.add_argument("--process-id", type=int, default=0, help="this process's index")


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
    # transformers without torch advises on import that its models are unavailable; pagedjax
    # uses only its tokenizers and configs, so the line would only alarm a command-line user
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    args = build_parser().parse_args(argv)
    check_arguments(args)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
