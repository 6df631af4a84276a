"""Speculative decoding with prompt lookup (n-gram) proposals.

A request's next tokens are guessed from its own prompt and output: the latest n-gram (n
from prompt_lookup_max down to prompt_lookup_min) is searched for at an earlier position, the
most recent match wins, and the k tokens that followed it there are the drafts (around its
period when the match repeats a token or phrase up to the end: `propose`). The step
verifies them as extra query tokens of the request (one packed step, KV read through the
block table); the sampler accepts draft j with the target model's probability of it given
the tokens before (greedy: when it is the argmax) and, at the first rejection, samples from
the target distribution without the draft, which keeps the output distribution exactly the
target model's. Accepted drafts plus one more token come out of a step.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose(tokens: np.ndarray, k: int, n_min: int, n_max: int, repeat_period: bool = True) -> list[int]:
    """Drafts for the tokens that follow `tokens` [L] int: the k tokens after the most recent
    earlier occurrence of its last n tokens, for the largest n in [n_min, n_max] that occurs
    ([] when nothing matches). A match whose continuation runs into the end, p = L - (match
    end) tokens back with p <= n, shows a whole period of p tokens said twice (a repeated
    token or phrase): the drafts go on around that period, where the most recent match alone
    would give only p of them. A shorter match at such a distance (n < p: part of a period,
    likelier by chance) gives the tokens up to the end only, as does repeat_period=False (the
    earlier rule, kept for comparison: scripts/ab_prompt_lookup.py)."""
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        windows = sliding_window_view(tokens[:length - 1], n)  # [L - n, n]: every earlier n-gram
        hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n  # the token after the most recent match
            if repeat_period and length - start <= n:  # a whole period, said twice
                return np.resize(tokens[start:], k).tolist()  # around the period, k drafts
            return tokens[start:start + k].tolist()
    return []
