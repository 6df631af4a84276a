"""What /v1/completions and /v1/chat/completions share: request checks, prompt limits,
SamplingParams, submission to the AsyncEngine and the worker thread for CPU-heavy work (stream
merging, disconnect handling and the event-stream response with a send timeout: streaming.py).

Streams carry deltas (see `AsyncEngine`): a streaming handler turns each into a chunk, a
non-streaming one merges them into the final outputs.
"""
from __future__ import annotations

import asyncio
import contextlib
import math
import re
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache, partial
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagedjax.core.beam_search import BeamSearchParams
from pagedjax.outputs import CompletionOutput, RequestOutput
from pagedjax.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams, context_length_message
from pagedjax.engine.async_engine import AsyncEngine
from pagedjax.lora.request import LoRARequest
from pagedjax.engine.request_stream import (EngineDeadError, QueueFullError, RequestStream, ShuttingDownError,
                                            merge_delta)
from pagedjax.entrypoints.openai.errors import APIError, bad_request
from pagedjax.entrypoints.openai.protocol import _SamplingRequest
from pagedjax.entrypoints.openai.response_bodies import UsageInfo
from pagedjax.entrypoints.openai.streaming import SSEResponse, merge_streams, wait_for_disconnect

MAX_BEAMS = MAX_LOGPROBS // 2  # BeamSearchParams' bound on beam_width


class ClientDisconnected(Exception):
    """The client went away before the response was ready."""


def finite(x: float) -> float:
    """JSON cannot carry inf/nan: clamp log-probabilities to a large finite value."""
    x = float(x)
    if math.isfinite(x):
        return x
    return 0.0 if x > 0 else -9999.0


