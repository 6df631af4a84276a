"""What the engine returns for each request."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence (a request with n > 1 has n of them)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    logprobs: list[dict[int, float]] | None = None  # one {token_id: logprob} per token
    stop_reason: int | str | None = None  # the stop string or token id that ended it


@dataclass(slots=True)
class RequestOutput:
    """State of one request after an engine step: cumulative, or only what is new since the
    request's previous output when the engine runs with `output_deltas` (the server does)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs: one entry per prompt token, None for the first, else
    # {token_id: logprob} holding the prompt's own token and the top k (on the final output,
    # or the first output that carries it with output_deltas)
    prompt_logprobs: list[dict[int, float] | None] | None = None


@dataclass(slots=True)
class EmbeddingOutput:
    """One prompt's embedding: float32 [D] (D: the hidden size, or the requested dimensions),
    L2-normalized unless the request turned that off."""

    embedding: Any  # numpy float32 [D]


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """The result of one embedding request (`LLM.embed`, `/v1/embeddings`): always finished."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (last-token pooling only)

    @property
    def embedding(self):
        return self.outputs.embedding
