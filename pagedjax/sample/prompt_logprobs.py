"""Prompt log-probabilities: the model's log-probability of each prompt token given the
tokens before it, computed from the hidden states of the step that ran the prompt chunk.

`prompt_next [T]` holds the token that follows each position (-1 where nobody asked). Only
when the host sees some position ask does it run `compute`, an executable of its own beside
the step (a `lax.cond` inside the step would make XLA:GPU wait for the device at every step
to read its predicate); it computes logits in chunks of positions (so the [T, V] logits never
exist at once), skipping chunks nobody asked about (except on GPUs, see select_cond). A
request asking for them reads no prefix cache, so every prompt position passes through a step.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.sample import select_cond
from pagedjax.sampling_params import MAX_LOGPROBS

CHUNK = 128  # positions per logits chunk


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PromptLogprobs:
    logprobs: jax.Array  # [T] float32: log p(prompt_next[i] | tokens up to i)
    top_ids: jax.Array  # [T, K] int32
    top_logprobs: jax.Array  # [T, K] float32


def compute(logits_fn, hidden, prompt_next, dp: int = 1) -> PromptLogprobs:
    """hidden [dp * T, E], prompt_next [dp * T] int32 -> PromptLogprobs of every position
    (zeros where no position of its chunk asks). logits_fn: [..., E] -> float32 [..., V]."""
    n, e = hidden.shape
    t = n // dp
    c = next(c for c in (CHUNK, 64, 32, 16, 8, 4, 2, 1) if t % c == 0)

    k = min(MAX_LOGPROBS, jax.eval_shape(logits_fn, hidden[:1]).shape[-1])

    def chunk(args):
        h, nxt = args  # [dp, c, E], [dp, c]

        def compute():
            lp = jax.nn.log_softmax(logits_fn(h), axis=-1)  # [dp, c, V]
            top_lp, top_ids = jax.lax.top_k(lp, k)
            chosen = jnp.take_along_axis(lp, jnp.maximum(nxt, 0)[..., None], axis=-1)[..., 0]
            return chosen, top_ids.astype(jnp.int32), top_lp

        skip = lambda: (jnp.zeros(nxt.shape, jnp.float32), jnp.zeros((*nxt.shape, k), jnp.int32),
                        jnp.zeros((*nxt.shape, k), jnp.float32))
        # chunks nobody asked about cost nothing (on GPUs, where a conditional makes the host
        # wait, every chunk is computed: select_cond)
        return select_cond.cond(jnp.any(nxt >= 0), compute, skip)

    h = hidden.reshape(dp, t // c, c, e).transpose(1, 0, 2, 3)  # [chunks, dp, c, E]
    nxt = prompt_next.reshape(dp, t // c, c).transpose(1, 0, 2)
    chosen, ids, lps = jax.lax.map(chunk, (h, nxt))  # [chunks, dp, c, ...]
    back = lambda x: x.swapaxes(0, 1).reshape(n, *x.shape[3:])
    return PromptLogprobs(back(chosen), back(ids), back(lps))


def entries(plp, offset: int, positions: range, prompt_ids: list[int], k: int,
            first: int = 0) -> list[tuple[int, dict[int, float]]]:
    """(prompt index, {token: logprob}) for the prompt tokens that follow `positions`, read
    from host PromptLogprobs rows starting at `offset` (the chunk's first token in the step);
    none below prompt index `first` (nobody asked: next_tokens' `first`)."""
    out = []
    for j, pos in enumerate(positions):
        if pos + 1 >= len(prompt_ids):
            break
        if pos + 1 < first:
            continue
        row = offset + j
        entry = {int(a): float(b) for a, b in zip(plp.top_ids[row, :k], plp.top_logprobs[row, :k])}
        entry[int(prompt_ids[pos + 1])] = float(plp.logprobs[row])
        out.append((pos + 1, entry))
    return out


def next_tokens(prompt_ids: list[int], start: int, q_len: int, first: int = 0) -> np.ndarray:
    """prompt_next of a chunk [start, start + q_len): the following prompt token, -1 past the
    prompt and where that token's index is below `first` (nobody asked for it)."""
    nxt = np.full(q_len, -1, np.int32)
    p = len(prompt_ids)
    lo, hi = max(start + 1, first), min(start + q_len + 1, p)
    if hi > lo:
        nxt[lo - start - 1:hi - start - 1] = prompt_ids[lo:hi]
    return nxt
