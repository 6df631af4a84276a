"""Streaming for the generation endpoints: the event-stream response whose client must keep up
(a send timeout), the merging of several request streams, waiting for a client's disconnect,
and the JSON and server-sent-event encodings of the responses.
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from pagedjax.outputs import RequestOutput
from pagedjax.engine.async_engine import RequestStream

logger = logging.getLogger(__name__)


class _SlowClient(Exception):
    pass


async def _send_within(send, message, seconds: float) -> None:
    """await send(message), TimeoutError after `seconds` (asyncio.timeout where there is one,
    3.11+: no task per send)."""
    if hasattr(asyncio, "timeout"):
        async with asyncio.timeout(seconds):
            await send(message)
    else:  # pragma: no cover - Python 3.10
        await asyncio.wait_for(send(message), seconds)


class SSEResponse(StreamingResponse):
    """A text/event-stream response whose client must take each chunk within `send_timeout`
    seconds: one that keeps its connection open but stops reading has its requests aborted
    (their blocks freed) and its connection closed. Its requests are aborted whenever the
    response ends, however it ends."""

    def __init__(self, chunks: AsyncIterator[str], send_timeout: float, streams: list[RequestStream]) -> None:
        super().__init__(chunks, media_type="text/event-stream")
        self.send_timeout, self.streams = send_timeout, streams

    async def stream_response(self, send) -> None:
        async def timed_send(message) -> None:
            try:
                await _send_within(send, message, self.send_timeout)
            except asyncio.TimeoutError:
                raise _SlowClient() from None

        try:
            await super().stream_response(timed_send)
        except _SlowClient:
            logger.warning("a client took no data for %.0f s: its request is aborted and its connection "
                           "closed", self.send_timeout)
        finally:
            abort_all(self.streams)
            await self.body_iterator.aclose()


def abort_all(streams: list[RequestStream]) -> None:
    for s in streams:
        s.abort()


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as (stream index, output) until all finish. A
    stream is read only when the consumer takes the previous item, so what a slow consumer
    has not taken stays merged in each stream's one pending update."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    reading = {asyncio.ensure_future(s.__anext__()): i for i, s in enumerate(streams)}
    try:
        while reading:
            done, _ = await asyncio.wait(reading, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=reading.get):
                i = reading.pop(task)
                out = task.result()  # a stream's error ends the merge
                if not out.finished:
                    reading[asyncio.ensure_future(streams[i].__anext__())] = i
                yield i, out
    finally:
        for task in reading:
            task.cancel()


async def wait_for_disconnect(request: Request) -> None:
    """Return once the client has disconnected (the request body is already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def json_dumps(body: dict) -> str:
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False)


def json_response(body: bytes) -> Response:
    """A JSON response from a body already serialized (call json_bytes on the worker thread)."""
    return Response(body, media_type="application/json")


def json_bytes(body: dict) -> bytes:
    return json_dumps(body).encode()


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


SSE_DONE = "data: [DONE]\n\n"
