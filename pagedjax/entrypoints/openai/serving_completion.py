"""/v1/completions: plain-text (or token-id) prompts, one engine request per prompt.

`echo` prepends the prompt to each choice's text (and, with `logprobs`, the prompt tokens'
log-probabilities to its logprobs, the first token's null, as OpenAI and vLLM do: the engine
is asked for prompt logprobs). `max_tokens: 0` with `echo` or `prompt_logprobs` scores the
prompt without generating (finish_reason "length"). `prompt_logprobs` (vLLM) adds a choice
field in vLLM's shape: null for the first prompt token, then {token id: {logprob, rank,
decoded_token}}. `use_beam_search` runs the engine's beam search: n beams, best first.
"""
from __future__ import annotations

import contextlib
import time
import uuid
from dataclasses import dataclass

from fastapi import Request

from pagedjax.outputs import CompletionOutput, RequestOutput
from pagedjax.engine.async_engine import EngineDeadError, ShuttingDownError
from pagedjax.entrypoints.openai.errors import APIError, bad_request
from pagedjax.entrypoints.openai.protocol import CompletionRequest
from pagedjax.entrypoints.openai.response_bodies import CompletionChoice, CompletionLogprobs, CompletionResponse
from pagedjax.entrypoints.openai.serving_common import ServingBase, completions_by_index, finite, top_logprobs
from pagedjax.entrypoints.openai.streaming import SSE_DONE, json_bytes, json_dumps, json_response, merge_streams, sse

MAX_PROMPTS = 1024  # prompts per request
MAX_PROMPT_LOGPROB_ENTRIES = 2_000_000  # prompt tokens x (alternatives + 1): bounds the memory one request holds


@dataclass(slots=True, frozen=True)
class _Shape:
    """What a completions response carries besides the text."""

    n: int  # choices per prompt
    k: int | None  # logprobs: top k per token (None: no logprobs)
    echo: list[str] | None  # each prompt's text, prepended to its choices (None: no echo)
    prompt_logprobs: int | None  # top k of the vLLM prompt_logprobs field (None: not asked for)
    engine_prompt_logprobs: int | None  # top k of the prompt logprobs the engine was asked for
    scoring: bool  # max_tokens == 0: the prompt is only scored
    model: str  # the model name the response gives: the base model's or the LoRA adapter's
    token_ids: bool = False  # return_tokens_as_token_ids: logprobs name tokens `token_id:N`


