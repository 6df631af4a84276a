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

import collections
import heapq
import statistics
from dataclasses import dataclass
from typing import Callable

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

MAX_SPECULATIVE_TOKENS = 16
COST_SAMPLES = 9  # recent wall times a MeasuredCosts keeps per size
MAX_SAMPLE_AGE = 128  # measurements (of any size) after which a MeasuredCosts forgets a sample


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config`: prompt lookup, {"method": "ngram", "num_speculative_tokens":
    k, "prompt_lookup_min": a, "prompt_lookup_max": b}, or a draft model, {"model": path,
    "num_speculative_tokens": k} (method "draft_model"; see draft_model.py). A draft model
    proposes up to k drafts a step, fewer or none while it costs more than its accepted
    drafts save (`draft_depth`); "adaptive": False makes it always propose k."""

    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    method: str = "ngram"
    model: str | None = None  # the draft model (method "draft_model")
    adaptive: bool = True  # draft model: the number of drafts follows their measured worth

    @classmethod
    def parse(cls, config) -> "SpeculativeConfig | None":
        """From a dict (or None: no speculation), with clear errors."""
        if config is None or isinstance(config, SpeculativeConfig):
            return config
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(config).__name__}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model", "adaptive"}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; this engine knows {sorted(known)}")
        method = config.get("method", "draft_model" if config.get("model") is not None else "ngram")
        if method not in ("ngram", "prompt_lookup", "draft_model"):
            raise ValueError(f"speculative_config: method {method!r} is not supported; use 'ngram' (prompt lookup) "
                             "or 'draft_model' (with 'model')")
        if "num_speculative_tokens" not in config:
            raise ValueError("speculative_config needs num_speculative_tokens")
        k = config["num_speculative_tokens"]
        _check_positive("num_speculative_tokens", k)
        if k > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config: num_speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS}")
        if method == "draft_model":
            model = config.get("model")
            if not isinstance(model, str) or not model:
                raise ValueError("speculative_config: method 'draft_model' needs 'model', the draft checkpoint's path")
            lookup = sorted({"prompt_lookup_min", "prompt_lookup_max"} & set(config))
            if lookup:
                raise ValueError(f"speculative_config: {lookup} apply to method 'ngram', not to a draft model")
            adaptive = config.get("adaptive", True)
            if not isinstance(adaptive, bool):
                raise ValueError(f"speculative_config: adaptive must be true or false, got {adaptive!r}")
            return cls(k, method="draft_model", model=model, adaptive=adaptive)
        if config.get("model") is not None:
            raise ValueError(f"speculative_config: 'model' (a draft model) does not go with method {method!r}")
        if "adaptive" in config:
            raise ValueError("speculative_config: 'adaptive' applies to a draft model (prompt lookup costs "
                             "nothing to propose; its verification is weighed each step anyway)")
        lo = config.get("prompt_lookup_min", min(2, config.get("prompt_lookup_max", 4)))
        hi = config.get("prompt_lookup_max", max(4, lo))
        _check_positive("prompt_lookup_min", lo)
        _check_positive("prompt_lookup_max", hi)
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) exceeds prompt_lookup_max ({hi})")
        return cls(k, lo, hi, "ngram")


def _check_positive(name: str, v) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"speculative_config: {name} must be a positive integer, got {v!r}")


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


def allocate_drafts(caps: list[int], rates: list[float], base_tokens: int, rungs: list[int], max_tokens: int,
                    max_drafts: int, cost) -> list[int]:
    """How many drafts each decoding request verifies this step.

    caps [n]: drafts each request has (within its limits); rates [n]: its estimated chance
    that a draft is accepted; base_tokens: the step's tokens without drafts; rungs: the step
    sizes; cost(T): the expected time of a step of T tokens. Drafts are ranked best first:
    the j-th draft of a request is used with probability rate^j, so the next draft always
    goes to the request whose next one is most likely to be used. Each rung from the one the
    step needs anyway up to max_tokens is then filled with the best drafts that fit, and the
    rung with the most expected tokens per unit of step time wins (every rung is weighed:
    step costs need not rise smoothly, a bigger rung can pay where the next one up does not)."""
    alloc = [0] * len(caps)
    first = next((r for r in rungs if r >= base_tokens), None)
    if first is None or not any(caps):
        return alloc
    # the drafts best first, as far as the largest rung (or max_drafts) allows: request ids
    room = min(max_drafts, max([r for r in rungs if r <= max_tokens] + [first]) - base_tokens)
    heap = [(-rates[i], i, 1) for i in range(len(caps)) if caps[i] > 0]  # (-value of its j-th draft, i, j)
    heapq.heapify(heap)
    order, values = [], [float(len(caps))]  # values[j]: expected decode tokens with the best j drafts
    while heap and len(order) < room:
        neg, i, j = heapq.heappop(heap)
        order.append(i)
        values.append(values[-1] - neg)
        if j < caps[i]:
            heapq.heappush(heap, (neg * rates[i], i, j + 1))
    best_j, best_rate = 0, -1.0
    for rung in (r for r in rungs if first <= r <= max_tokens):
        j = min(len(order), rung - base_tokens)
        rate = values[j] / cost(rung)
        if rate > best_rate * (1 + 1e-9):
            best_j, best_rate = j, rate
        if j == len(order):  # every draft fits: bigger rungs only cost more
            break
    for i in order[:best_j]:
        alloc[i] += 1
    return alloc


def acceptance_estimate(num_accepted: int, num_drafted: int) -> float:
    """A request's chance that its next draft is accepted: its record so far, from a prior of 1/2."""
    return (num_accepted + 1) / (num_drafted + 2)


class MeasuredCosts:
    """Wall seconds by size (a step's T, a draft model's depth): the median of a size's last
    COST_SAMPLES measurements (a median: one run slowed by a neighbour, or a first run, must not
    make a size look expensive for long), forgotten once MAX_SAMPLE_AGE measurements of any size
    have come since. A size that a slow minute made look expensive is one that the allocation
    then avoids, so it would never be measured again; forgotten, it is priced as an unmeasured
    size again and so tried again. An unmeasured size costs what the nearest measured one does,
    an optimistic guess, so it is tried once and then known; `unmeasured(size)` when nothing is
    measured yet."""

    def __init__(self, unmeasured: Callable[[int], float]):
        self._unmeasured = unmeasured
        self._count = 0  # measurements so far, of any size
        self._samples: dict[int, collections.deque] = {}  # size -> (measurement number, seconds)
        self._median: dict[int, float] = {}

    def add(self, size: int, seconds: float) -> None:
        self._count += 1
        self._samples.setdefault(size, collections.deque(maxlen=COST_SAMPLES)).append((self._count, seconds))
        oldest = self._count - MAX_SAMPLE_AGE  # samples numbered up to this are forgotten
        for s, samples in list(self._samples.items()):
            changed = s == size
            while samples and samples[0][0] <= oldest:
                samples.popleft()
                changed = True
            if not samples:
                del self._samples[s], self._median[s]
            elif changed:
                self._median[s] = statistics.median(x for _, x in samples)

    def __call__(self, size: int) -> float:
        if size in self._median:
            return self._median[size]
        if not self._median:
            return self._unmeasured(size)
        return self._median[min(self._median, key=lambda m: abs(m - size))]

    def as_dict(self) -> dict[int, float]:
        return dict(sorted(self._median.items()))


def draft_depth(rates: list[float], k: int, target_cost: Callable[[int], float],
                draft_cost: Callable[[int], float], rows: int | None = None,
                max_drafts: int | None = None) -> int:
    """How many drafts (0..k) a draft model proposes for the decoding requests of a step.

    rates [n]: each request's estimated chance that a draft is accepted; target_cost(T): the
    expected time of a target step of T tokens; draft_cost(j): of proposing j drafts (one
    draft-model step per draft, for all requests at once). With j drafts a request emits
    1 + a + ... + a^j tokens on average (draft m counts only if those before it were
    accepted; the bonus or redraw always comes), from a step of rows (1 + j) tokens (rows:
    the decoding requests of the largest data-parallel rank, default n); depths whose
    rows * j drafts exceed max_drafts (what a step can verify) are not tried. The depth with
    the most expected tokens per second wins, 0 (no drafting) when the draft model costs more
    than its accepted drafts save."""
    n = len(rates)
    if n == 0:
        return 0
    rows = n if rows is None else rows
    cost = lambda seconds: max(seconds, 1e-12)  # an unmeasured cost may read 0
    best, best_rate = 0, n / cost(target_cost(rows))
    for j in range(1, k + 1):
        if max_drafts is not None and rows * j > max_drafts:
            break
        tokens = sum(j + 1 if a >= 1 else (1 - a ** (j + 1)) / (1 - a) for a in rates)
        rate = tokens / cost(target_cost(rows * (j + 1)) + draft_cost(j))
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = j, rate
    return best