class ServingBase:
    """State and helpers shared by the two generation endpoints."""

    def __init__(self, engine: AsyncEngine, served_model_name: str, tokenizer: Any,
                 cpu: ThreadPoolExecutor | None = None, send_timeout: float = 30.0) -> None:
        self.engine = engine
        # one worker thread for tokenizing, templating and building big responses, so the
        # event loop keeps serving other streams and /health meanwhile (one thread: the
        # tokenizer is never used concurrently)
        self.cpu = cpu or ThreadPoolExecutor(1, thread_name_prefix="pagedjax-cpu")
        self.send_timeout = send_timeout
        self.served_model_name = served_model_name
        self.tokenizer = tokenizer
        self.max_model_len = engine.max_model_len
        model_config = getattr(engine.engine, "model_config", None)
        self.vocab_size = (getattr(model_config, "vocab_size", None) or getattr(engine.engine, "vocab_size", None)
                           or (len(tokenizer) if tokenizer is not None else 2**31))
        decode = (lambda tid: tokenizer.decode([tid])) if tokenizer is not None else token_id_text
        self.decode_token = lru_cache(maxsize=65536)(decode)
        # what a request that leaves them unset samples with: the model's generation_config.json
        # (LLMEngine.sampling_defaults, --generation-config), else OpenAI's defaults
        self.sampling_defaults: dict = dict(getattr(engine.engine, "sampling_defaults", None) or {})

    def token_text(self, tid: int, as_token_ids: bool = False) -> str:
        """A token as logprobs show it: its text, or `token_id:N` (return_tokens_as_token_ids)."""
        return token_id_text(tid) if as_token_ids else self.decode_token(tid)

    async def run_cpu(self, fn: Callable, *args, **kwargs):
        """fn(*args, **kwargs) on the CPU worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self.cpu, partial(fn, *args, **kwargs))

    def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer: give the prompt as token ids", param)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    # ---- checks ---------------------------------------------------------------------------

    def lora_of(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter the request's `model` names (None: the base model, also when
        `model` is omitted); 404 for a name this server does not serve."""
        if model is None or model == self.served_model_name:
            return None
        lora = self.engine.loras.get(model)
        if lora is None:
            adapters = "".join(f", `{name}`" for name in self.engine.loras)
            raise APIError(f"The model `{model}` does not exist. This server serves `{self.served_model_name}`"
                           f"{adapters}.", 404, "not_found_error", "model", "model_not_found")
        return lora

    def check_common(self, req: _SamplingRequest) -> LoRARequest | None:
        """Model name, token ids within the vocabulary, option combinations; returns the LoRA
        adapter the model name picks (None: the base model)."""
        lora = self.lora_of(req.model)
        if req.stream_options is not None and not req.stream:
            raise bad_request("`stream_options` is only allowed when `stream` is true", "stream_options")
        bad = next((t for t in (req.logit_bias or {}) if int(t) >= self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"`logit_bias`: token id {bad} is out of range [0, {self.vocab_size})", "logit_bias")
        bad = next((t for t in (req.allowed_token_ids or ()) if t >= self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"`allowed_token_ids`: token id {bad} is out of range [0, {self.vocab_size})",
                              "allowed_token_ids")
        self.check_truncation(req.truncate_prompt_tokens)
        if req.bad_words and self.tokenizer is None:
            raise bad_request("`bad_words` need a tokenizer: this model has none", "bad_words")
        if req.use_beam_search:
            if lora is not None:  # the engine's beam search runs the base model only
                raise bad_request("`use_beam_search` is not supported with a LoRA adapter", "use_beam_search")
            self.check_beam_search(req)
        return lora

    def check_truncation(self, k: int | None) -> None:
        """truncate_prompt_tokens: None, -1 (max_model_len) or 1 .. max_model_len, else a 400."""
        if k is not None and not (k == -1 or 1 <= k <= self.max_model_len):
            raise bad_request(f"`truncate_prompt_tokens` must be -1 (keep the last max_model_len tokens) or in [1, "
                              f"{self.max_model_len}] (this model's maximum context length), got {k}",
                              "truncate_prompt_tokens")

    def truncate(self, ids: list[int], k: int | None) -> list[int]:
        """The prompt's last k token ids (truncate_prompt_tokens, checked by check_common)."""
        if k is None:
            return ids
        return ids[-(self.max_model_len if k == -1 else k):]

    def default_max_tokens(self, request_default: int | None = None) -> int | None:
        """max_tokens of a request that leaves it unset: the smaller of the endpoint's own
        default and the model's generation config (max_new_tokens); None: all the room left."""
        given = [v for v in (request_default, self.sampling_defaults.get("max_tokens")) if v is not None]
        return min(given) if given else None

    def check_beam_search(self, req: _SamplingRequest) -> None:
        """Beam search is deterministic and keeps no per-token logprobs: what would change its
        result or shape and is not supported with it is a 400 (temperature, top_p, top_k,
        min_p and seed do not apply and are ignored, as vLLM does)."""
        if (req.n or 1) > MAX_BEAMS:
            raise bad_request(f"with `use_beam_search`, `n` is the number of beams: at most {MAX_BEAMS}", "n")
        defaults = {"stream": (None, False), "logprobs": (None, False), "top_logprobs": None, "prompt_logprobs": None,
                    "stop": (None, []), "stop_token_ids": (None, []), "presence_penalty": (None, 0),
                    "frequency_penalty": (None, 0), "repetition_penalty": (None, 1), "logit_bias": (None, {}),
                    "min_tokens": (None, 0), "bad_words": (None, []), "allowed_token_ids": None,
                    "cache_salt": None, "structured_outputs": None, "guided_json": None, "guided_regex": None,
                    "guided_choice": None, "guided_grammar": None}
        for name, ok in defaults.items():
            value = getattr(req, name, None)
            if value not in (ok if isinstance(ok, tuple) else (ok,)):
                raise bad_request(f"`{name}` is not supported with `use_beam_search`", name)
        rf = req.response_format
        if rf is not None and rf.type != "text":
            raise bad_request("`response_format` is not supported with `use_beam_search`", "response_format")
        if getattr(req, "max_tokens", None) == 0:
            raise bad_request("`max_tokens` must be at least 1 with `use_beam_search`", "max_tokens")

    def check_prompt_ids(self, ids: list[int], param: str) -> None:
        if not ids:
            raise bad_request("the prompt is empty", param)
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is out of range [0, {self.vocab_size})", param)

    def resolve_max_tokens(self, requested: int | None, default: int | None, num_prompt: int,
                           param: str, prompt_param: str) -> int:
        """Tokens to generate: `requested`, else `default`, else all the room left; 400 when
        the prompt (plus an explicit request) does not fit in max_model_len."""
        room = self.max_model_len - num_prompt
        if room < 1:
            raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens. However, "
                              f"your prompt is {num_prompt} tokens, which leaves no room for a completion.",
                              prompt_param, "context_length_exceeded")
        if requested is None:
            return room if default is None else min(default, room)
        if requested > room:
            raise bad_request(context_length_message(self.max_model_len, num_prompt, requested, param), param,
                              "context_length_exceeded")
        return requested

    def sampling_params(self, req: _SamplingRequest, max_tokens: int, logprobs: int | None,
                        prompt_logprobs: int | None = None,
                        structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        d = self.sampling_defaults

        def given(value, name: str, openai_default):
            return value if value is not None else d.get(name, openai_default)

        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=given(req.temperature, "temperature", 1.0), top_p=given(req.top_p, "top_p", 1.0),
                top_k=given(req.top_k, "top_k", 0), min_p=given(req.min_p, "min_p", 0.0), n=req.n or 1,
                seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=bool(req.ignore_eos),
                include_stop_str_in_output=bool(req.include_stop_str_in_output),
                logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=given(req.repetition_penalty, "repetition_penalty", 1.0),
                logit_bias=req.logit_bias or None, min_tokens=req.min_tokens or 0,
                bad_words=req.bad_words or None, allowed_token_ids=req.allowed_token_ids,
                structured_outputs=structured_outputs)
        except ValueError as exc:
            raise bad_request(str(exc), self._param_of(req, str(exc))) from None

    def beam_search_params(self, req: _SamplingRequest, max_tokens: int) -> BeamSearchParams:
        try:
            return BeamSearchParams(beam_width=req.n or 1, max_tokens=max_tokens,
                                    length_penalty=1.0 if req.length_penalty is None else req.length_penalty,
                                    early_stopping=False if req.early_stopping is None else req.early_stopping,
                                    ignore_eos=bool(req.ignore_eos))
        except ValueError as exc:
            raise bad_request(str(exc), self._param_of(req, str(exc))) from None

    @staticmethod
    def _param_of(req: _SamplingRequest, message: str) -> str | None:
        """The request field an engine-side check names first (its messages start with it)."""
        name = re.match(r"[a-z_]*", message).group()
        name = {"beam_width": "n"}.get(name, name)
        return name if name in type(req).model_fields else None

    # ---- structured outputs ---------------------------------------------------------------

    @staticmethod
    def structured_outputs(req: _SamplingRequest) -> tuple[StructuredOutputsParams | None, str | None]:
        """The output constraint the request asks for (response_format, structured_outputs or
        the older guided_* fields: at most one of them) and the field that asked for it."""
        given: list[tuple[str, dict]] = []
        rf = req.response_format
        if rf is not None and rf.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            schema = rf.json_schema.schema_
            given.append(("response_format", {"json_object": True} if schema is None else {"json": schema}))
        so = req.structured_outputs
        if so is not None:
            fields = {"json": so.json_, "json_object": so.json_object or None, "regex": so.regex,
                      "choice": so.choice, "grammar": so.grammar}
            given.append(("structured_outputs", {k: v for k, v in fields.items() if v is not None}))
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(req, f"guided_{name}")
            if value is not None:
                given.append((f"guided_{name}", {name: value}))
        if not given:
            return None, None
        if len(given) > 1:
            names = ", ".join(f"`{n}`" for n, _ in given)
            raise bad_request(f"give at most one output constraint; got {names}", given[1][0])
        param, fields = given[0]
        try:
            return StructuredOutputsParams(**fields), param
        except ValueError as exc:
            raise bad_request(f"invalid `{param}`: {exc}", param) from None

    async def compile_structured_outputs(self, spec: StructuredOutputsParams, param: str) -> None:
        """Compile the constraint once on the worker thread (the engine caches it), so an
        invalid schema, regex or grammar is a 400 that says what is wrong."""
        def compile_() -> bool:
            # the engine builds its compiler at first use (slow): never on the event loop
            compiler = getattr(self.engine.engine, "grammar_compiler", None)
            if compiler is None:
                return False
            compiler.compile(spec)
            return True

        try:
            if not await self.run_cpu(compile_):
                raise bad_request("structured outputs need a tokenizer: this model has none", param)
        except ValueError as exc:  # StructuredOutputError
            raise bad_request(f"invalid `{param}`: {exc}", param) from None

    # ---- running --------------------------------------------------------------------------

    async def submit(self, request_id: str, prompts: list[list[int]],
                     params: list[SamplingParams] | list[BeamSearchParams],
                     cache_salt: str | None = None, request: Request | None = None,
                     lora_request: LoRARequest | None = None) -> list[RequestStream]:
        """Add one engine request (or beam search) per prompt, with `lora_request`'s adapter if
        given; on any failure abort the ones already added."""
        limit = self.engine.max_pending_requests
        num_seqs = sum(p.beam_width if isinstance(p, BeamSearchParams) else p.n for p in params)
        if num_seqs > limit:
            raise bad_request(f"this request asks for {num_seqs} sequences (prompts x n), more than the "
                              f"{limit} this server queues at once; split it")
        if request is not None and await request.is_disconnected():
            raise ClientDisconnected()  # it waited for the worker thread and left: do not start it

        def add(i: int):
            ids, p = prompts[i], params[i]
            if isinstance(p, BeamSearchParams):
                return self.engine.add_beam_search(f"{request_id}-{i}", ids, p)
            return self.engine.add_request(f"{request_id}-{i}", ids, p, cache_salt, lora_request)

        return await self.add_streams(len(prompts), add)

    async def add_streams(self, n: int, add: Callable, param: str | None = None) -> list[RequestStream]:
        """The streams of `await add(i)` for i < n (each adds one engine request), or none: on
        any failure the ones already added are aborted and the error answered (400: the
        request is invalid; 429: the queue is full; 503: shutting down or the engine died)."""
        streams: list[RequestStream] = []
        try:
            for i in range(n):
                streams.append(await add(i))
        except BaseException as exc:
            for s in streams:
                s.abort()
            if isinstance(exc, ValueError):
                raise bad_request(str(exc), param) from None
            if isinstance(exc, QueueFullError):
                raise APIError(str(exc), 429, "rate_limit_error", None, "queue_full",
                               headers={"Retry-After": "1"}) from None
            if isinstance(exc, (ShuttingDownError, EngineDeadError)):
                raise APIError(str(exc), 503, "service_unavailable_error", None, "unavailable") from None
            raise
        return streams

    async def collect(self, request: Request, streams: list[RequestStream]) -> list[RequestOutput]:
        """Wait for every stream's end and return each one's whole output (its deltas
        merged); abort all if the client disconnects."""
        finals: list[RequestOutput | None] = [None] * len(streams)

        async def consume() -> None:
            async with contextlib.aclosing(merge_streams(streams)) as merged:
                async for i, out in merged:
                    if finals[i] is None:
                        finals[i] = out
                    else:
                        merge_delta(finals[i], out)

        consumer = asyncio.ensure_future(consume())
        watcher = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not consumer.done():
                raise ClientDisconnected()
            try:
                consumer.result()
            except (EngineDeadError, ShuttingDownError) as exc:
                raise APIError(str(exc), 503, "service_unavailable_error", None, "unavailable") from None
            return finals  # type: ignore[return-value]
        finally:
            consumer.cancel()
            watcher.cancel()
            for s in streams:
                s.abort()

    @staticmethod
    def usage(prompts: list[list[int]], streams: list[RequestStream]) -> UsageInfo:
        p = sum(len(ids) for ids in prompts)
        c = sum(n for s in streams for n in s.num_tokens.values())
        return UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)

    def event_stream(self, chunks: AsyncIterator[str], streams: list[RequestStream]) -> StreamingResponse:
        """The streaming response of `streams`, its chunks from `chunks`."""
        return SSEResponse(chunks, self.send_timeout, streams)


def token_id_text(tid: int) -> str:
    """vLLM's spelling of a token by its id (return_tokens_as_token_ids; models without a
    tokenizer)."""
    return f"token_id:{tid}"


def top_logprobs(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The k most likely (token id, logprob) pairs of one position."""
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k] if k else []


def completions_by_index(out: RequestOutput, n: int) -> list[CompletionOutput]:
    """The n completions of a request in index order; missing ones (a request aborted
    before any output) are empty with finish_reason "abort"."""
    by_index = {o.index: o for o in out.outputs}
    return [by_index.get(i) or CompletionOutput(i, "", [], "abort" if out.finished else None)
            for i in range(n)]
