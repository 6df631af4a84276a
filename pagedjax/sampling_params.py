"""Per-request sampling settings."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # top-k log-probabilities the step always computes; requests may ask up to this
MAX_INT32 = 2**31 - 1  # top_k, max_tokens and token ids travel to the device as int32
MIN_TEMPERATURE = 1e-2  # smaller positive temperatures are raised to it (logits / t overflows below)
MAX_STOP_STRINGS = 64  # each is matched against every new token's text
MAX_STOP_LENGTH = 256  # characters per stop string
MAX_STOP_TOKEN_IDS = 1024


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request's output (greedy when temperature == 0)."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    n: int = 1
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    stop_strings: tuple[str, ...] = field(init=False, repr=False, default=())

    def __post_init__(self) -> None:
        """Checks every field against what the engine can represent: a request that passes
        can never make a step fail."""
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_INT32:
            raise ValueError(f"max_tokens must be an integer in [1, {MAX_INT32}], got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k == -1:
            self.top_k = 0
        if not _is_int(self.top_k) or not 0 <= self.top_k <= MAX_INT32:
            raise ValueError(f"top_k must be 0 (off), -1 (off) or an integer in [1, {MAX_INT32}], got {self.top_k!r}")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer between 0 and {MAX_LOGPROBS}, got {self.logprobs!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        stops = tuple(self.stop or ())
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        if any(len(s) > MAX_STOP_LENGTH for s in stops):
            raise ValueError(f"stop strings may be at most {MAX_STOP_LENGTH} characters long")
        self.stop_strings = stops
        self.stop_token_ids = list(self.stop_token_ids or [])
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, got {len(self.stop_token_ids)}")
        if any(not _is_int(t) or not 0 <= t <= MAX_INT32 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be integers in [0, {MAX_INT32}]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)
