"""`pagedjax serve`: argument definitions and the serving entry point.

The top-level CLI wires these in with `add_serve_arguments(subparser)` and
`run_serve(args)`; `python -m pagedjax.entrypoints.openai` runs them standalone.
"""
from __future__ import annotations

import argparse
import errno
import ipaddress
import json
import logging
import os
import socket
from typing import Any

import uvicorn

from pagedjax.entrypoints.openai.reasoning import REASONING_PARSERS

logger = logging.getLogger("pagedjax.entrypoints.openai")


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `serve` options to `parser` (the engine knobs are the shared ones of
    `pagedjax.entrypoints.cli_args.add_engine_arguments`)."""
    from pagedjax.entrypoints.cli_args import add_engine_arguments, model_help

    parser.add_argument("model", nargs="?", default=None, metavar="MODEL", help=model_help())
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="bind address")
    g.add_argument("--port", type=int, default=8000, help="port (0: any free one)")
    g.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on /v1/* (default: $PAGEDJAX_API_KEY; prefer the "
                        "variable, argv is visible to other users of the machine)")
    g.add_argument("--served-model-name", default=None, help="model name clients use (default: the model's)")
    g.add_argument("--max-pending-requests", type=int, default=1024,
                   help="sequences (prompts x n) waiting for their first token before new requests get 429")
    g.add_argument("--max-request-bytes", type=_positive(int), default=4 * 1024 * 1024,
                   help="largest request body accepted, in bytes (default: 4 MiB; larger ones get 413)")
    g.add_argument("--stream-send-timeout", type=_positive(float), default=30.0,
                   help="seconds a streaming client may take no data before its request is aborted")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on SIGTERM/SIGINT before they are aborted")
    g.add_argument("--no-warmup", action="store_true", help="do not compile the step buckets ahead (each compiles on first use)")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="pagedjax's and uvicorn's log level")
    g.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="split a thinking model's `<think>...</think>` text off its answer: `reasoning_content` in chat "
                        "responses and deltas, reasoning items on /v1/responses; tool calls are parsed after it. "
                        "qwen3: the output starts in the answer; deepseek_r1: in the thinking (default: off)")
    g.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                   help="the chat template for /v1/chat/completions and /tokenize instead of the model's: a Jinja "
                        "file or the template text itself (default: the tokenizer's)")
    g.add_argument("--lora-modules", nargs="+", type=lora_module, default=None, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT dirs) loaded at startup, each served as model NAME (ids 1, 2, ... in "
                        "order); an item may also be JSON: '{\"name\": NAME, \"path\": PATH}'. Needs --enable-lora "
                        "(default: none)")
    add_engine_arguments(parser)
    parser.set_defaults(_check=check_serve_arguments)
    return parser


def lora_module(text: str) -> tuple[str, str]:
    """One --lora-modules item, `NAME=PATH` or JSON `{"name": NAME, "path": PATH}`, as (name, path)."""
    if text.lstrip().startswith("{"):
        try:
            item = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from None
        name, path = (item.get("name"), item.get("path")) if isinstance(item, dict) else (None, None)
    else:
        name, _, path = text.partition("=")
    if not isinstance(name, str) or not isinstance(path, str) or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=PATH or {{\"name\": NAME, \"path\": PATH}}, got {text!r}")
    return name.strip(), path.strip()


def check_serve_arguments(args: argparse.Namespace) -> None:
    """The engine flags as EngineConfig checks them, then --lora-modules (ValueError naming the flag)."""
    from pagedjax.entrypoints.cli_args import check_engine_arguments

    from pagedjax.entrypoints.chat_template import load_chat_template

    check_engine_arguments(args)
    try:
        args.chat_template = load_chat_template(args.chat_template)  # read once; the server gets the text
    except (OSError, ValueError) as exc:
        raise ValueError(f"--chat-template: {exc}") from None
    if args.enable_lora and args.num_processes > 1:
        raise ValueError("--enable-lora is not supported with --num-processes > 1")
    modules = args.lora_modules or []
    if modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    names = [args.served_model_name] + [name for name, _ in modules]
    taken = next((n for i, n in enumerate(names) if n is not None and n in names[:i]), None)
    if taken is not None:
        raise ValueError(f"--lora-modules: the model name {taken!r} is taken twice (each adapter and "
                         f"--served-model-name need a name of their own)")


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


class _Server(uvicorn.Server):
    """uvicorn.Server that stops admitting at the first signal and does not re-raise the
    signal after its graceful shutdown, so the process exits 0."""

    def __init__(self, config: uvicorn.Config, async_engine: Any, banner: str | None = None) -> None:
        super().__init__(config)
        self.async_engine = async_engine
        self.banner = banner

    async def startup(self, sockets: list | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and self.banner:
            logger.info("pagedjax serving %s at %s", self.banner, self.url())

    def url(self) -> str:
        """http://HOST:PORT with the port actually bound (--port 0: the one the system chose)."""
        host, port = self.config.host, self.config.port
        for server in getattr(self, "servers", []):
            for sock in server.sockets or ():
                port = sock.getsockname()[1]
                break
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.async_engine.stop_admitting()
        super().handle_exit(sig, frame)
        getattr(self, "_captured_signals", []).clear()


