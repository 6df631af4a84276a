"""KV cache layouts the model layers write to and attend over.

A model layer calls `cache.update_and_attend(kv, layer, q, k, v, md)`; the layout (paged
blocks or dense per-slot rows) is the cache object's business, so one model definition
serves both backends. Both keep every layer in one k and one v array, so the layers run
under one `jax.lax.scan` with the cache threaded through it and updated in place.
"""
from __future__ import annotations

import functools

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from pagedjax.models.sharding import DATA_AXIS, MODEL_AXIS
from pagedjax.pallas_kernels.dense_attention import DEFAULT_CHUNK_TOKENS, dense_packed_attention
from pagedjax.pallas_kernels.paged_attention import cpu_native, kv_quant
from pagedjax.pallas_kernels.paged_attention.kv_quant import QuantizedPages
from pagedjax.pallas_kernels.paged_attention.ops import packed_paged_attention, write_kv
from pagedjax.platforms import current_platform


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AttentionMetadata:
    """One step's packed batch (all int32, padded to the step's bucket).

    positions    [T]       absolute position of each token (padding: 0)
    slot_mapping [T]       cache slot the token's K/V goes to, block * BS + offset (-1: not written)
    block_tables [S, MB]   physical block of each logical block (paged) / the slot (dense)
    kv_lens      [S]       tokens in the cache for the sequence after this step's writes
    cu_q_lens    [S + 1]   sequence s owns tokens [cu_q_lens[s], cu_q_lens[s + 1]) of the step
    """

    positions: jax.Array
    slot_mapping: jax.Array
    block_tables: jax.Array
    kv_lens: jax.Array
    cu_q_lens: jax.Array


# (k, v), each [Hkv, L * NB, BS, D]: every layer's blocks; an int8 / fp8 cache holds each as
# kv_quant.QuantizedPages (the pages and their float16 scales [Hkv, L * NB, BS])
KVCache = tuple[jax.Array | QuantizedPages, jax.Array | QuantizedPages]


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype) -> int:
    """K and V of one token in every layer, a quantized cache's scales counted."""
    dtype = jnp.dtype(dtype)
    per_head = head_dim * dtype.itemsize + (jnp.dtype(jnp.float16).itemsize if kv_quant.is_quantized(dtype) else 0)
    return 2 * num_layers * num_kv_heads * per_head


