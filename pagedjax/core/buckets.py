"""The fixed, enumerable set of step shapes the jitted step is compiled for.

A step is one packed token axis: the tokens of every scheduled request (a decode token, a
prompt chunk, or several verification tokens) laid end to end, padded to T tokens from one
short ladder, with S = min(T, max_num_seqs) sequence slots (a step never has more
sequences than tokens). One compiled shape per rung, whatever mix of decode and prompt work
a step carries; after warm-up serving compiles nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

MIN_TOKENS = 8
_HALF_STEPS_UP_TO = 128  # below this the ladder also has the 1.5x rungs (48, 96): decode batches


def token_ladder(max_tokens: int, min_tokens: int = MIN_TOKENS) -> list[int]:
    """8, 16, 32, 48, 64, 96, 128, 256, ... up to max_tokens (itself included); from
    min_tokens (a power of two) on."""
    out, v = [], min_tokens
    while v < max_tokens:
        out.append(v)
        if v >= 32 and v < _HALF_STEPS_UP_TO and v * 3 // 2 < max_tokens:
            out.append(v * 3 // 2)
        v *= 2
    out.append(max_tokens)
    return out


@dataclass(frozen=True)
class Buckets:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_draft_tokens: int = 0  # speculative decoding: draft tokens a step may verify
    min_tokens: int = MIN_TOKENS  # the smallest rung

    def __post_init__(self) -> None:
        if self.min_tokens < 1 or self.min_tokens & (self.min_tokens - 1):
            raise ValueError(f"min_tokens must be a power of two, got {self.min_tokens}")
        if self.max_num_batched_tokens < self.min_tokens:
            raise ValueError(f"max_num_batched_tokens must be at least {self.min_tokens}, got {self.max_num_batched_tokens}")

    def token_buckets(self) -> list[int]:
        """Every step size T, smallest first."""
        return token_ladder(self.max_num_batched_tokens, self.min_tokens)

    def token_bucket(self, num_tokens: int) -> int:
        """The smallest rung holding num_tokens tokens."""
        for t in self.token_buckets():
            if t >= num_tokens:
                return t
        raise ValueError(f"a step of {num_tokens} tokens exceeds max_num_batched_tokens={self.max_num_batched_tokens}")

    def num_seqs(self, num_tokens: int) -> int:
        """Sequence slots S of the step of T = num_tokens tokens."""
        return min(num_tokens, self.max_num_seqs)

    def num_rows(self, num_tokens: int) -> int:
        """Sampled rows of the step of T = num_tokens tokens: one per sequence, plus one per
        draft token being verified (never more than the tokens)."""
        return min(num_tokens, self.num_seqs(num_tokens) + self.max_draft_tokens)

    def all_shapes(self) -> list[tuple[int, int]]:
        """(T, S) of every compiled step."""
        return [(t, self.num_seqs(t)) for t in self.token_buckets()]
