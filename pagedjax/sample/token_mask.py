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


MAX_BAD_WORD_TOKENS = 16384  # tokens of all of a request's bad words together


class MaskRules:
    """A request's token rules, built once and shared by its n sequences: allowed ids,
    bad words (indexed by the tokens that must precede each banned one), min_tokens bans."""

    def __init__(self, params: SamplingParams, vocab_size: int, stop_ids: tuple[int, ...], tokenizer=None):
        """stop_ids: EOS ids, masked with params.stop_token_ids until min_tokens are out, and
        the fallback when a row would allow nothing."""
        self.vocab_size = vocab_size
        self.min_tokens = params.min_tokens
        self.min_token_bans = tuple(stop_ids) + tuple(params.stop_token_ids)
        self.fallback = _bits(stop_ids, vocab_size) if stop_ids else None
        self.allowed = None if params.allowed_token_ids is None else _bits(params.allowed_token_ids, vocab_size)
        # head length -> {head tokens: banned last tokens}; a one-token word has the empty head
        self.bad_words: dict[int, dict[tuple[int, ...], list[int]]] = {}
        for seq in (_tokenize_bad_words(params.bad_words, tokenizer) if params.bad_words else []):
            self.bad_words.setdefault(len(seq) - 1, {}).setdefault(seq[:-1], []).append(seq[-1])

    def banned_by_bad_words(self, out: list[int]) -> list[int]:
        """Last tokens of the bad words whose other tokens end the output: one dict lookup per
        distinct bad-word length."""
        banned = []
        for n, heads in self.bad_words.items():
            if n <= len(out):
                banned += heads.get(tuple(out[len(out) - n:]), ())
        return banned


def mask_needed(req) -> bool:
    """Whether req's next token is constrained now (min_tokens only until they are out)."""
    p = req.params
    return (p.structured_outputs is not None or p.allowed_token_ids is not None or p.bad_words is not None
            or len(req.output_token_ids) < p.min_tokens)


class TokenMask:
    """One sequence's constraints on its next token: the request's rules and its own grammar."""

    def __init__(self, rules: MaskRules, matcher=None):
        """matcher: a GrammarMatcher (structured outputs) or None."""
        self.rules = rules
        self.matcher = matcher

    def fill(self, row: np.ndarray, output_token_ids: list[int]) -> None:
        """Writes the allowed-next-token bitmask into `row` [W] int32 (initially all ones).
        A row that would allow nothing allows EOS (the sequence ends rather than emitting a
        token its rules forbid)."""
        r = self.rules
        if self.matcher is not None:
            self.matcher.fill_bitmask(row)
        if r.allowed is not None:
            row &= r.allowed
        if len(output_token_ids) < r.min_tokens:
            _clear(row, r.min_token_bans)
        if r.bad_words:
            _clear(row, r.banned_by_bad_words(output_token_ids))
        if r.fallback is not None and not row.any():
            row |= r.fallback

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
    seqs, total = set(), 0
    for w in words:
        for text in (w, " " + w.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            total += len(ids)
            if ids:
                seqs.add(ids)
    if total > MAX_BAD_WORD_TOKENS:
        raise ValueError(f"bad_words are {total} tokens long together; at most {MAX_BAD_WORD_TOKENS} are allowed")
    return sorted(seqs)
