"""Dense (contiguous per-slot) KV cache attention: the XLA path of the dense cache backend.

Layout:
  q          [S, Q, H, D]      queries of S sequences, Q query slots each (Q = 1 for decode)
  k_cache    [Hkv, NS, L, D]   NS slots of L = max_model_len token rows each, one array per layer
  v_cache    [Hkv, NS, L, D]
  slots      [S] int32         the cache slot sequence s owns (its tokens sit at rows 0..kv_len-1)
  kv_lens    [S] int32         tokens of sequence s in its slot (this step's new ones included)
  q_lens     [S] int32         valid query slots of sequence s (<= Q)

This is the paged layout with one block of L tokens per sequence: the result equals
`paged_attention_reference` with `block_tables = slots[:, None]` (same masking, GQA folding,
float32 softmax, zeros for padding rows and query slots). Writes use `write_kv` with
slot_mapping = slot * L + position.

The slot is walked in contiguous chunks of `chunk_tokens` rows (a dynamic slice per sequence)
with an online softmax; the loop's trip count is cdiv(max(kv_lens), chunk_tokens), so a step
pays for the longest live sequence, not for all L reserved rows. On GPUs, where XLA drives a
loop from the host and a trip count read from the device makes the host wait at every
iteration, the walk covers all L rows (cdiv(L, chunk_tokens), known when compiling), masked:
what a static dense cache costs.

sliding_window / soft_cap: static options as in paged_attention/reference.py. With a window
each sequence's walk starts at the first row inside the window of its earliest query (the
trip count: the most rows any sequence has from there on; on GPUs every chunk of the slot
from there, masked).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pagedjax.pallas_kernels.paged_attention import packed
from pagedjax.pallas_kernels.paged_attention.kv_quant import load
from pagedjax.pallas_kernels.paged_attention.ops import GPU_BACKENDS
from pagedjax.pallas_kernels.paged_attention.cpu_native import (native_supported, packed_attention_native,
                                                       paged_attention_native)
from pagedjax.pallas_kernels.paged_attention.reference import (F32_DOTS, NEG_INF, _fold_gqa, cap_scores, key_visible,
                                                      online_softmax_update, query_positions, run_online_softmax)

DEFAULT_CHUNK_TOKENS = 128


def dense_attention(q, k_cache, v_cache, slots, kv_lens, q_lens, *, scale,
                    chunk_tokens: int = DEFAULT_CHUNK_TOKENS, impl: str = "auto",
                    sliding_window=None, soft_cap=None):
    """Causal attention of q over each sequence's slot rows [0, kv_len); see the module doc.

    impl: "xla" walks the slots in chunks as described above; "native" runs the CPU kernel
    of the paged cache with one page per slot (CPU only; float32 or bfloat16 cache);
    "auto" picks "native" where it serves, else "xla".
    """
    s, nq, h, d = q.shape
    hkv, _, max_len, _ = k_cache.shape
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache shapes differ: {k_cache.shape} vs {v_cache.shape}")
    if h % hkv or k_cache.shape[-1] != d:
        raise ValueError(f"q {q.shape} does not fit a cache of shape {k_cache.shape}")
    if impl not in ("auto", "native", "xla"):
        raise ValueError(f"unknown impl {impl!r}; expected 'auto', 'native' or 'xla'")
    native = native_supported(q.dtype, k_cache.dtype)
    if impl == "native" and not native:
        raise ValueError("impl='native' needs the CPU backend, float32/bfloat16 q, a float32/bfloat16/int8/"
                         "fp8 cache, and a built kernel")
    if impl != "xla" and native:  # a slot is one page of max_model_len rows
        return paged_attention_native(q, k_cache, v_cache, slots[:, None], kv_lens, q_lens, scale=scale,
                                      sliding_window=sliding_window, soft_cap=soft_cap)
    c = min(chunk_tokens, max_len)
    g = h // hkv
    qg = _fold_gqa(q, hkv).astype(jnp.float32) * scale  # [S, Hkv, G, Q, D]
    qpos = query_positions(kv_lens, q_lens, nq)  # [S, Q]
    q_valid = jnp.arange(nq)[None, :] < q_lens[:, None]  # [S, Q]
    if sliding_window is None:
        base = 0
    else:  # each sequence from the first row inside its earliest query's window
        base = jnp.maximum(kv_lens - q_lens - (sliding_window - 1), 0)  # [S]
    if jax.default_backend() in GPU_BACKENDS:  # a device-read trip count makes XLA:GPU's host wait
        num_chunks = -(-max_len // c)  # every chunk of the slot, masked past each sequence
    else:
        num_chunks = (jnp.max(kv_lens - base) + c - 1) // c  # up to the longest sequence of the step

    def rows(cache, start):
        """Rows [start, start + c) of every sequence's slot (start: a scalar, or [S] one per
        sequence): [S, Hkv, C, D] float32."""
        if jnp.ndim(start) == 0:
            take = lambda x: jax.vmap(
                lambda slot: jax.lax.dynamic_slice(x, (0, slot, start, 0), (hkv, 1, c, x.shape[-1]))[:, 0])(slots)
        else:
            take = lambda x: jax.vmap(
                lambda slot, st: jax.lax.dynamic_slice(x, (0, slot, st, 0), (hkv, 1, c, x.shape[-1]))[:, 0])(slots,
                                                                                                          start)
        return load(cache, take)

    def body(i, carry):
        # when c does not divide L the last chunk is shifted back to stay inside the slot;
        # rows it shares with the chunk before are masked out so none counts twice
        lo = base + i * c  # scalar, or [S] with a window
        start = jnp.minimum(lo, max_len - c)
        k, v = rows(k_cache, start), rows(v_cache, start)
        scores = cap_scores(jnp.einsum("skgqd,sktd->skgqt", qg, k, precision=F32_DOTS), soft_cap)
        if sliding_window is None:
            t = (start + jnp.arange(c, dtype=jnp.int32))[None, None, :]
            valid = (t >= i * c) & (t <= qpos[:, :, None])
        else:
            t = (start[:, None] + jnp.arange(c, dtype=jnp.int32)[None, :])[:, None, :]  # [S, 1, C]
            valid = (t >= lo[:, None, None]) & key_visible(t, qpos[:, :, None], sliding_window)
        valid &= (t < kv_lens[:, None, None]) & q_valid[:, :, None]  # [S, Q, C]
        scores = jnp.where(valid[:, None, None], scores, NEG_INF)
        return online_softmax_update(*carry, scores, v[:, :, None])  # values [S, Hkv, 1, C, D]

    return run_online_softmax(num_chunks, body, (s, hkv, g, nq, d), q.dtype)


def dense_packed_attention(q, k_cache, v_cache, slots, kv_lens, cu_q_lens, *, scale,
                           chunk_tokens: int = DEFAULT_CHUNK_TOKENS, impl: str = "auto",
                           row_tokens: int = 16, sliding_window=None, soft_cap=None):
    """Packed layout (pallas_kernels/paged_attention/packed.py): q [T, H, D] -> [T, H, D].

    Native: the paged kernel with one page per slot, packed as it is. XLA: the tokens are cut
    into rows of `row_tokens` (packed.to_rows) and walked by `dense_attention`.
    """
    if impl != "xla" and native_supported(q.dtype, k_cache.dtype):
        return packed_attention_native(q, k_cache, v_cache, slots[:, None], kv_lens, cu_q_lens[:-1],
                                       cu_q_lens[1:] - cu_q_lens[:-1], scale=scale,
                                       sliding_window=sliding_window, soft_cap=soft_cap)
    if impl == "native":
        raise ValueError("impl='native' needs the CPU backend, float32/bfloat16 q and cache, and a built kernel")
    tile = 1 if q.shape[0] <= slots.shape[0] else row_tokens
    q_rows, tables, row_kv, row_q, token_row, token_slot = packed.to_rows(q, slots[:, None], kv_lens, cu_q_lens, tile)
    out = dense_attention(q_rows, k_cache, v_cache, tables[:, 0], row_kv, row_q, scale=scale,
                          chunk_tokens=chunk_tokens, impl="xla", sliding_window=sliding_window, soft_cap=soft_cap)
    return packed.from_rows(out, token_row, token_slot)
