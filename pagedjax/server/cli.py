"""`pagedjax serve`: argument definitions and the serving entry point.

The top-level CLI wires these in with `add_serve_arguments(subparser)` and
`run_serve(args)`; `python -m pagedjax.server` runs them standalone.
"""
from __future__ import annotations

import argparse
import logging
from typing import Any

import uvicorn

logger = logging.getLogger("pagedjax.server")


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `serve` options to `parser` (the engine knobs are the shared ones of
    `pagedjax.cli.add_engine_arguments`)."""
    from pagedjax.cli import add_engine_arguments

    parser.add_argument("model", nargs="?", default=None, metavar="MODEL",
                        help="local Hugging Face model dir (default: the embedded SmolLM2-135M-Instruct)")
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    g.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/*")
    g.add_argument("--served-model-name", default=None, help="model name clients use (default: the model's)")
    g.add_argument("--max-pending-requests", type=int, default=1024,
                   help="requests waiting for their first token before new ones get 429")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on SIGTERM/SIGINT before they are aborted")
    g.add_argument("--no-warmup", action="store_true", help="do not compile the step buckets ahead (each compiles on first use)")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_engine_arguments(parser)
    return parser


class _Server(uvicorn.Server):
    """uvicorn.Server that stops admitting at the first signal and does not re-raise the
    signal after its graceful shutdown, so the process exits 0."""

    def __init__(self, config: uvicorn.Config, async_engine: Any) -> None:
        super().__init__(config)
        self.async_engine = async_engine

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.async_engine.stop_admitting()
        super().handle_exit(sig, frame)
        getattr(self, "_captured_signals", []).clear()


def serve(async_engine: Any, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          served_model_name: str | None = None, shutdown_timeout: float = 30.0, log_level: str = "info") -> int:
    """Serve `async_engine` over HTTP until SIGTERM/SIGINT; returns the exit code (0)."""
    from pagedjax.server.app import build_app

    app = build_app(async_engine, served_model_name, api_key)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=shutdown_timeout, timeout_keep_alive=5)
    server = _Server(config, async_engine)
    server.run()
    return 0 if server.started else 1


def run_serve(args: argparse.Namespace) -> int:
    """Build the real engine from parsed `serve` arguments and serve it."""
    from pagedjax.cli import engine_kwargs, init_processes
    from pagedjax.engine import LLMEngine  # lazy: importing JAX and loading weights is slow
    from pagedjax.server.async_engine import AsyncEngine

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("pagedjax").setLevel(args.log_level.upper())
    try:
        init_processes(args)
        engine = LLMEngine(args.model, stream_text=True, **engine_kwargs(args))
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        logger.error("cannot start the engine: %s", exc)
        return 2
    if not args.no_warmup and hasattr(engine, "warmup"):
        logger.info("compiling the smallest step bucket now and the others in the background "
                    "(--no-warmup compiles each on first use instead)")
        engine.warmup(background=True)
    if args.num_processes > 1:
        from pagedjax.distributed import LeaderEngine, follow

        if args.process_id != 0:  # no HTTP here: run process 0's schedule step by step
            logger.info("process %d follows process 0's schedule", args.process_id)
            follow(engine)
            return 0
        engine = LeaderEngine(engine)
    async_engine = AsyncEngine(engine, max_pending_requests=args.max_pending_requests)
    code = serve(async_engine, args.host, args.port, args.api_key, args.served_model_name,
                 args.shutdown_timeout, args.log_level)
    if args.num_processes > 1:  # the followers exit with process 0
        engine.close()
    return code


def main(argv: list[str] | None = None) -> int:
    parser = add_serve_arguments(argparse.ArgumentParser(prog="pagedjax serve",
                                                         description="OpenAI-compatible server"))
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
