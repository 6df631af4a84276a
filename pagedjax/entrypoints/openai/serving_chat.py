"""/v1/chat/completions: messages rendered with the tokenizer's chat template."""
from __future__ import annotations

import contextlib
import time
import uuid
from dataclasses import dataclass

from fastapi import Request

from pagedjax.outputs import CompletionOutput
from pagedjax.engine.async_engine import EngineDeadError, ShuttingDownError
from pagedjax.engine.request_stream import RequestStream
from pagedjax.entrypoints.chat_template import ChatTemplateError, render_chat
from pagedjax.entrypoints.openai.errors import APIError, bad_request
from pagedjax.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from pagedjax.entrypoints.openai.response_bodies import (ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                                         ChatCompletionResponse, ChatLogprobs, ChatResponseMessage,
                                                         ChatTokenLogprob, DeltaMessage, TopLogprob)
from pagedjax.entrypoints.openai.serving_common import ServingBase, completions_by_index, finite, top_logprobs
from pagedjax.entrypoints.openai.streaming import SSE_DONE, json_bytes, json_dumps, json_response, merge_streams, sse
from pagedjax.entrypoints.openai.chat_output import OutputParser
from pagedjax.entrypoints.openai.reasoning import ReasoningParser
from pagedjax.entrypoints.openai.tool_calls import ToolPlan, plan_tools, template_messages, tool_constraint


@dataclass(slots=True)
class ChatRun:
    """A chat request added to the engine: what its answer is built from."""

    request_id: str
    ids: list[int]  # the prompt's token ids
    streams: list[RequestStream]
    n: int
    k: int | None  # top logprobs per token (None: no logprobs)
    tools: ToolPlan | None
    model: str  # the name the answer gives (a LoRA adapter's, or the served model's)
    reasoning: ReasoningParser | None = None  # None: off, or the output is constrained
    in_reasoning: bool = False  # the output starts inside the reasoning
    token_ids: bool = False  # return_tokens_as_token_ids: logprobs name tokens `token_id:N`

    def parser(self) -> OutputParser:
        """Fresh per-choice parsers of the output (reasoning, then tool calls)."""
        return OutputParser(self.tools, self.reasoning, self.in_reasoning)


