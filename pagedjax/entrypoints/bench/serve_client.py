"""The HTTP side of `pagedjax bench serve`: request bodies, one streamed request timed chunk by
chunk, and the check that the server answers before the load starts."""
from __future__ import annotations

import json
import time

import httpx

from pagedjax.entrypoints.bench.datasets import BenchRequest
from pagedjax.entrypoints.bench.metrics import RequestResult

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


class ServerUnreachable(RuntimeError):
    """The server did not answer the check before the run (a message for the user)."""


def base_url(url: str) -> str:
    """The server's root: no trailing slash and no trailing /v1 (the endpoints carry it)."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def request_body(req: BenchRequest, endpoint_type: str, model: str, stream: bool, ignore_eos: bool,
                 temperature: float, extra: dict | None = None) -> dict:
    """The JSON body of one request (chat: `max_completion_tokens`, as current OpenAI clients)."""
    body: dict = {"model": model, "temperature": temperature, "stream": stream}
    if endpoint_type == "chat":
        body.update(messages=req.messages, max_completion_tokens=req.max_tokens)
    else:
        body.update(prompt=req.prompt, max_tokens=req.max_tokens)
    if stream:
        body["stream_options"] = {"include_usage": True}
    if ignore_eos:
        body["ignore_eos"] = True
    return {**body, **(extra or {})}


def _has_output(choice: dict) -> bool:
    """Does a streamed choice carry output (completion text, or a chat delta's content,
    reasoning or tool calls)? A chat stream's opening role-only delta does not."""
    if choice.get("text"):
        return True
    delta = choice.get("delta") or {}
    return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
                or delta.get("tool_calls"))


def _take_usage(res: RequestResult, usage: dict | None) -> None:
    if usage and usage.get("completion_tokens") is not None:
        res.output_tokens = int(usage["completion_tokens"])
        if usage.get("prompt_tokens") is not None:
            res.prompt_tokens = int(usage["prompt_tokens"])
        res.usage_reported = True


def _error_text(status: int, body: bytes) -> str:
    try:
        msg = json.loads(body).get("error", {})
        msg = msg.get("message", msg) if isinstance(msg, dict) else msg
    except (ValueError, AttributeError):
        msg = body.decode(errors="replace")
    return f"HTTP {status}: {str(msg)[:300]}"


async def send(client: httpx.AsyncClient, path: str, body: dict, prompt_len: int | None, t0: float) -> RequestResult:
    """Sends one request and times it: TTFT at the first chunk with output, ITL between such
    chunks, E2E at the stream's end; token counts from `usage` where the server sends it, else
    one output token per output chunk."""
    start = time.perf_counter()
    res = RequestResult(start=start - t0, prompt_tokens=prompt_len)
    chunks, last = 0, start
    try:
        if not body.get("stream"):
            r = await client.post(path, json=body)
            if r.status_code != 200:
                res.error = _error_text(r.status_code, r.content)
                return res
            data = r.json()
            _take_usage(res, data.get("usage"))
            res.e2e = time.perf_counter() - start
            res.ok = True
            return res
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                res.error = _error_text(r.status_code, await r.aread())
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    err = chunk["error"]
                    res.error = f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
                    return res
                if any(_has_output(c) for c in chunk.get("choices") or []):
                    now = time.perf_counter()
                    if res.ttft is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last, chunks = now, chunks + 1
                _take_usage(res, chunk.get("usage"))
        res.e2e = time.perf_counter() - start
        if not res.usage_reported:
            res.output_tokens = chunks
        res.ok = True
    except httpx.TimeoutException:
        res.error = f"timed out after {time.perf_counter() - start:.1f} s"
    except httpx.HTTPError as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    except (ValueError, TypeError, AttributeError) as exc:  # a malformed chunk
        res.error = f"bad response: {type(exc).__name__}: {exc}"
    return res


async def check_server(client: httpx.AsyncClient, model: str | None) -> str:
    """GET /v1/models: is the server up, is the key accepted; the served model's name when
    `model` is None (the first listed)."""
    try:
        r = await client.get("/v1/models", timeout=15.0)
    except httpx.HTTPError as exc:
        raise ServerUnreachable(f"cannot reach {client.base_url} ({type(exc).__name__}: {str(exc) or 'no answer'}); "
                                "is the server running, and is --base-url right?") from None
    if r.status_code in (401, 403):
        raise ServerUnreachable(f"{client.base_url} refused the request (HTTP {r.status_code}): give the server's "
                                "key with --api-key (or $OPENAI_API_KEY)")
    if model is not None:
        return model
    try:
        return r.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise ServerUnreachable(f"GET {client.base_url}/v1/models answered HTTP {r.status_code} without a model "
                                "list: name the model with --model") from None
