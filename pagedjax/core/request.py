"""A request's state as the scheduler and the engine see it."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pagedjax.sampling_params import SamplingParams


PLACEHOLDER = -1  # an output token the device has sampled but the host has not read yet (async scheduling)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    """One sequence being generated. `num_computed_tokens` catches up to `num_tokens`:
    the same rule covers prefill, chunked prefill, prefix-cache hits and decode."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the request's sampling key is fold_in(key(seed), step index)
    eos_token_ids: tuple[int, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    # sliding-window models: leading entries of block_ids returned to the pool (outside every
    # layer's window, see core/sched/window.py); their ids stay so block_ids[i] is logical block i
    num_released_blocks: int = 0
    block_hashes: list[bytes] = field(default_factory=list)  # keys (hash_block) of its leading full blocks cached
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    num_shared_kv_tokens: int = 0  # positions below this already hold KV (a fork's inherited prompt)
    pending_forks: list["Request"] = field(default_factory=list)  # n > 1: siblings forked after prefill
    reserved_seats: int = 0  # running slots held for sequences this request will fork later
    num_passed: int = 0  # later requests admitted before it while it did not fit (bounded: no starvation)
    cache_salt: str | None = None  # isolates this request's prefix-cache entries
    lora_adapter: object = None  # the LoRA adapter it runs with (its host copy, models.lora), None: the base model
    lora_slot: int = 0  # the device slot of its adapter while it runs (LoRAManager.admit), 0: none
    # an embedding request's PoolingParams (pagedjax.pooling; its pooling_type resolved): the
    # prompt is prefilled and pooled, nothing is generated; None: a generation request
    pooling: object = None
    # prompt logprobs from this prompt index on (scoring a completion); the prefix before it
    # may come from the prefix cache
    prompt_logprobs_from: int = 0
    draft_token_ids: list[int] = field(default_factory=list)  # speculative guesses of the next tokens
    num_drafted: int = 0  # draft tokens verified so far, and accepted (its acceptance estimate)
    num_accepted_drafts: int = 0
    beam_group: object = None  # the BeamGroup this request is a beam of, if any
    dp_rank: int = 0  # the data-parallel rank whose block pool and scheduler hold this request
    # async scheduling: the row of the step in flight that samples its last output token (a
    # PLACEHOLDER on the host until that step is read back), -1: none pending
    pending_row: int = -1
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("the prompt is empty: give at least one token")

    @property
    def lora_key(self) -> str | None:
        """Its adapter's content fingerprint (part of its prefix-cache keys), None: no adapter."""
        return None if self.lora_adapter is None else self.lora_adapter.fingerprint

    @property
    def held_block_ids(self) -> list[int]:
        """The blocks it holds a reference to (all of block_ids but the released ones)."""
        return self.block_ids[self.num_released_blocks:]

    @property
    def prefill_only(self) -> bool:
        """Nothing to generate: a scored prompt (max_tokens=0) or an embedding; it finishes
        once its prompt is computed."""
        return self.params.max_tokens == 0 or self.pooling is not None

    @property
    def needs_every_prompt_position(self) -> bool:
        """Every prompt position must be computed (no prefix-cache hits): prompt logprobs,
        or mean pooling over the prompt's hidden states."""
        return self.num_cacheable_tokens == 0

    @property
    def num_cacheable_tokens(self) -> int:
        """Leading tokens whose KV may come from the prefix cache (their positions need no
        output of their own): none for prompt logprobs from the start or mean pooling; with
        prompt logprobs from index i (a scored completion), the positions before i - 1."""
        if self.pooling is not None and self.pooling.pooling_type == "mean":
            return 0
        if self.params.prompt_logprobs is not None:
            return max(self.prompt_logprobs_from - 1, 0)
        return self.num_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end), without building the whole token list for a prompt range."""
        if end <= len(self.prompt_token_ids):
            return self.prompt_token_ids[start:end]
        return self.all_token_ids[start:end]

    def token_at(self, i: int) -> int:
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < p else self.output_token_ids[i - p]


def append_logprobs(req: Request, result, row: int, token: int) -> None:
    """The sampled token's logprob and the top k (row of the step's sampler output), for a
    request that asked for them."""
    if req.params.logprobs is not None:
        k = req.params.logprobs
        entry = {int(t): float(lp) for t, lp in zip(result.top_ids[row, :k], result.top_logprobs[row, :k])}
        entry[token] = float(result.logprobs[row])
        req.output_logprobs.append(entry)
