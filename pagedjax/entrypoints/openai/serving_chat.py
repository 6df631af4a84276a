"""/v1/chat/completions: messages rendered with the tokenizer's chat template."""
from __future__ import annotations

import contextlib
import time
import uuid

from fastapi import Request

from pagedjax.outputs import CompletionOutput
from pagedjax.engine.async_engine import EngineDeadError, ShuttingDownError
from pagedjax.entrypoints.openai.errors import APIError, bad_request
from pagedjax.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from pagedjax.entrypoints.openai.response_bodies import (ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                                         ChatCompletionResponse, ChatLogprobs, ChatResponseMessage,
                                                         ChatTokenLogprob, DeltaMessage, TopLogprob)
from pagedjax.entrypoints.openai.serving_common import ServingBase, completions_by_index, finite, top_logprobs
from pagedjax.entrypoints.openai.streaming import SSE_DONE, json_bytes, json_dumps, json_response, merge_streams, sse
from pagedjax.entrypoints.openai.tool_calls import ToolPlan, ToolStreams, plan_tools, template_messages, tool_constraint


class ChatServing(ServingBase):
    """Handler of /v1/chat/completions."""

    async def create(self, req: ChatCompletionRequest, request: Request):
        lora = self.check_common(req)
        model = lora.lora_name if lora is not None else self.served_model_name
        tools = plan_tools(req, self.tokenizer)  # None: no tools (tool_calls.py)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("`top_logprobs` requires `logprobs` to be true", "top_logprobs")
        k = (req.top_logprobs or 0) if req.logprobs else None
        spec, spec_param = tool_constraint(tools, *self.structured_outputs(req))
        ids = await self.run_cpu(self.prompt_ids, req.messages, tools)
        if spec is not None:
            await self.compile_structured_outputs(spec, spec_param)
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = self.resolve_max_tokens(requested, None, len(ids), param, "messages")
        if req.use_beam_search:  # n beams, best first, as n choices
            params = self.beam_search_params(req, max_tokens)
        else:
            params = self.sampling_params(req, max_tokens, k, structured_outputs=spec)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self.submit(request_id, [ids], [params], req.cache_salt, request, lora)
        n = req.n or 1
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return self.event_stream(self.stream(request_id, ids, streams, n, k, include_usage, tools, model),
                                     streams)
        finals = await self.collect(request, streams)
        # built and serialized on the worker thread: a big logprobs answer never stalls the loop
        return json_response(await self.run_cpu(self.response_body, request_id, ids, streams, finals[0], n, k,
                                                tools, model))

    def response_body(self, request_id: str, ids: list[int], streams, final, n: int, k: int | None,
                      tools: ToolPlan | None = None, model: str | None = None) -> bytes:
        choices = [ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                              logprobs=self.logprobs(c, k), finish_reason=c.finish_reason or "abort")
                   for c in completions_by_index(final, n)]
        if tools is not None and tools.parses:  # the text becomes content and tool calls
            for ch in choices:
                ch.message.content, ch.message.tool_calls, ch.finish_reason = tools.message(
                    ch.message.content or "", ch.finish_reason)
        return json_bytes(ChatCompletionResponse(id=request_id, model=model or self.served_model_name, choices=choices,
                                                 usage=self.usage([ids], streams)).model_dump())

    def prompt_ids(self, messages: list[ChatMessage], tools: ToolPlan | None = None) -> list[int]:
        """Render the chat template (with the generation prompt) and tokenize it."""
        ids = self.encode(self.render(messages, tools=tools), "messages", add_special_tokens=False)
        self.check_prompt_ids(ids, "messages")
        return ids

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
               tools: ToolPlan | None = None) -> str:
        """The prompt text of `messages` (the chat template rendered, with the tools if any)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad_request("this model has no chat template; use /v1/completions", "messages")
        rendered = template_messages(messages, self.tokenizer, tools)
        try:
            return self.tokenizer.apply_chat_template(rendered, tools=tools.tools if tools else None,
                                                      add_generation_prompt=add_generation_prompt, tokenize=False)
        except ImportError as exc:  # no template engine (jinja2) here: the server's fault, not the request's
            raise APIError(f"the server cannot render chat templates: {exc}", 500, "server_error") from None
        except Exception as exc:  # jinja errors: the template rejects these messages
            raise bad_request(f"the chat template rejected the messages: {exc}", "messages") from None

    def logprobs(self, c: CompletionOutput, k: int | None) -> ChatLogprobs | None:
        """Chat-style logprobs of c's tokens (None when not requested)."""
        if k is None:
            return None
        entries = c.logprobs or []
        content = []
        for pos, tid in enumerate(c.token_ids):
            entry = entries[pos] if pos < len(entries) else {}
            token = self.decode_token(tid)
            top = [self.top_entry(t, v) for t, v in top_logprobs(entry, k)]
            content.append(ChatTokenLogprob(token=token, logprob=finite(entry.get(tid, float("-inf"))),
                                            bytes=list(token.encode("utf-8")), top_logprobs=top))
        return ChatLogprobs(content=content)

    def top_entry(self, tid: int, logprob: float) -> TopLogprob:
        token = self.decode_token(tid)
        return TopLogprob(token=token, logprob=finite(logprob), bytes=list(token.encode("utf-8")))

    async def stream(self, request_id: str, ids: list[int], streams, n: int, k: int | None, include_usage: bool,
                     tools: ToolPlan | None = None, model: str | None = None):
        """SSE chunks: a role delta per choice, content deltas, finish reasons, usage, [DONE]."""
        created = int(time.time())
        model = model or self.served_model_name

        def chunk(choice: ChatChunkChoice | None, usage=None) -> str:
            body = ChatCompletionChunk(id=request_id, created=created, model=model,
                                       choices=[choice] if choice else [], usage=usage).model_dump()
            for ch in body["choices"]:
                ch["delta"] = {key: v for key, v in ch["delta"].items() if v is not None}
            if not include_usage:
                body.pop("usage")
            return sse(json_dumps(body))

        done: set[int] = set()
        parsers = ToolStreams(tools) if tools is not None and tools.parses else None  # text -> tool calls

        def chunks_of(out) -> str:
            text = ""
            for c in completions_by_index(out, n):
                reason = c.finish_reason or ("abort" if out.finished else None)
                if c.index in done or (not c.text and not c.token_ids and reason is None):
                    continue
                if reason is not None:
                    done.add(c.index)
                parts = [({"content": c.text or None}, reason)] if parsers is None else \
                    parsers.deltas(c.index, c.text, reason)
                for j, (fields, why) in enumerate(parts):
                    text += chunk(ChatChunkChoice(index=c.index, delta=DeltaMessage(**fields),
                                                  logprobs=self.logprobs(c, k) if j == 0 else None, finish_reason=why))
            return text

        try:
            for i in range(n):
                yield chunk(ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant",
                                                                        content="" if parsers is None else None)))
            async with contextlib.aclosing(merge_streams(streams)) as merged:
                async for _, out in merged:
                    # logprobs can make a chunk large: build those off the event loop
                    text = chunks_of(out) if k is None else await self.run_cpu(chunks_of, out)
                    if text:
                        yield text
            if include_usage:
                yield chunk(None, self.usage([ids], streams))
        except (EngineDeadError, ShuttingDownError) as exc:
            yield sse(json_dumps(APIError(str(exc), 503, "service_unavailable_error").body()))
        yield SSE_DONE
