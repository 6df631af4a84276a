"""Plain-jnp paged attention: the semantic definition every backend is tested against.

Layout shared by every backend:
  q            [S, Q, H, D]        queries of S sequences, Q query slots each (Q = 1 for decode)
  k_pages      [Hkv, NB, BS, D]    key pages (NB blocks of BS tokens), one array per layer
  v_pages      [Hkv, NB, BS, D]    value pages
  block_tables [S, MB] int32       logical block i of sequence s lives in page block_tables[s, i]
  kv_lens      [S] int32           tokens of sequence s already in the pages (new ones included)
  q_lens       [S] int32           valid query slots of sequence s (<= Q)

Query j of sequence s sits at absolute position p = kv_lens[s] - q_lens[s] + j and attends
causally to positions 0..p. Query slots j >= q_lens[s] and sequences with kv_lens[s] == 0
produce zeros. Query head h reads kv head h // (H // Hkv) (GQA / MQA / MHA).
Softmax runs in float32; the output has q's dtype.

Two static options (plain Python values, part of every backend's compiled configuration):
  sliding_window  int >= 1 or None: the query at p sees key t only if also p - t < window
                  (the last `window` positions, itself included; transformers' `kv_idx >
                  q_idx - sliding_window`, Mistral / Gemma 2-3 local layers). None: no window.
  soft_cap        float > 0 or None: a score s = scale * (q . k) becomes soft_cap *
                  tanh(s / soft_cap) before masking and softmax (Gemma 2). None: off.
A query that sees no key outputs zeros. Backends that walk pages start, per sequence (or
query tile), at the first page holding a key inside the window of its earliest query: pages
wholly before it are never read (they may hold another request's data, even NaN).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .kv_quant import load, scatter_pages

NEG_INF = float("-inf")
# the dots of the jnp paths, all on float32 operands: in float32 on every backend (GPU and TPU
# default precision rounds f32 inputs to TF32 / bf16 passes; XLA:CPU computes f32 either way)
F32_DOTS = jax.lax.Precision.HIGHEST


def query_positions(kv_lens: jax.Array, q_lens: jax.Array, num_q: int) -> jax.Array:
    """Absolute position of every query slot: [S, Q] int32."""
    return (kv_lens - q_lens)[:, None] + jnp.arange(num_q, dtype=jnp.int32)[None, :]


def window_start(pos, sliding_window):
    """First key position visible to a query at `pos` (0 without a window; may be < 0)."""
    if sliding_window is None:
        return jnp.zeros_like(pos)
    return pos - (sliding_window - 1)


def key_visible(t, pos, sliding_window):
    """Causal (and windowed) visibility of key positions t from query positions pos
    (broadcastable int arrays): t <= pos and, with a window, pos - t < window."""
    ok = t <= pos
    if sliding_window is not None:
        ok &= t > pos - sliding_window
    return ok


def cap_scores(scores, soft_cap):
    """Soft-capping of scaled scores: soft_cap * tanh(scores / soft_cap) (None: as they are)."""
    if soft_cap is None:
        return scores
    return soft_cap * jnp.tanh(scores / soft_cap)


def _fold_gqa(q: jax.Array, num_kv_heads: int) -> jax.Array:
    """[S, Q, H, D] -> [S, Hkv, G, Q, D] (query heads grouped under their kv head)."""
    s, nq, h, d = q.shape
    return q.reshape(s, nq, num_kv_heads, h // num_kv_heads, d).transpose(0, 2, 3, 1, 4)


def _unfold_gqa(o: jax.Array) -> jax.Array:
    """[S, Hkv, G, Q, D] -> [S, Q, H, D]."""
    s, hkv, g, nq, d = o.shape
    return o.transpose(0, 3, 1, 2, 4).reshape(s, nq, hkv * g, d)


def paged_attention_reference(q, k_pages, v_pages, block_tables, kv_lens, q_lens, *, scale,
                              sliding_window=None, soft_cap=None):
    """Gathers every page of every sequence and runs masked softmax attention at once."""
    s, nq, h, d = q.shape
    hkv, _, bs, _ = k_pages.shape
    mb = block_tables.shape[1]
    take = lambda pages: pages[:, block_tables].reshape(hkv, s, mb * bs, pages.shape[-1])
    k, v = load(k_pages, take), load(v_pages, take)  # [Hkv, S, T, D] float32
    qg = _fold_gqa(q, hkv).astype(jnp.float32)  # [S, Hkv, G, Q, D]
    scores = jnp.einsum("skgqd,kstd->skgqt", qg, k.astype(jnp.float32), precision=F32_DOTS) * scale
    scores = cap_scores(scores, soft_cap)
    qpos = query_positions(kv_lens, q_lens, nq)  # [S, Q]
    t = jnp.arange(mb * bs, dtype=jnp.int32)
    valid = key_visible(t[None, None, :], qpos[:, :, None], sliding_window)
    valid &= t[None, None, :] < kv_lens[:, None, None]
    valid &= (jnp.arange(nq)[None, :] < q_lens[:, None])[:, :, None]  # [S, Q, T]
    scores = jnp.where(valid[:, None, None], scores, NEG_INF)
    m = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.exp(scores - jnp.where(jnp.isfinite(m), m, 0.0))
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("skgqt,kstd->skgqd", p, v.astype(jnp.float32), precision=F32_DOTS)
    out = jnp.where(denom > 0, out / jnp.where(denom > 0, denom, 1.0), 0.0)
    return _unfold_gqa(out).astype(q.dtype)


def online_softmax_update(m, l, acc, scores, values):
    """One flash-attention step over a chunk of keys.

    m, l: [..., Q] running max and sum; acc: [..., Q, D]; scores: [..., Q, T] (masked
    entries -inf); values: broadcastable to [..., T, D]. Returns the updated (m, l, acc).
    """
    m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    alpha = jnp.exp(m - m_safe)
    p = jnp.exp(scores - m_safe[..., None])
    l_new = alpha * l + jnp.sum(p, axis=-1)
    acc_new = alpha[..., None] * acc + jnp.einsum("...qt,...td->...qd", p, values, precision=F32_DOTS)
    return m_new, l_new, acc_new


def run_online_softmax(num_chunks, body, shape, dtype):
    """Runs `body(i, (m, l, acc))` for i < num_chunks from an empty softmax state of
    `shape` = (S, Hkv, G, Q, D); returns the normalised output [S, Q, H, D] in `dtype`
    (rows that saw no key are zeros)."""
    m0 = jnp.full(shape[:-1], NEG_INF, jnp.float32)
    l0 = jnp.zeros(shape[:-1], jnp.float32)
    acc0 = jnp.zeros(shape, jnp.float32)
    _, l, acc = jax.lax.fori_loop(0, num_chunks, body, (m0, l0, acc0))
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    return _unfold_gqa(out).astype(dtype)


def first_window_page(kv_lens, q_lens, page_size, sliding_window):
    """[S] int32: the first page holding a key inside the window of each sequence's earliest
    query (0 without a window)."""
    if sliding_window is None:
        return jnp.zeros_like(kv_lens)
    return jnp.maximum(kv_lens - q_lens - (sliding_window - 1), 0) // page_size


def paged_attention_chunked(q, k_pages, v_pages, block_tables, kv_lens, q_lens, *, scale,
                            sliding_window=None, soft_cap=None, blocks_per_chunk: int = 8):
    """Same result as `paged_attention_reference`, visiting only the pages in use.

    A while-loop walks the block table `blocks_per_chunk` pages at a time with an online
    softmax; its trip count is cdiv(max(kv_lens), chunk tokens), so cost follows the longest
    live sequence, not the table width, and shapes stay static (one compile per bucket).
    With a sliding window each sequence's walk starts at its first page inside the window of
    its earliest query (the trip count: the most tokens any sequence has from there on).
    """
    s, nq, h, d = q.shape
    hkv, _, bs, _ = k_pages.shape
    mb = block_tables.shape[1]
    c = min(blocks_per_chunk, mb)
    pad = (-mb) % c
    tables = jnp.pad(block_tables, ((0, 0), (0, pad)))
    chunk_tokens = c * bs
    qg = _fold_gqa(q, hkv).astype(jnp.float32) * scale  # [S, Hkv, G, Q, D]
    qpos = query_positions(kv_lens, q_lens, nq)  # [S, Q]
    q_valid = jnp.arange(nq)[None, :] < q_lens[:, None]  # [S, Q]
    g = h // hkv
    if sliding_window is None:
        num_chunks = (jnp.max(kv_lens) + chunk_tokens - 1) // chunk_tokens
    else:  # every sequence from its own first page in the window
        first = first_window_page(kv_lens, q_lens, bs, sliding_window)  # [S]
        num_chunks = (jnp.max(kv_lens - first * bs) + chunk_tokens - 1) // chunk_tokens
        width = tables.shape[1]
        tables = jnp.pad(tables, ((0, 0), (0, c)))  # a chunk may run past the table: masked

    def body(i, carry):
        m, l, acc = carry
        if sliding_window is None:
            ids = jax.lax.dynamic_slice_in_dim(tables, i * c, c, axis=1)  # [S, C]
            t = (i * chunk_tokens + jnp.arange(chunk_tokens, dtype=jnp.int32))[None, :]  # [1, C]
        else:
            cols = jnp.minimum(first[:, None] + i * c + jnp.arange(c, dtype=jnp.int32)[None, :], width)  # [S, C]
            ids = jnp.take_along_axis(tables, cols, axis=1)
            t = (first[:, None] * bs + i * chunk_tokens) + jnp.arange(chunk_tokens, dtype=jnp.int32)[None, :]
        take = lambda pages: pages[:, ids].reshape(hkv, s, chunk_tokens, pages.shape[-1])
        k, v = load(k_pages, take), load(v_pages, take)  # [Hkv, S, C, D] float32
        scores = cap_scores(jnp.einsum("skgqd,kstd->skgqt", qg, k, precision=F32_DOTS), soft_cap)
        t = t[:, None, :]  # [S or 1, 1, C]
        valid = key_visible(t, qpos[:, :, None], sliding_window) & (t < kv_lens[:, None, None])
        valid &= q_valid[:, :, None]
        scores = jnp.where(valid[:, None, None], scores, NEG_INF)
        if sliding_window is not None:  # rows past a sequence's keys (padding pages) never reach P @ V
            v = jnp.where((t[:, 0] < kv_lens[:, None])[None, :, :, None], v, 0.0)
        vals = v.transpose(1, 0, 2, 3)[:, :, None]  # [S, Hkv, 1, T, D]
        return online_softmax_update(m, l, acc, scores, vals)

    return run_online_softmax(num_chunks, body, (s, hkv, g, nq, d), q.dtype)


def write_kv(k_pages, v_pages, k, v, slot_mapping):
    """Scatter new keys/values into their slots.

    k, v: [T, Hkv, D]; slot_mapping: [T] int32, slot = block * BS + offset, -1 for padding
    tokens (dropped). Returns the updated (k_pages, v_pages).
    """
    hkv, nb, bs, _ = k_pages.shape
    num_slots = nb * bs
    slots = jnp.where(slot_mapping < 0, num_slots, slot_mapping)  # out of range -> dropped

    def scatter(pages, new):  # pages [Hkv, NB, BS, W], new [T, Hkv, W]
        flat = pages.reshape(hkv, num_slots, pages.shape[-1])
        flat = flat.at[:, slots].set(new.transpose(1, 0, 2), mode="drop")
        return flat.reshape(pages.shape)

    return scatter_pages(k_pages, scatter, k), scatter_pages(v_pages, scatter, v)