class CompletionServing(ServingBase):
    """Handler of /v1/completions."""

    async def create(self, req: CompletionRequest, request: Request):
        lora = self.check_common(req)
        if req.suffix:
            raise bad_request("`suffix` is not supported by this engine", "suffix")
        if req.best_of not in (None, req.n):
            raise bad_request("`best_of` is not supported by this engine (only best_of == n)", "best_of")
        if req.prompt_logprobs is not None and req.stream:
            raise bad_request("`prompt_logprobs` is not available when `stream` is true", "prompt_logprobs")
        explicit = "max_tokens" in req.model_fields_set
        if req.max_tokens == 0 and not (req.echo or req.prompt_logprobs is not None):
            raise bad_request("`max_tokens` must be at least 1 (0 only scores the prompt, with `echo` or "
                              "`prompt_logprobs`)", "max_tokens")
        if req.echo and self.tokenizer is None:
            raise bad_request("`echo` needs a tokenizer: this model has none", "echo")
        spec, spec_param = self.structured_outputs(req)
        prompts, texts = await self.run_cpu(self.prompt_ids, req.prompt, bool(req.echo), req.truncate_prompt_tokens)
        if spec is not None:
            await self.compile_structured_outputs(spec, spec_param)
        default = None if explicit else self.default_max_tokens(16)
        max_tokens = [self.resolve_max_tokens(req.max_tokens if explicit else None, default, len(ids), "max_tokens",
                                              "prompt") for ids in prompts]
        k = req.logprobs
        # the engine's prompt logprobs: what prompt_logprobs asks for, and the echo's logprobs
        engine_plp = req.prompt_logprobs
        if req.echo and k is not None:
            engine_plp = max(engine_plp or 0, k)
        if engine_plp is None and 0 in max_tokens:  # echo alone: still a scoring request for the engine
            engine_plp = 0
        if engine_plp is not None and sum(map(len, prompts)) * (engine_plp + 1) > MAX_PROMPT_LOGPROB_ENTRIES:
            raise bad_request(f"prompt log-probabilities for {sum(map(len, prompts))} prompt tokens with "
                              f"{engine_plp} alternatives each exceed this server's limit of "
                              f"{MAX_PROMPT_LOGPROB_ENTRIES} entries per request; send fewer or shorter prompts",
                              "prompt_logprobs" if req.prompt_logprobs is not None else "logprobs")
        if req.use_beam_search:
            params = [self.beam_search_params(req, m) for m in max_tokens]
        else:
            params = [self.sampling_params(req, m, k, engine_plp, spec) for m in max_tokens]
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await self.submit(request_id, prompts, params, req.cache_salt, request, lora)
        n = req.n or 1
        shape = _Shape(n, k, texts if req.echo else None, req.prompt_logprobs, engine_plp, req.max_tokens == 0,
                       lora.lora_name if lora is not None else self.served_model_name,
                       bool(req.return_tokens_as_token_ids))
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return self.event_stream(self.stream(request_id, prompts, streams, shape, include_usage), streams)
        finals = await self.collect(request, streams)
        # built and serialized on the worker thread: a big logprobs answer never stalls the loop
        return json_response(await self.run_cpu(self.response_body, request_id, prompts, streams, finals, shape))

    def response_body(self, request_id: str, prompts, streams, finals, shape: _Shape) -> bytes:
        choices = [self.choice(p, prompts[p], out, c, shape, 0)[0]
                   for p, out in enumerate(finals) for c in completions_by_index(out, shape.n)]
        body = CompletionResponse(id=request_id, model=shape.model, choices=choices,
                                  usage=self.usage(prompts, streams)).model_dump()
        if shape.prompt_logprobs is None:
            for ch in body["choices"]:
                del ch["prompt_logprobs"]
        return json_bytes(body)

    def choice(self, p: int, prompt: list[int], out: RequestOutput, c: CompletionOutput, shape: _Shape,
               offset: int, first: bool = True) -> tuple[CompletionChoice, int]:
        """Choice c of prompt p (or its next streamed piece; `first`: the first piece, which
        carries the echo) and the text offset after it."""
        reason = c.finish_reason or ("abort" if out.finished else None)
        if shape.scoring and out.prompt_logprobs is not None:
            reason = "length"  # nothing to generate: done once the prompt is scored
        text, lp = c.text, None
        if shape.k is not None:
            lp = CompletionLogprobs()
            if shape.echo is not None and first:
                entries = out.prompt_logprobs or [None] * len(prompt)
                offset = self.add_logprobs(lp, prompt, entries, shape.k, offset, shape.token_ids)
            offset = self.add_logprobs(lp, c.token_ids, c.logprobs or [{}] * len(c.token_ids), shape.k, offset,
                                       shape.token_ids)
        if shape.echo is not None and first:
            text = shape.echo[p] + text
        plp = None
        if shape.prompt_logprobs is not None and first:
            plp = self.prompt_logprobs_json(prompt, out.prompt_logprobs, shape.prompt_logprobs,
                                            shape.engine_prompt_logprobs)
        return CompletionChoice(index=p * shape.n + c.index, text=text, logprobs=lp, finish_reason=reason,
                                prompt_logprobs=plp), offset

    def prompt_logprobs_json(self, prompt: list[int], entries, k: int, engine_k: int) -> list:
        """vLLM's prompt_logprobs: None for the first token, then {token id: {logprob, rank,
        decoded_token}} with the top k and the prompt's own token. A rank is 1 + the number of
        more likely tokens; None for a prompt token outside the top engine_k the engine
        computed (it does not report how far down such a token is)."""
        entries = entries or [None] * len(prompt)
        out: list = []
        for pos, tid in enumerate(prompt):
            entry = entries[pos] if pos < len(entries) else None
            if entry is None:
                out.append(None)
                continue
            ranked = top_logprobs(entry, len(entry))
            item = {str(t): {"logprob": finite(v), "rank": i + 1, "decoded_token": self.decode_token(t)}
                    for i, (t, v) in enumerate(ranked[:k])}
            if str(tid) not in item and tid in entry:
                pos = next(i for i, (t, _) in enumerate(ranked) if t == tid)
                item[str(tid)] = {"logprob": finite(entry[tid]), "rank": pos + 1 if pos < engine_k else None,
                                  "decoded_token": self.decode_token(tid)}
            out.append(item)
        return out

    def prompt_ids(self, prompt, echo: bool = False, truncate: int | None = None
                   ) -> tuple[list[list[int]], list[str] | None]:
        """Token ids of each prompt (a string, strings, token ids or lists of token ids; with
        `truncate` (truncate_prompt_tokens) only their last that many), and with `echo` each
        prompt's text (token-id prompts and truncated ones decoded)."""
        if isinstance(prompt, str):
            prompt = [prompt]
        elif not prompt:
            raise bad_request("`prompt` must not be empty", "prompt")
        elif isinstance(prompt[0], int):
            prompt = [prompt]
        if len(prompt) > MAX_PROMPTS:
            raise bad_request(f"at most {MAX_PROMPTS} prompts per request", "prompt")
        out, texts = [], []
        for p in prompt:
            full = self.encode(p, "prompt") if isinstance(p, str) else list(p)
            ids = self.truncate(full, truncate)
            self.check_prompt_ids(ids, "prompt")
            out.append(ids)
            if echo:
                texts.append(p if isinstance(p, str) and len(ids) == len(full) else self.tokenizer.decode(ids))
        return out, (texts if echo else None)

    def add_logprobs(self, lp: CompletionLogprobs, token_ids: list[int], entries, k: int, offset: int,
                     as_token_ids: bool = False) -> int:
        """Append the logprobs of `token_ids` (entries[i]: {token id: logprob} of token i, None
        where there is none: the first prompt token) to lp; returns the text offset after them
        (of the text, also when as_token_ids names the tokens `token_id:N`)."""
        for pos, tid in enumerate(token_ids):
            entry = entries[pos] if pos < len(entries) else {}
            token = self.decode_token(tid)
            lp.tokens.append(self.token_text(tid, as_token_ids))
            if entry is None:
                lp.token_logprobs.append(None)
                lp.top_logprobs.append(None)
            else:
                lp.token_logprobs.append(finite(entry[tid]) if tid in entry else None)
                lp.top_logprobs.append({self.token_text(t, as_token_ids): finite(v) for t, v in top_logprobs(entry, k)})
            lp.text_offset.append(offset)
            offset += len(token)
        return offset

    async def stream(self, request_id: str, prompts: list[list[int]], streams, shape: _Shape, include_usage: bool):
        """SSE chunks: text deltas per choice (the first with the echo), a finish_reason per
        choice, usage, [DONE]."""
        created = int(time.time())
        n, k = shape.n, shape.k
        offsets: dict[int, int] = {}  # choice index -> text offset of its next token (logprobs)
        done: set[int] = set()

        def chunk(choices, usage=None) -> str:
            body = CompletionResponse(id=request_id, created=created, model=shape.model,
                                      choices=choices, usage=usage).model_dump()
            for ch in body["choices"]:
                del ch["prompt_logprobs"]  # not streamed (a 400 asks for it)
            if not include_usage:
                body.pop("usage")
            return sse(json_dumps(body))

        def chunks_of(p: int, out) -> str:
            text = ""
            for c in completions_by_index(out, n):
                index = p * n + c.index
                reason = c.finish_reason or ("abort" if out.finished else None)
                first = index not in offsets
                if index in done or (not c.text and not c.token_ids and reason is None
                                     and not (first and shape.echo is not None)):
                    continue
                ch, offsets[index] = self.choice(p, prompts[p], out, c, shape, offsets.get(index, 0), first)
                if ch.finish_reason is not None:
                    done.add(index)
                text += chunk([ch])
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
