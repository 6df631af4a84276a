"""Host-built masks of the tokens a sequence may sample next: allowed_token_ids, bad_words,
min_tokens and structured outputs (a grammar), folded into one bitmask row per sequence.

The sampler always takes a bitmask operand [S, W] int32 (W = cdiv(V, 32); bit j of word i
allows token 32 * i + j), all ones for unconstrained rows, so shapes never change. The engine
fills the rows of constrained sequences while the device runs the step's forward pass.
"""
from __future__ import annotations

import numpy as np

from pagedjax.sampling_params import SamplingParams


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def _bits(token_ids, vocab_size: int) -> np.ndarray:
    """A bitmask row [W] int32 with exactly `token_ids` set (ids outside the vocabulary dropped)."""
    bits = np.zeros(bitmask_words(vocab_size) * 32, bool)
    ids = np.asarray([t for t in token_ids if 0 <= t < vocab_size], np.int64)
    bits[ids] = True
    return _pack(bits)


def _pack(bits: np.ndarray) -> np.ndarray:
    """bool [W * 32] -> int32 [W], bit j of word i = bits[32 * i + j]."""
    words = bits.reshape(-1, 32).astype(np.uint64) << np.arange(32, dtype=np.uint64)
    return words.sum(axis=1).astype(np.uint32).view(np.int32)


def _clear(row: np.ndarray, token_ids) -> None:
    """Disallows `token_ids` in a bitmask row, in place."""
    u = row.view(np.uint32)
    for t in token_ids:
        if 0 <= t < len(row) * 32:
            u[t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)


class TokenMask:
    """One sequence's constraints on its next token."""

    def __init__(self, params: SamplingParams, vocab_size: int, stop_ids: tuple[int, ...], tokenizer=None,
                 matcher=None):
        """stop_ids: EOS ids, masked with params.stop_token_ids until min_tokens are out.
        matcher: a GrammarMatcher (structured outputs) or None."""
        self.vocab_size = vocab_size
        self.min_tokens = params.min_tokens
        self.min_token_bans = tuple(stop_ids) + tuple(params.stop_token_ids)
        self.allowed = None if params.allowed_token_ids is None else _bits(params.allowed_token_ids, vocab_size)
        self.bad_words = _tokenize_bad_words(params.bad_words, tokenizer) if params.bad_words else []
        self.matcher = matcher

    def fill(self, row: np.ndarray, output_token_ids: list[int]) -> None:
        """Writes the allowed-next-token bitmask into `row` [W] int32 (initially all ones)."""
        if self.matcher is not None:
            self.matcher.fill_bitmask(row)
        if self.allowed is not None:
            row &= self.allowed
        if len(output_token_ids) < self.min_tokens:
            _clear(row, self.min_token_bans)
        if self.bad_words:
            _clear(row, _banned_by_bad_words(self.bad_words, output_token_ids))

    def accept(self, token: int) -> bool:
        """Advances the grammar by the sampled token; False if the grammar refused it."""
        return self.matcher is None or self.matcher.accept(token)

    @property
    def terminated(self) -> bool:
        """The grammar admits nothing more."""
        return self.matcher is not None and self.matcher.is_terminated()


def _tokenize_bad_words(words: list[str], tokenizer) -> list[tuple[int, ...]]:
    """Each bad word as token ids, alone and after a space (as it appears mid-text), like vLLM."""
    if tokenizer is None:
        raise ValueError("bad_words need a tokenizer; this model has none")
    seqs = set()
    for w in words:
        for text in (w, " " + w.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids:
                seqs.add(ids)
    return sorted(seqs)


def _banned_by_bad_words(seqs: list[tuple[int, ...]], out: list[int]) -> list[int]:
    """Last tokens of the bad words whose other tokens end the output (single-token words: always)."""
    banned = []
    for s in seqs:
        head = s[:-1]
        if not head or (len(out) >= len(head) and tuple(out[len(out) - len(head):]) == head):
            banned.append(s[-1])
    return banned
