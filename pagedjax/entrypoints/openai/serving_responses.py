"""/v1/responses (OpenAI's Responses API, its core): each request converts to a chat request
(responses_convert.py) and runs on the chat path (ChatServing.start: template, tools,
structured outputs, sampling, the engine); its output comes back as response output items
or stream events (responses_output.py). Nothing is stored: see docs/responses.md.
"""
from __future__ import annotations

import contextlib
import uuid

from fastapi import Request

from pagedjax.engine.async_engine import EngineDeadError, ShuttingDownError
from pagedjax.entrypoints.openai.errors import APIError
from pagedjax.entrypoints.openai.responses_convert import chat_request, check_supported, renamed
from pagedjax.entrypoints.openai.responses_output import EventWriter, ResponseBuilder
from pagedjax.entrypoints.openai.responses_protocol import ResponsesRequest
from pagedjax.entrypoints.openai.serving_chat import ChatRun, ChatServing
from pagedjax.entrypoints.openai.serving_common import completions_by_index
from pagedjax.entrypoints.openai.streaming import json_bytes, json_response, merge_streams


class ResponsesServing:
    """Handler of /v1/responses, on top of the chat handler."""

    def __init__(self, chat: ChatServing) -> None:
        self.chat = chat

    async def create(self, req: ResponsesRequest, request: Request):
        check_supported(req)
        response_id = f"resp_{uuid.uuid4().hex}"
        try:
            run = await self.chat.start(chat_request(req), request, request_id=response_id)
        except APIError as exc:
            raise renamed(exc) from None
        builder = ResponseBuilder(req, response_id, run.model)
        if req.stream:
            return self.chat.event_stream(self.events(builder, run), run.streams)
        final = (await self.chat.collect(request, run.streams))[0]
        return json_response(await self.chat.run_cpu(self.response_body, builder, run, final))

    def response_body(self, builder: ResponseBuilder, run: ChatRun, final) -> bytes:
        c = completions_by_index(final, 1)[0]
        reasoning, content, calls, reason = run.parser().message(c.text, c.finish_reason or "abort")
        usage = self.usage(run, final.num_cached_tokens, reasoning or "")
        return json_bytes(builder.final(reasoning, content, calls, reason, usage))

    def usage(self, run: ChatRun, cached_tokens: int, reasoning: str) -> dict:
        """Token counts; the reasoning's are those of its text, tokenized again (on the worker thread)."""
        reasoning_tokens = len(self.chat.encode(reasoning, "input", add_special_tokens=False)) if reasoning else 0
        output_tokens = self.chat.usage([run.ids], run.streams).completion_tokens
        return ResponseBuilder.usage(len(run.ids), output_tokens, cached_tokens, reasoning_tokens)

    async def events(self, builder: ResponseBuilder, run: ChatRun):
        """The server-sent events of a streamed response."""
        writer, parser = EventWriter(builder), run.parser()
        reason, cached = "abort", 0
        try:
            yield writer.start()
            async with contextlib.aclosing(merge_streams(run.streams)) as merged:
                async for _, out in merged:
                    cached = out.num_cached_tokens
                    c = completions_by_index(out, 1)[0]
                    end = c.finish_reason or ("abort" if out.finished else None)
                    text = ""
                    for fields, why in parser.deltas(0, c.text, end):
                        text += writer.delta(fields)
                        reason = why or reason
                    if text:
                        yield text
                    if end is not None:
                        break
            usage = await self.chat.run_cpu(self.usage, run, cached, writer.reasoning)
            yield writer.finish(reason, usage)
        except (EngineDeadError, ShuttingDownError) as exc:
            yield writer.error(str(exc))
