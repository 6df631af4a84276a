"""On-device sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds.

A request's key is fold_in(key(seed), step index), so its samples do not depend on which
other requests share the batch. Log-probabilities are the raw model ones (log_softmax of
the logits before temperature and filtering).
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from pagedjax.sampling_params import MAX_LOGPROBS


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingInputs:
    """Per-row sampling settings, all [S]."""

    temperature: jax.Array  # float32, 0 = greedy
    top_k: jax.Array  # int32, 0 = off
    top_p: jax.Array  # float32
    min_p: jax.Array  # float32
    seed: jax.Array  # uint32
    step: jax.Array  # int32, index of the token being sampled within its request
    want_logprobs: jax.Array  # bool, the request asked for log-probabilities


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplerOutput:
    tokens: jax.Array  # [S] int32
    logprobs: jax.Array  # [S] float32, logprob of the sampled token
    top_ids: jax.Array  # [S, K] int32
    top_logprobs: jax.Array  # [S, K] float32


def _filtered_logits(logits, p: SamplingInputs):
    """Temperature, then top-k, top-p and min-p masks (-inf outside). logits [S, V] f32."""
    v = logits.shape[-1]
    temp = jnp.where(p.temperature > 0, p.temperature, 1.0)
    x = logits / temp[:, None]
    desc = -jnp.sort(-x, axis=-1)  # [S, V]
    k = jnp.where(p.top_k > 0, jnp.minimum(p.top_k, v), v)
    desc = jnp.where(jnp.arange(v)[None, :] < k[:, None], desc, -jnp.inf)
    probs = jax.nn.softmax(desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability mass ranked above each token
    keep = (before < p.top_p[:, None]) & (probs >= p.min_p[:, None] * probs[:, :1])
    keep = keep.at[:, 0].set(True)
    threshold = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1)  # smallest kept logit
    return jnp.where(x >= threshold[:, None], x, -jnp.inf)


def sample(logits, p: SamplingInputs) -> SamplerOutput:
    """logits [S, V] float32 -> sampled tokens and log-probabilities."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw():
        x = _filtered_logits(logits, p)
        keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(p.seed, p.step)
        drawn = jax.vmap(jax.random.categorical)(keys, x).astype(jnp.int32)
        return jnp.where(p.temperature > 0, drawn, greedy)

    tokens = jax.lax.cond(jnp.any(p.temperature > 0), draw, lambda: greedy)
    k = min(MAX_LOGPROBS, logits.shape[-1])

    def with_logprobs():
        logprobs = jax.nn.log_softmax(logits, axis=-1)
        top_lp, top_ids = jax.lax.top_k(logprobs, k)
        chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
        return chosen, top_ids.astype(jnp.int32), top_lp

    def without():
        s = logits.shape[0]
        return jnp.zeros(s, jnp.float32), jnp.zeros((s, k), jnp.int32), jnp.zeros((s, k), jnp.float32)

    chosen, top_ids, top_lp = jax.lax.cond(jnp.any(p.want_logprobs), with_logprobs, without)
    return SamplerOutput(tokens, chosen, top_ids, top_lp)