class ChatServing(ServingBase):
    """Handler of /v1/chat/completions."""

    reasoning_parser: ReasoningParser | None = None  # --reasoning-parser (build_app sets it)

    async def create(self, req: ChatCompletionRequest, request: Request):
        run = await self.start(req, request)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return self.event_stream(self.stream(run, include_usage), run.streams)
        finals = await self.collect(request, run.streams)
        # built and serialized on the worker thread: a big logprobs answer never stalls the loop
        return json_response(await self.run_cpu(self.response_body, run, finals[0]))

    async def start(self, req: ChatCompletionRequest, request: Request, request_id: str | None = None) -> ChatRun:
        """Check `req`, render and tokenize its prompt and add it to the engine (also the
        first half of /v1/responses, whose requests convert to chat requests)."""
        lora = self.check_common(req)
        model = lora.lora_name if lora is not None else self.served_model_name
        tools = plan_tools(req, self.tokenizer)  # None: no tools (tool_calls.py)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("`top_logprobs` requires `logprobs` to be true", "top_logprobs")
        k = (req.top_logprobs or 0) if req.logprobs else None
        spec, spec_param = tool_constraint(tools, *self.structured_outputs(req))
        ids = await self.run_cpu(self.prompt_ids, req.messages, tools, req)
        if spec is not None:
            await self.compile_structured_outputs(spec, spec_param)
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = self.resolve_max_tokens(requested, self.default_max_tokens(), len(ids), param, "messages")
        if req.use_beam_search:  # n beams, best first, as n choices
            params = self.beam_search_params(req, max_tokens)
        else:
            params = self.sampling_params(req, max_tokens, k, structured_outputs=spec)
        # a constrained output follows its grammar from the first token: there is no reasoning to split off
        reasoning = self.reasoning_parser if spec is None else None
        in_reasoning = reasoning is not None and reasoning.starts_in_reasoning(await self.run_cpu(self.prompt_tail, ids))
        request_id = request_id or f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self.submit(request_id, [ids], [params], req.cache_salt, request, lora)
        return ChatRun(request_id, ids, streams, req.n or 1, k, tools, model, reasoning, in_reasoning,
                       bool(req.return_tokens_as_token_ids))

    def prompt_tail(self, ids: list[int]) -> str:
        """The text of the prompt's last few tokens (where a template may open `<think>`)."""
        return self.tokenizer.decode(ids[-8:]) if self.tokenizer is not None else ""

    def response_body(self, run: ChatRun, final) -> bytes:
        parser = run.parser()
        choices = []
        for c in completions_by_index(final, run.n):
            reasoning, content, calls, reason = parser.message(c.text, c.finish_reason or "abort")
            choices.append(ChatChoice(index=c.index, message=ChatResponseMessage(
                reasoning_content=reasoning, content=content, tool_calls=calls),
                logprobs=self.logprobs(c, run.k, run.token_ids), finish_reason=reason))
        return json_bytes(ChatCompletionResponse(id=run.request_id, model=run.model, choices=choices,
                                                 usage=self.usage([run.ids], run.streams)).model_dump())

    def prompt_ids(self, messages: list[ChatMessage], tools: ToolPlan | None = None,
                   req: ChatCompletionRequest | None = None) -> list[int]:
        """Render the chat template and tokenize it, with the rendering options of `req`
        (add_generation_prompt, continue_final_message, chat_template_kwargs; None: the
        generation prompt only) and its truncate_prompt_tokens."""
        text = self.render(messages, True if req is None else req.add_generation_prompt is not False, tools,
                           continue_final_message=req is not None and bool(req.continue_final_message),
                           chat_template_kwargs=req.chat_template_kwargs if req is not None else None)
        ids = self.encode(text, "messages", add_special_tokens=False)
        ids = self.truncate(ids, req.truncate_prompt_tokens if req is not None else None)
        self.check_prompt_ids(ids, "messages")
        return ids

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
               tools: ToolPlan | None = None, *, continue_final_message: bool = False,
               chat_template_kwargs: dict | None = None) -> str:
        """The prompt text of `messages` (the chat template rendered, with the tools if any):
        chat_template.render_chat, its errors as 400s naming the field."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad_request("this model has no chat template; use /v1/completions", "messages")
        rendered = template_messages(messages, self.tokenizer, tools)
        try:
            return render_chat(self.tokenizer, rendered, tools=tools.tools if tools else None,
                               add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message,
                               chat_template_kwargs=chat_template_kwargs)
        except ImportError as exc:  # no template engine (jinja2) here: the server's fault, not the request's
            raise APIError(f"the server cannot render chat templates: {exc}", 500, "server_error") from None
        except ChatTemplateError as exc:  # options that do not go together; the template rejects the messages
            raise bad_request(str(exc), exc.param) from None

    def logprobs(self, c: CompletionOutput, k: int | None, as_token_ids: bool = False) -> ChatLogprobs | None:
        """Chat-style logprobs of c's tokens (None when not requested); as_token_ids: tokens
        named `token_id:N` (return_tokens_as_token_ids)."""
        if k is None:
            return None
        entries = c.logprobs or []
        content = []
        for pos, tid in enumerate(c.token_ids):
            entry = entries[pos] if pos < len(entries) else {}
            token = self.token_text(tid, as_token_ids)
            top = [self.top_entry(t, v, as_token_ids) for t, v in top_logprobs(entry, k)]
            content.append(ChatTokenLogprob(token=token, logprob=finite(entry.get(tid, float("-inf"))),
                                            bytes=list(token.encode("utf-8")), top_logprobs=top))
        return ChatLogprobs(content=content)

    def top_entry(self, tid: int, logprob: float, as_token_ids: bool = False) -> TopLogprob:
        token = self.token_text(tid, as_token_ids)
        return TopLogprob(token=token, logprob=finite(logprob), bytes=list(token.encode("utf-8")))

    async def stream(self, run: ChatRun, include_usage: bool):
        """SSE chunks: a role delta per choice, content deltas, finish reasons, usage, [DONE]."""
        created = int(time.time())
        request_id, ids, streams, n, k, model = run.request_id, run.ids, run.streams, run.n, run.k, run.model

        def chunk(choice: ChatChunkChoice | None, usage=None) -> str:
            body = ChatCompletionChunk(id=request_id, created=created, model=model,
                                       choices=[choice] if choice else [], usage=usage).model_dump()
            for ch in body["choices"]:
                ch["delta"] = {key: v for key, v in ch["delta"].items() if v is not None}
            if not include_usage:
                body.pop("usage")
            return sse(json_dumps(body))

        done: set[int] = set()
        parser = run.parser()  # text -> reasoning, content and tool calls

        def chunks_of(out) -> str:
            text = ""
            for c in completions_by_index(out, n):
                reason = c.finish_reason or ("abort" if out.finished else None)
                if c.index in done or (not c.text and not c.token_ids and reason is None):
                    continue
                if reason is not None:
                    done.add(c.index)
                for j, (fields, why) in enumerate(parser.deltas(c.index, c.text, reason)):
                    lp = self.logprobs(c, k, run.token_ids) if j == 0 else None
                    if why is None and lp is None and all(v is None for v in fields.values()):
                        continue  # nothing to say yet (a tag's first characters held back)
                    text += chunk(ChatChunkChoice(index=c.index, delta=DeltaMessage(**fields), logprobs=lp,
                                                  finish_reason=why))
            return text

        try:
            for i in range(n):
                yield chunk(ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant",
                                                                        content="" if parser.tools is None else None)))
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
