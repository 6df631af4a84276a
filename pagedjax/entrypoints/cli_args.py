"""The command line's shared argument code: the engine flags generated from EngineConfig, the
help formatter, and their checks. `pagedjax generate`, `pagedjax serve` and `pagedjax bench`
build their parsers from it (it imports neither the CLI nor the server)."""
from __future__ import annotations

import argparse
import copy
import re


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
    # a name followed by `.json` etc. is a file's name (generation_config.json), not the field
    return re.sub(rf"(?<![\w-])({pattern})(?!\w|\.\w)", lambda m: names[m.group(1)], message)


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
