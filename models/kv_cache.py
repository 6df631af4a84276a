"""KV cache layouts the model layers write to and attend over.

A model layer calls `cache.update_and_attend(layer_kv, q, k, v, md)`; the layout (paged
blocks or dense per-slot rows) is the cache object's business, so one model definition
serves both backends.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from pallas_kernels.dense_attention import DEFAULT_CHUNK_TOKENS, dense_attention
from pallas_kernels.paged_attention.ops import paged_attention
from pallas_kernels.paged_attention.reference import write_kv


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step batch description (all int32, padded to the step's bucket).

    positions    [S, Q]  absolute position of each query token
    slot_mapping [S, Q]  cache slot the token's K/V goes to (-1: padding, not written)
    block_tables [S, MB] physical block of each logical block (paged) / slot index (dense)
    kv_lens      [S]     tokens in the cache for the sequence after this step's writes
    q_lens       [S]     valid query tokens of the sequence in this step (0: padding row)
    """

    positions: jax.Array
    slot_mapping: jax.Array
    block_tables: jax.Array
    kv_lens: jax.Array
    q_lens: jax.Array


LayerKV = tuple[jax.Array, jax.Array]  # (k, v) cache arrays of one layer


class PagedKVCache:
    """Paged layout: per layer k, v of shape [Hkv, num_blocks, block_size, D]."""

    def __init__(self, num_blocks: int, block_size: int, attention_impl: str = "auto"):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.attention_impl = attention_impl

    def layer_shape(self, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (num_kv_heads, self.num_blocks, self.block_size, head_dim)

    def update_and_attend(self, layer_kv: LayerKV, q, k, v, md: AttentionMetadata, *, scale):
        """q [S,Q,H,D], k/v [S,Q,Hkv,D] -> (new layer_kv, out [S,Q,H,D])."""
        s, nq, hkv, d = k.shape
        k_pages, v_pages = write_kv(layer_kv[0], layer_kv[1], k.reshape(s * nq, hkv, d),
                                    v.reshape(s * nq, hkv, d), md.slot_mapping.reshape(-1))
        out = _paged_attention(q, k_pages, v_pages, md, scale, self.attention_impl)
        return (k_pages, v_pages), out


class DenseKVCache:
    """Dense layout: per layer k, v of shape [Hkv, num_slots, max_model_len, D].

    Each admitted request owns one slot of max_model_len rows for its whole life. This is the
    paged layout with one block of max_model_len tokens per request, so the engine drives it
    through the same block pool and metadata: `block_size` is max_model_len, a request's
    block table is [its slot], and slot_mapping = slot * max_model_len + position. Attention
    walks each slot in contiguous chunks up to the longest live sequence (`dense_attention`,
    which on CPU with float32 runs the paged cache's native kernel, one page per slot, so
    the two backends are compared on equal kernels).
    """

    def __init__(self, num_slots: int, max_model_len: int, chunk_tokens: int = DEFAULT_CHUNK_TOKENS):
        self.num_slots = num_slots
        self.max_model_len = max_model_len
        self.chunk_tokens = chunk_tokens

    @property
    def num_blocks(self) -> int:
        return self.num_slots

    @property
    def block_size(self) -> int:
        return self.max_model_len

    def layer_shape(self, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (num_kv_heads, self.num_slots, self.max_model_len, head_dim)

    def update_and_attend(self, layer_kv: LayerKV, q, k, v, md: AttentionMetadata, *, scale):
        """q [S,Q,H,D], k/v [S,Q,Hkv,D] -> (new layer_kv, out [S,Q,H,D])."""
        s, nq, hkv, d = k.shape
        k_cache, v_cache = write_kv(layer_kv[0], layer_kv[1], k.reshape(s * nq, hkv, d),
                                    v.reshape(s * nq, hkv, d), md.slot_mapping.reshape(-1))
        out = dense_attention(q, k_cache, v_cache, md.block_tables[:, 0], md.kv_lens, md.q_lens, scale=scale,
                              chunk_tokens=self.chunk_tokens)
        return (k_cache, v_cache), out


def _paged_attention(q, k_pages, v_pages, md, scale, impl):
    return paged_attention(q, k_pages, v_pages, md.block_tables, md.kv_lens, md.q_lens, scale=scale, impl=impl)


def init_kv_caches(cache, num_layers: int, num_kv_heads: int, head_dim: int, dtype, sharding=None) -> list[LayerKV]:
    """Zeroed per-layer (k, v) arrays for `cache` (PagedKVCache or DenseKVCache)."""
    shape = cache.layer_shape(num_kv_heads, head_dim)
    make = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    return [(make(), make()) for _ in range(num_layers)]


def copy_blocks(kv_caches: list[LayerKV], src: jax.Array, dst: jax.Array) -> list[LayerKV]:
    """Copy-on-write: block src[i] -> dst[i] in every layer (both layouts are [Hkv, NB, BS, D]).

    src, dst: [C] int32; the real copies come first, then padding entries with dst out of
    range (>= NB). A loop over the real copies only, each an in-place slice update: a step
    with no copies costs nothing (gathering all C entries every step cost ~200 ms per step
    for dense slots of 2048 rows on CPU).
    """
    num_blocks = kv_caches[0][0].shape[1]

    def body(i, caches):
        def copy(x):
            block = jax.lax.dynamic_slice_in_dim(x, src[i], 1, axis=1)
            return jax.lax.dynamic_update_slice_in_dim(x, block, dst[i], axis=1)

        return [(copy(k), copy(v)) for k, v in caches]

    return jax.lax.fori_loop(0, jnp.sum(dst < num_blocks), body, kv_caches)