def engine_banner(engine: Any, served_model_name: str | None = None) -> str:
    """"MODEL (dtype D, weights Q, KV K, KV pool N tokens / X.XX GiB)" from what the engine reports; the parts
    an engine does not report are left out."""
    name = getattr(engine, "model_name", None) or served_model_name or "the model"
    if served_model_name and served_model_name != name:
        name = f"{name} as {served_model_name!r}"
    details = []
    dtype = getattr(getattr(engine, "model", None), "dtype", None)
    if dtype is not None:
        details.append(f"dtype {getattr(dtype, 'name', dtype)}")
    quantization = getattr(getattr(engine, "model", None), "quantization", None)
    if quantization:
        details.append(f"weights {quantization}")
    kv_dtype = getattr(engine, "kv_dtype", None)
    if kv_dtype is not None:
        details.append(f"KV {getattr(kv_dtype, 'name', kv_dtype)}")
    kv_memory, per_token = getattr(engine, "kv_memory", None), getattr(engine, "kv_bytes_per_token", None)
    if callable(kv_memory) and per_token:
        tokens = kv_memory().capacity
        details.append(f"KV pool {tokens:,} tokens / {tokens * per_token / 2**30:.2f} GiB")
    return f"{name} ({', '.join(details)})" if details else name


def serve(async_engine: Any, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          served_model_name: str | None = None, shutdown_timeout: float = 30.0, log_level: str = "info",
          max_request_bytes: int = 4 * 1024 * 1024, send_timeout: float = 30.0,
          reasoning_parser: str | None = None, chat_template: str | None = None) -> int:
    """Serve `async_engine` over HTTP until SIGTERM/SIGINT (exit code 0) or until the engine
    fails (exit code 1, so that a supervisor restarts the server). Logs one line when it
    listens: the model, its dtype, the KV pool's size and the URL."""
    from pagedjax.entrypoints.openai.app import build_app

    warn_if_exposed(host, api_key)
    app = build_app(async_engine, served_model_name, api_key, max_request_bytes=max_request_bytes,
                    send_timeout=send_timeout, reasoning_parser=reasoning_parser, chat_template=chat_template)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=shutdown_timeout, timeout_keep_alive=5)
    server = _Server(config, async_engine, engine_banner(async_engine.engine, served_model_name))
    if reasoning_parser:
        logger.info("reasoning parser %s: <think>...</think> goes to reasoning_content", reasoning_parser)

    def engine_died() -> None:
        logger.error("the engine failed: the server stops (exit code 1)")
        server.should_exit = True

    async_engine.on_dead.append(engine_died)
    server.run()
    if async_engine.error is not None:
        return 1
    return 0 if server.started else 1


