"""Packed (ragged) paged attention: every query token of a step on one token axis.

Layout:
  q            [T, H, D]          the query tokens of all sequences, laid end to end
  k_pages      [Hkv, NB, BS, D]   key pages, as in reference.py
  v_pages      [Hkv, NB, BS, D]
  block_tables [S, MB] int32      logical block i of sequence s lives in page block_tables[s, i]
  kv_lens      [S] int32          tokens of sequence s in the pages (this step's included)
  cu_q_lens    [S + 1] int32      sequence s owns query tokens [cu_q_lens[s], cu_q_lens[s + 1])

A sequence may own any number of tokens: 1 (decode), k + 1 (speculative verification) or a
prompt chunk; padding sequences own none (equal offsets) and tokens past cu_q_lens[S] belong
to no sequence. Query j of sequence s (q_len = cu_q_lens[s + 1] - cu_q_lens[s]) sits at
position kv_lens[s] - q_len + j and attends causally to keys 0..that position. Tokens no
sequence owns, and sequences with kv_lens == 0, produce zeros. Softmax in float32; the output
has q's dtype. sliding_window and soft_cap as in reference.py.

Backends that take the padded [S, Q] layout (the Pallas kernels, the XLA loops) run through
`to_rows` / `from_rows`: the tokens are cut into rows of at most `tile` query tokens, each
row a sequence of its own with its owner's block table and the kv length of its last query
(so rows attend exactly what their tokens do). With tile = 1 every token is a decode row.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .kv_quant import load
from .reference import F32_DOTS, NEG_INF, cap_scores, key_visible


def count_at_most(sorted_values: jax.Array, x: jax.Array) -> jax.Array:
    """[len(x)] int32: how many of sorted_values are <= each x (searchsorted, side "right"),
    as one compare-and-sum. jnp's default binary search is a while loop, which XLA:GPU drives
    from the host, several tiny kernels per iteration, in every layer of every step."""
    return jnp.searchsorted(sorted_values, x, side="right", method="compare_all").astype(jnp.int32)


def token_sequence_ids(cu_q_lens: jax.Array, num_tokens: int) -> jax.Array:
    """[T] int32: the sequence owning each token (S for tokens no sequence owns)."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    s = count_at_most(cu_q_lens, t) - 1  # last start <= t
    s = jnp.clip(s, 0, cu_q_lens.shape[0] - 2)
    owned = (t >= cu_q_lens[s]) & (t < cu_q_lens[s + 1])
    return jnp.where(owned, s, cu_q_lens.shape[0] - 1)


def packed_attention_reference(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, *, scale,
                               sliding_window=None, soft_cap=None):
    """Gathers every page of each token's sequence and runs masked softmax attention."""
    t, h, d = q.shape
    hkv, _, bs, _ = k_pages.shape
    s, mb = block_tables.shape
    seq = token_sequence_ids(cu_q_lens, t)  # [T]; s = none
    owned = seq < s
    seq_c = jnp.minimum(seq, s - 1)
    q_len = (cu_q_lens[1:] - cu_q_lens[:-1])[seq_c]
    pos = kv_lens[seq_c] - q_len + jnp.arange(t, dtype=jnp.int32) - cu_q_lens[seq_c]  # [T]
    tables = block_tables[seq_c]  # [T, MB]
    take = lambda pages: pages[:, tables].reshape(hkv, t, mb * bs, pages.shape[-1])
    k, v = load(k_pages, take), load(v_pages, take)  # [Hkv, T, K, D] float32
    qg = q.reshape(t, hkv, h // hkv, d).astype(jnp.float32)  # [T, Hkv, G, D]
    scores = cap_scores(jnp.einsum("tkgd,ktjd->tkgj", qg, k, precision=F32_DOTS) * scale, soft_cap)
    key = jnp.arange(mb * bs, dtype=jnp.int32)
    valid = key_visible(key[None, :], pos[:, None], sliding_window)
    valid &= (key[None, :] < kv_lens[seq_c][:, None]) & owned[:, None]
    scores = jnp.where(valid[:, None, None], scores, NEG_INF)
    m = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.exp(scores - jnp.where(jnp.isfinite(m), m, 0.0))
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("tkgj,ktjd->tkgd", p, v, precision=F32_DOTS)
    out = jnp.where(denom > 0, out / jnp.where(denom > 0, denom, 1.0), 0.0)
    return out.reshape(t, h, d).astype(q.dtype)


def num_rows(num_tokens: int, num_seqs: int, tile: int) -> int:
    """Rows `to_rows` needs at most: each sequence's last row may be partly empty."""
    return num_tokens if tile == 1 else min(num_tokens, num_tokens // tile + num_seqs)


def to_rows(q, block_tables, kv_lens, cu_q_lens, tile: int):
    """Packed -> padded: (q_rows [R, tile, H, D], tables [R, MB], kv_lens [R], q_lens [R],
    token_row [T], token_slot [T]), R = num_rows(T, S, tile). Row r holds up to `tile`
    consecutive tokens of one sequence; token t sits at (token_row[t], token_slot[t])."""
    t, h, d = q.shape
    s = block_tables.shape[0]
    r = num_rows(t, s, tile)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]  # [S]
    rows_per_seq = (q_lens + tile - 1) // tile
    row_end = jnp.cumsum(rows_per_seq)
    row_start = row_end - rows_per_seq
    ridx = jnp.arange(r, dtype=jnp.int32)
    rseq = jnp.minimum(count_at_most(row_end, ridx), s - 1)  # [R]
    live = ridx < row_end[-1]
    first = (ridx - row_start[rseq]) * tile  # first query index of the row within its sequence
    row_q = jnp.where(live, jnp.clip(q_lens[rseq] - first, 0, tile), 0)
    row_kv = jnp.where(live, kv_lens[rseq] - q_lens[rseq] + first + row_q, 0)
    tok = cu_q_lens[rseq][:, None] + first[:, None] + jnp.arange(tile, dtype=jnp.int32)[None, :]  # [R, tile]
    q_rows = q[jnp.clip(tok, 0, t - 1)]  # slots past row_q are ignored by every backend
    seq = token_sequence_ids(cu_q_lens, t)
    seq_c = jnp.minimum(seq, s - 1)
    j = jnp.arange(t, dtype=jnp.int32) - cu_q_lens[seq_c]
    token_row = jnp.where(seq < s, row_start[seq_c] + j // tile, -1)
    return q_rows, block_tables[rseq], row_kv.astype(jnp.int32), row_q.astype(jnp.int32), token_row, j % tile


def from_rows(out_rows, token_row, token_slot):
    """Padded rows [R, tile, H, D] -> packed [T, H, D] (zeros for tokens no sequence owns)."""
    r, tile, h, d = out_rows.shape
    flat = out_rows.reshape(r * tile, h, d)
    out = flat[jnp.clip(token_row * tile + token_slot, 0, r * tile - 1)]
    return jnp.where((token_row >= 0)[:, None, None], out, 0).astype(out_rows.dtype)
