"""Pydantic models of the OpenAI requests and responses the server speaks.

Requests are strict (no silent type coercion) and forbid unknown fields, so a field the
engine does not understand is a 400 that names it instead of being dropped. Every number is
bounded to what the engine represents, and every list stops at its first bad element
(`fail_fast`), so a huge malformed array costs one error, not one per element.
"""
from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedjax.sampling_params import (MAX_INT32, MAX_LOGPROBS, MAX_STOP_LENGTH, MAX_STOP_STRINGS,
                                      MAX_STOP_TOKEN_IDS)

MAX_N = 64  # completions per prompt
MAX_SEED = 2**63 - 1
MAX_SALT_LENGTH = 256

TokenId = Annotated[int, Field(ge=0, le=MAX_INT32)]
TokenIds = Annotated[list[TokenId], Field(fail_fast=True)]
StopString = Annotated[str, Field(max_length=MAX_STOP_LENGTH)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool | None = False


class _SamplingRequest(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int | None = Field(1, ge=1, le=MAX_N)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS, fail_fast=True)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    user: str | None = None
    logit_bias: Any = None  # accepted only when empty
    # extra (non-OpenAI) sampling fields
    top_k: int | None = Field(None, ge=-1, le=MAX_INT32)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    ignore_eos: bool | None = False
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS, fail_fast=True)] | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_SALT_LENGTH)  # keeps tenants' prefixes apart


class CompletionRequest(_SamplingRequest):
    prompt: str | Annotated[list[str], Field(fail_fast=True)] | TokenIds | Annotated[list[TokenIds], Field(fail_fast=True)]
    max_tokens: int | None = Field(16, ge=1, le=MAX_INT32)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False  # accepted only when false
    suffix: str | None = None  # accepted only when empty
    best_of: int | None = None  # accepted only when equal to n


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[TextPart], Field(fail_fast=True)]
    name: str | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1, fail_fast=True)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: Any = None  # accepted only as {"type": "text"}
    tools: Any = None  # accepted only when empty
    tool_choice: Any = None  # accepted only as "none"


# ---- responses ------------------------------------------------------------------------


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedjax"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
