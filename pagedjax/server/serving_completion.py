"""/v1/completions: plain-text (or token-id) prompts, one engine request per prompt."""
from __future__ import annotations

import contextlib
import time
import uuid

from fastapi import Request

from pagedjax.outputs import CompletionOutput
from pagedjax.server.async_engine import EngineDeadError, ShuttingDownError
from pagedjax.server.errors import APIError, bad_request
from pagedjax.server.protocol import (CompletionChoice, CompletionLogprobs, CompletionRequest,
                                      CompletionResponse)
from pagedjax.server.serving_common import (SSE_DONE, ServingBase, completions_by_index, finite, json_bytes,
                                            json_dumps, json_response,
                                            merge_streams, sse, top_logprobs)

MAX_PROMPTS = 1024  # prompts per request


class CompletionServing(ServingBase):
    """Handler of /v1/completions."""

    async def create(self, req: CompletionRequest, request: Request):
        self.check_common(req)
        if req.echo:
            raise bad_request("`echo` is not supported by this engine", "echo")
        if req.suffix:
            raise bad_request("`suffix` is not supported by this engine", "suffix")
        if req.best_of not in (None, req.n):
            raise bad_request("`best_of` is not supported by this engine (only best_of == n)", "best_of")
        prompts = await self.run_cpu(self.prompt_ids, req.prompt)
        explicit = "max_tokens" in req.model_fields_set
        params = [self.sampling_params(
            req, self.resolve_max_tokens(req.max_tokens if explicit else None, None if explicit else 16,
                                         len(ids), "max_tokens", "prompt"), req.logprobs) for ids in prompts]
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await self.submit(request_id, prompts, params, req.cache_salt, request)
        n = req.n or 1
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return self.event_stream(self.stream(request_id, prompts, streams, n, req.logprobs, include_usage),
                                     streams)
        finals = await self.collect(request, streams)
        # built and serialized on the worker thread: a big logprobs answer never stalls the loop
        return json_response(await self.run_cpu(self.response_body, request_id, prompts, streams, finals, n,
                                                req.logprobs))

    def response_body(self, request_id: str, prompts, streams, finals, n: int, k: int | None) -> bytes:
        choices = [CompletionChoice(index=p * n + c.index, text=c.text, finish_reason=c.finish_reason or "abort",
                                    logprobs=self.logprobs(c, k, 0)[0])
                   for p, out in enumerate(finals) for c in completions_by_index(out, n)]
        return json_bytes(CompletionResponse(id=request_id, model=self.served_model_name, choices=choices,
                                             usage=self.usage(prompts, streams)).model_dump())

    def prompt_ids(self, prompt) -> list[list[int]]:
        """Token ids of each prompt (a string, strings, token ids or lists of token ids)."""
        if isinstance(prompt, str):
            prompt = [prompt]
        elif not prompt:
            raise bad_request("`prompt` must not be empty", "prompt")
        elif isinstance(prompt[0], int):
            prompt = [prompt]
        if len(prompt) > MAX_PROMPTS:
            raise bad_request(f"at most {MAX_PROMPTS} prompts per request", "prompt")
        out = []
        for p in prompt:
            ids = self.encode(p, "prompt") if isinstance(p, str) else list(p)
            self.check_prompt_ids(ids, "prompt")
            out.append(ids)
        return out

    def logprobs(self, c: CompletionOutput, k: int | None, offset: int) -> tuple[CompletionLogprobs | None, int]:
        """Logprobs of c's tokens, text offsets counted from `offset`."""
        if k is None:
            return None, offset
        lp = CompletionLogprobs()
        entries = c.logprobs or []
        for pos, tid in enumerate(c.token_ids):
            entry = entries[pos] if pos < len(entries) else {}
            token = self.decode_token(tid)
            lp.tokens.append(token)
            lp.token_logprobs.append(finite(entry[tid]) if tid in entry else None)
            lp.top_logprobs.append({self.decode_token(t): finite(v) for t, v in top_logprobs(entry, k)})
            lp.text_offset.append(offset)
            offset += len(token)
        return lp, offset

    async def stream(self, request_id: str, prompts: list[list[int]], streams, n: int, k: int | None,
                     include_usage: bool):
        """SSE chunks: text deltas per choice, a finish_reason per choice, usage, [DONE]."""
        created = int(time.time())
        offsets: dict[int, int] = {}  # choice index -> text offset of its next token (logprobs)
        done: set[int] = set()

        def chunk(choices, usage=None) -> str:
            body = CompletionResponse(id=request_id, created=created, model=self.served_model_name,
                                      choices=choices, usage=usage).model_dump()
            if not include_usage:
                body.pop("usage")
            return sse(json_dumps(body))

        def chunks_of(p: int, out) -> str:
            text = ""
            for c in completions_by_index(out, n):
                index = p * n + c.index
                reason = c.finish_reason or ("abort" if out.finished else None)
                if index in done or (not c.text and not c.token_ids and reason is None):
                    continue
                lp, offsets[index] = self.logprobs(c, k, offsets.get(index, 0))
                if reason is not None:
                    done.add(index)
                text += chunk([CompletionChoice(index=index, text=c.text, logprobs=lp, finish_reason=reason)])
            return text

        try:
            async with contextlib.aclosing(merge_streams(streams)) as merged:
                async for p, out in merged:
                    # logprobs can make a chunk large: build those off the event loop
                    text = chunks_of(p, out) if k is None else await self.run_cpu(chunks_of, p, out)
                    if text:
                        yield text
            if include_usage:
                yield chunk([], self.usage(prompts, streams))
        except (EngineDeadError, ShuttingDownError) as exc:
            yield sse(json_dumps(APIError(str(exc), 503, "service_unavailable_error").body()))
        yield SSE_DONE
