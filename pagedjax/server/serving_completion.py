"""/v1/completions: plain-text (or token-id) prompts, one engine request per prompt."""
from __future__ import annotations

import contextlib
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from pagedjax.outputs import CompletionOutput, RequestOutput
from pagedjax.server.async_engine import EngineDeadError, ShuttingDownError
from pagedjax.server.errors import APIError, bad_request
from pagedjax.server.protocol import (CompletionChoice, CompletionLogprobs, CompletionRequest,
                                      CompletionResponse)
from pagedjax.server.serving_common import (SSE_DONE, ServingBase, abort_all, completions_by_index, finite,
                                            json_dumps, merge_streams, sse, top_logprobs)


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
        prompts = self.prompt_ids(req.prompt)
        explicit = "max_tokens" in req.model_fields_set
        params = [self.sampling_params(
            req, self.resolve_max_tokens(req.max_tokens if explicit else None, None if explicit else 16,
                                         len(ids), "max_tokens", "prompt"), req.logprobs) for ids in prompts]
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await self.submit(request_id, prompts, params)
        n = req.n or 1
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(self.stream(request_id, prompts, streams, n, req.logprobs, include_usage),
                                     media_type="text/event-stream", background=BackgroundTask(abort_all, streams))
        finals = await self.collect(request, streams)
        choices = [CompletionChoice(index=p * n + c.index, text=c.text, finish_reason=c.finish_reason or "abort",
                                    logprobs=self.logprobs(c, 0, req.logprobs, 0)[0])
                   for p, out in enumerate(finals) for c in completions_by_index(out, n)]
        resp = CompletionResponse(id=request_id, model=self.served_model_name, choices=choices,
                                  usage=self.usage(prompts, finals))
        return JSONResponse(resp.model_dump())

    def prompt_ids(self, prompt) -> list[list[int]]:
        """Token ids of each prompt (a string, strings, token ids or lists of token ids)."""
        if isinstance(prompt, str):
            prompt = [prompt]
        elif not prompt:
            raise bad_request("`prompt` must not be empty", "prompt")
        elif isinstance(prompt[0], int):
            prompt = [prompt]
        if len(prompt) > 1024:
            raise bad_request("at most 1024 prompts per request", "prompt")
        out = []
        for p in prompt:
            ids = self.encode(p, "prompt") if isinstance(p, str) else list(p)
            self.check_prompt_ids(ids, "prompt")
            out.append(ids)
        return out

    def logprobs(self, c: CompletionOutput, start: int, k: int | None,
                 offset: int) -> tuple[CompletionLogprobs | None, int]:
        """Logprobs of c's tokens from `start` on, text offsets counted from `offset`."""
        if k is None:
            return None, offset
        lp = CompletionLogprobs()
        entries = c.logprobs or []
        for pos in range(start, len(c.token_ids)):
            tid = c.token_ids[pos]
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
        sent: dict[int, list[int]] = {}  # choice index -> [chars sent, tokens sent, text offset, done]
        finals: list[RequestOutput | None] = [None] * len(streams)

        def chunk(choices, usage=None) -> str:
            body = CompletionResponse(id=request_id, created=created, model=self.served_model_name,
                                      choices=choices, usage=usage).model_dump()
            if not include_usage:
                body.pop("usage")
            return sse(json_dumps(body))

        try:
            async with contextlib.aclosing(merge_streams(streams)) as merged:
                async for p, out in merged:
                    finals[p] = out
                    for c in completions_by_index(out, n):
                        index = p * n + c.index
                        state = sent.setdefault(index, [0, 0, 0, 0])
                        if state[3]:
                            continue
                        reason = c.finish_reason or ("abort" if out.finished else None)
                        text = c.text[state[0]:]
                        if not text and len(c.token_ids) == state[1] and reason is None:
                            continue
                        lp, state[2] = self.logprobs(c, state[1], k, state[2])
                        state[0], state[1], state[3] = len(c.text), len(c.token_ids), reason is not None
                        yield chunk([CompletionChoice(index=index, text=text, logprobs=lp, finish_reason=reason)])
            if include_usage:
                yield chunk([], self.usage(prompts, finals))
        except (EngineDeadError, ShuttingDownError) as exc:
            yield sse(json_dumps(APIError(str(exc), 503, "service_unavailable_error").body()))
        finally:
            abort_all(streams)
        yield SSE_DONE

