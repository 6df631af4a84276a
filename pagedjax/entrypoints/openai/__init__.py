"""OpenAI-compatible HTTP server for pagedjax.

`AsyncEngine` runs any engine with the `LLMEngine` interface in one background thread;
`build_app` puts a FastAPI app in front of it; `cli` holds `pagedjax serve`.
"""
from pagedjax.engine.async_engine import AsyncEngine, EngineDeadError, QueueFullError, ShuttingDownError
from pagedjax.entrypoints.openai.app import build_app

__all__ = ["AsyncEngine", "EngineDeadError", "QueueFullError", "ShuttingDownError", "build_app"]