def warn_if_exposed(host: str, api_key: str | None) -> bool:
    """Warn (and return True) when `host` is reachable from other machines and no key is set."""
    if api_key or _is_loopback(host):
        return False
    logger.warning("listening on %s without an API key: anyone who can reach this address can use the "
                   "server (set PAGEDJAX_API_KEY or --api-key)", host)
    return True


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def api_key_of(args: argparse.Namespace) -> str | None:
    """--api-key, else $PAGEDJAX_API_KEY, else None (no key)."""
    return args.api_key or os.environ.get("PAGEDJAX_API_KEY") or None


def run_serve(args: argparse.Namespace) -> int:
    """Build the real engine from parsed `serve` arguments and serve it."""
    from pagedjax.entrypoints.cli_args import engine_flags, engine_kwargs, flag_names, init_processes
    from pagedjax.engine.llm_engine import LLMEngine  # lazy: importing JAX and loading weights is slow
    from pagedjax.engine.async_engine import AsyncEngine
    from pagedjax.platforms import current_platform

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("pagedjax").setLevel(args.log_level.upper())
    busy = port_unavailable(args.host, args.port) if args.process_id == 0 else None
    if busy:  # before the model loads and compiles: that takes seconds to minutes
        logger.error("%s", busy)
        return 2
    try:
        init_processes(args)
        engine = LLMEngine(args.model, stream_text=True, **engine_kwargs(args))
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        logger.error("cannot start the engine: %s", flag_names(str(exc), engine_flags()))
        return 2
    logger.info("platform %s", current_platform().describe())
    if not load_lora_modules(engine, args.lora_modules or []):
        return 2
    if not args.no_warmup and hasattr(engine, "warmup"):
        logger.info("compiling the smallest step bucket now and the others in the background "
                    "(--no-warmup compiles each on first use instead)")
        engine.warmup(background=True)
    if args.num_processes > 1:
        from pagedjax.parallel.distributed import LeaderEngine, follow

        if args.process_id != 0:  # no HTTP here: run process 0's schedule step by step
            logger.info("process %d follows process 0's schedule", args.process_id)
            follow(engine)
            return 0
        engine = LeaderEngine(engine)
    async_engine = AsyncEngine(engine, max_pending_requests=args.max_pending_requests)
    code = serve(async_engine, args.host, args.port, api_key_of(args), args.served_model_name, args.shutdown_timeout,
                 args.log_level, args.max_request_bytes, args.stream_send_timeout, args.reasoning_parser,
                 args.chat_template)
    if args.num_processes > 1:  # the followers exit with process 0
        engine.close()
    return code


def port_unavailable(host: str, port: int) -> str | None:
    """Why the server could not listen on host:port (a message naming the flags), or None
    when it can: a test bind with the options uvicorn uses (SO_REUSEADDR), then released."""
    if port == 0:
        return None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return f"cannot listen on --host {host}: {e.strerror}"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as e:
            hint = " (another server is listening there: stop it or choose another --port)" \
                if e.errno == errno.EADDRINUSE else ""
            return f"cannot listen on {host}:{port}: {e.strerror}{hint}"
    return None


def load_lora_modules(engine: Any, modules: list[tuple[str, str]]) -> bool:
    """Load the --lora-modules adapters with ids 1, 2, ... in order; False (logged) at the first that fails."""
    from pagedjax.lora.request import LoRARequest

    for lora_id, (name, path) in enumerate(modules, 1):
        try:
            engine.add_lora(LoRARequest(name, lora_id, path))
        except (ValueError, OSError) as exc:
            logger.error("cannot load LoRA adapter %r from %r (--lora-modules): %s", name, path, exc)
            return False
        logger.info("loaded LoRA adapter %r from %r", name, path)
    return True


def main(argv: list[str] | None = None) -> int:
    from pagedjax.entrypoints.cli_args import HelpFormatter, check_arguments

    parser = add_serve_arguments(argparse.ArgumentParser(prog="pagedjax serve", description="OpenAI-compatible server",
                                                         formatter_class=HelpFormatter))
    args = parser.parse_args(argv)
    check_arguments(args)
    return run_serve(args)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
