"""Speculative decoding with prompt lookup (n-gram) proposals.

A request's next tokens are guessed from its own prompt and output: the latest n-gram (n
from prompt_lookup_max down to prompt_lookup_min) is searched for at an earlier position, the
most recent match wins, and the k tokens that followed it there are the drafts. The step
verifies them as extra query tokens of the request (one packed step, KV read through the
block table); the sampler accepts draft j with the target model's probability of it given
the tokens before (greedy: when it is the argmax) and, at the first rejection, samples from
the target distribution without the draft, which keeps the output distribution exactly the
target model's. Accepted drafts plus one more token come out of a step.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` for prompt lookup: {"method": "ngram",
    "num_speculative_tokens": k, "prompt_lookup_min": a, "prompt_lookup_max": b}."""

    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    method: str = "ngram"

    @classmethod
    def parse(cls, config) -> "SpeculativeConfig | None":
        """From a dict (or None: no speculation), with clear errors."""
        if config is None or isinstance(config, SpeculativeConfig):
            return config
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(config).__name__}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; this engine knows {sorted(known)}")
        method = config.get("method", "ngram")
        if method not in ("ngram", "prompt_lookup"):
            raise ValueError(f"speculative_config: method {method!r} is not supported; use 'ngram' (prompt lookup)")
        if "num_speculative_tokens" not in config:
            raise ValueError("speculative_config needs num_speculative_tokens")
        k = config["num_speculative_tokens"]
        lo = config.get("prompt_lookup_min", min(2, config.get("prompt_lookup_max", 4)))
        hi = config.get("prompt_lookup_max", max(4, lo))
        for name, v in (("num_speculative_tokens", k), ("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config: {name} must be a positive integer, got {v!r}")
        if k > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config: num_speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS}")
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) exceeds prompt_lookup_max ({hi})")
        return cls(k, lo, hi, "ngram")


def propose(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Drafts for the tokens that follow `tokens` [L] int: the k tokens after the most recent
    earlier occurrence of its last n tokens, for the largest n in [n_min, n_max] that occurs
    (fewer than k when the match is near the end; [] when nothing matches)."""
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        windows = sliding_window_view(tokens[:length - 1], n)  # [L - n, n]: every earlier n-gram
        hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n  # the token after the most recent match
            return tokens[start:start + k].tolist()
    return []


def allocate_drafts(caps: list[int], rates: list[float], base_tokens: int, rungs: list[int], max_tokens: int,
                    max_drafts: int, cost) -> list[int]:
    """How many drafts each decoding request verifies this step.

    caps [n]: drafts each request has (within its limits); rates [n]: its estimated chance
    that a draft is accepted; base_tokens: the step's tokens without drafts; rungs: the step
    sizes; cost(T): the expected time of a step of T tokens. Drafts first fill the padding of
    the step's rung (free), each next one going to the request whose next draft is most
    likely to be used (the j-th draft of a request is used with probability rate^j); then the
    step moves up a rung only while the expected tokens per unit of step time rise."""
    alloc = [0] * len(caps)
    gain = [r for r in rates]  # value of each request's next draft: rate ** (alloc + 1)
    t = next((r for r in rungs if r >= base_tokens), None)
    if t is None or not any(caps):
        return alloc

    def add(limit: int) -> float:
        """Adds up to `limit` drafts, best first; returns their expected value."""
        value = 0.0
        for _ in range(limit):
            best = max((i for i in range(len(caps)) if alloc[i] < caps[i]), key=lambda i: gain[i], default=None)
            if best is None or sum(alloc) >= max_drafts:
                break
            value += gain[best]
            alloc[best] += 1
            gain[best] *= rates[best]
        return value

    value = len(caps) + add(t - base_tokens)  # expected decode tokens out of this step
    for up in (r for r in rungs if t < r <= max_tokens):
        saved = list(alloc), list(gain)
        more = add(up - t)
        if more <= 0 or (value + more) / cost(up) <= value / cost(t):
            alloc[:], gain[:] = saved
            break
        value, t = value + more, up
    return alloc
