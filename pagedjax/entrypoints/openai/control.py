"""Routes a training loop drives the server with between rollouts (as vLLM's): drop the
prefix cache, release the engine's device memory and restore it. Each runs on the engine
thread between steps (AsyncEngine.call)."""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pagedjax.engine.request_stream import EngineDeadError
from pagedjax.entrypoints.openai.errors import APIError, bad_request


def add_control_routes(app: FastAPI, async_engine) -> None:
    engine = async_engine.engine

    async def run(name: str, *args):
        fn = getattr(engine, name, None)
        if fn is None:  # an engine without the capability (e.g. a test double)
            raise bad_request(f"this server's engine does not support {name}")
        try:
            return await async_engine.call(fn, *args)
        except EngineDeadError as exc:
            raise APIError(str(exc), 503, "service_unavailable_error", None, "unavailable") from None
        except RuntimeError as exc:  # requests still running
            raise APIError(str(exc), 409, "conflict_error", None, "conflict") from None

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        await run("reset_prefix_cache")
        return JSONResponse({"status": "ok"})

    @app.post("/sleep")
    async def sleep(request: Request):
        level = request.query_params.get("level", "1")
        if level not in ("1", "2"):
            raise bad_request(f"level must be 1 (KV pool) or 2 (KV pool and weights), got {level!r}", "level")
        await run("sleep", int(level))
        return JSONResponse({"status": "ok", "sleep_level": int(level)})

    @app.post("/wake_up")
    async def wake_up():
        await run("wake_up")
        return JSONResponse({"status": "ok"})

    @app.get("/is_sleeping")
    async def is_sleeping():
        level = getattr(engine, "sleep_level", 0)
        return JSONResponse({"is_sleeping": level > 0, "sleep_level": level})