class PagedKVCache:
    """Paged layout: one k and one v array of shape [Hkv, L * num_blocks, block_size, D].

    Layer l's block b is block l * num_blocks + b of the array, so a layer reads and writes
    the whole pool through its block tables offset by l * num_blocks: no per-layer slice or
    copy of the pool, and the layers can run under one scan with the cache updated in place.
    """

    def __init__(self, num_blocks: int, block_size: int, attention_impl: str = "auto", mesh: Mesh | None = None):
        self.mesh = mesh  # KV heads split over its "model" axis; None: one device
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.attention_impl = attention_impl  # "auto": the platform's choice for the pages (at trace time)

    def shape(self, num_layers: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (num_kv_heads, num_layers * self.num_blocks, self.block_size, head_dim)

    def update_and_attend(self, kv: KVCache, layer, q, k, v, md: AttentionMetadata, *, scale,
                          sliding_window: int | None = None, soft_cap: float | None = None):
        """Writes layer `layer`'s k/v [T, Hkv, D] and attends q [T, H, D] -> (new kv, out [T, H, D]);
        sliding_window, soft_cap: the layer's own (static; see pallas_kernels.paged_attention)."""
        opts = dict(sliding_window=sliding_window, soft_cap=soft_cap)

        def attend(kv, layer, q, k, v, md):
            k_all, v_all, tables = _write(kv, layer, self.num_blocks, self.block_size, k, v, md)
            impl = self.attention_impl
            if impl == "auto":
                impl = current_platform().attention_impl(q.dtype, self.block_size, k_all.dtype)
            out = packed_paged_attention(q, k_all, v_all, tables, md.kv_lens, md.cu_q_lens, scale=scale,
                                         impl=impl, **opts)
            return (k_all, v_all), out

        return per_device(rotated(attend, kv), self.mesh)(kv, layer, q, k, v, md)


class DenseKVCache:
    """Dense layout: one k and one v array of shape [Hkv, L * num_slots, max_model_len, D].

    Each admitted request owns one slot of max_model_len rows for its whole life. This is the
    paged layout with one block of max_model_len tokens per request, so the engine drives it
    through the same block pool and metadata: `block_size` is max_model_len, a request's
    block table is [its slot], and slot_mapping = slot * max_model_len + position. Attention
    walks each slot in contiguous chunks up to the longest live sequence (`dense_attention`,
    which on CPU runs the paged cache's native kernel, one page per slot, so the two
    backends are compared on equal kernels).
    """

    def __init__(self, num_slots: int, max_model_len: int, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                 mesh: Mesh | None = None):
        self.mesh = mesh  # KV heads split over its "model" axis; None: one device
        self.num_slots = num_slots
        self.max_model_len = max_model_len
        self.chunk_tokens = chunk_tokens

    @property
    def num_blocks(self) -> int:
        return self.num_slots

    @property
    def block_size(self) -> int:
        return self.max_model_len

    def shape(self, num_layers: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (num_kv_heads, num_layers * self.num_slots, self.max_model_len, head_dim)

    def update_and_attend(self, kv: KVCache, layer, q, k, v, md: AttentionMetadata, *, scale,
                          sliding_window: int | None = None, soft_cap: float | None = None):
        """Writes layer `layer`'s k/v [T, Hkv, D] and attends q [T, H, D] -> (new kv, out [T, H, D])."""
        opts = dict(sliding_window=sliding_window, soft_cap=soft_cap)

        def attend(kv, layer, q, k, v, md):
            k_all, v_all, tables = _write(kv, layer, self.num_slots, self.max_model_len, k, v, md)
            out = dense_packed_attention(q, k_all, v_all, tables[:, 0], md.kv_lens, md.cu_q_lens, scale=scale,
                                         chunk_tokens=self.chunk_tokens, **opts)
            return (k_all, v_all), out

        return per_device(rotated(attend, kv), self.mesh)(kv, layer, q, k, v, md)


def rotated(attend, kv: KVCache):
    """`attend` on a quantized cache: q, k and v rotated before (kv_quant.rotate), the output
    rotated back; as is on a plain cache."""
    if not kv_quant.is_quantized(kv[0].dtype):
        return attend

    def attend_rotated(kv, layer, q, k, v, md):
        kv, out = attend(kv, layer, kv_quant.rotate(q), kv_quant.rotate(k), kv_quant.rotate(v), md)
        return kv, kv_quant.rotate(out)

    return attend_rotated


_CACHE_SPEC = (P(MODEL_AXIS, DATA_AXIS), P(MODEL_AXIS, DATA_AXIS))


def per_device(fn, mesh: Mesh | None):
    """`fn(kv, layer, q [T, H, D], k, v [T, Hkv, D], md)` run on each device's own KV heads
    and data rank under shard_map: the cache split on its head axis over "model" and its
    block axis over "data" (each rank its own pool), q, k and v on heads and tokens, the
    metadata on its leading axis over "data" (each rank its own rows, replicated over
    "model"), so attention needs no collective. As is on one device."""
    if mesh is None or mesh.size == 1:
        return fn
    heads = P(DATA_AXIS, MODEL_AXIS)
    return jax.shard_map(fn, mesh=mesh, in_specs=(_CACHE_SPEC, P(), heads, heads, heads, P(DATA_AXIS)),
                         out_specs=(_CACHE_SPEC, heads), check_vma=False)


def _write(kv: KVCache, layer, num_blocks: int, block_size: int, k, v, md: AttentionMetadata):
    """Scatters the step's k/v into layer `layer`'s blocks; returns (k_all, v_all, the layer's
    block tables [S, MB] in the stacked array)."""
    offset = layer * num_blocks
    slots = jnp.where(md.slot_mapping >= 0, md.slot_mapping + offset * block_size, -1)
    k_all, v_all = write_kv(kv[0], kv[1], k, v, slots)
    return k_all, v_all, md.block_tables + offset


def init_kv_cache(cache, num_layers: int, num_kv_heads: int, head_dim: int, dtype, sharding=None,
                  data_parallel: int = 1) -> KVCache:
    """Zeroed (k, v) arrays for `cache` (PagedKVCache or DenseKVCache); with data_parallel
    ranks, rank r's whole pool follows rank r - 1's on the block axis."""
    shape = list(cache.shape(num_layers, num_kv_heads, head_dim))
    shape[1] *= data_parallel
    make = _zeros_maker(tuple(shape), dtype, sharding)  # one per pool shape: a wake-up compiles nothing
    return make(), make()


@functools.lru_cache(maxsize=None)
def _zeros_maker(shape: tuple, dtype, sharding):
    return jax.jit(lambda: kv_quant.zeros(list(shape), dtype), out_shardings=sharding)


def copy_blocks(kv: KVCache, num_layers: int, src: jax.Array, dst: jax.Array) -> KVCache:
    """Copy-on-write: block src[i] -> dst[i] in every layer (both layouts).

    src, dst: [C] int32; the real copies come first, then padding entries with dst out of
    range (>= NB). No dst is another entry's src (dst blocks are fresh), so the copies are
    independent. The engine runs it apart from the step, only when a step has copies. On CPU
    a loop over the real copies only; on accelerators all C entries at once, padding dropped
    (`copy_blocks_at_once`: a GPU would wait for the device to read the loop's trip count).
    """
    if cpu_native.native_write_supported(kv[0].dtype):  # bf16 on CPU: XLA would widen the pool to f32
        return cpu_native.copy_blocks_native(tuple(kv), num_layers, src, dst)
    if not current_platform().skip_by_conditional:
        return copy_blocks_at_once(kv, num_layers, src, dst)
    num_blocks = kv[0].shape[1] // num_layers
    layer_base = jnp.arange(num_layers, dtype=jnp.int32) * num_blocks  # [L]

    def body(i, caches):  # a quantized pool's scales are copied with its pages
        return jax.tree.map(lambda x: x.at[:, layer_base + dst[i]].set(x[:, layer_base + src[i]]), caches)

    return jax.lax.fori_loop(0, jnp.sum(dst < num_blocks), body, tuple(kv))


def copy_blocks_at_once(kv: KVCache, num_layers: int, src: jax.Array, dst: jax.Array) -> KVCache:
    """copy_blocks as one gather and one scatter of all C x L blocks, padding entries
    dropped: no loop whose trip count is read from the device (XLA:GPU would make the host
    wait for the device at every step to read it), at the cost of reading C x L blocks."""
    num_blocks = kv[0].shape[1] // num_layers
    layer_base = jnp.arange(num_layers, dtype=jnp.int32)[:, None] * num_blocks  # [L, 1]
    real = dst[None, :] < num_blocks  # [1, C]
    to = jnp.where(real, layer_base + dst[None, :], num_layers * num_blocks).reshape(-1)  # [L * C]; out of range: dropped
    frm = (layer_base + jnp.where(real, src[None, :], 0)).reshape(-1)  # [L * C]
    return jax.tree.map(lambda x: x.at[:, to].set(x[:, frm], mode="drop"), tuple(kv))


def copy_blocks_sharded(kv: KVCache, num_layers: int, src: jax.Array, dst: jax.Array, mesh: Mesh | None) -> KVCache:
    """copy_blocks on each device's own KV heads (see per_device)."""
    if mesh is None or mesh.size == 1:
        return copy_blocks(kv, num_layers, src, dst)
    return jax.shard_map(lambda kv, s, d: copy_blocks(kv, num_layers, s, d), mesh=mesh,
                         in_specs=(_CACHE_SPEC, P(DATA_AXIS), P(DATA_AXIS)), out_specs=_CACHE_SPEC,
                         check_vma=False)(tuple(kv), src, dst)
