"""Pallas TPU (Mosaic) paged decode attention (Q == 1).

Grid (S, Hkv), both parallel. Block tables (flattened to 1-D, SMEM-friendly) and kv_lens
arrive by scalar prefetch; the page pools stay in HBM (memory space ANY). Each grid step
walks only its sequence's valid pages, `pages_per_compute_block` pages per step of a
dynamic-trip-count loop, copying page by page into a two-slot VMEM buffer: block i + 1 is
in flight while block i is computed. The G query heads of the kv head are the rows of one
[R, D] tile (R = G padded to the sublane tile), so K/V are read once per kv head.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import common


def sublane_rows(dtype) -> int:
    """Rows of one VMEM tile for dtype: 8 for 32-bit, 16 for bf16."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def tpu_supported(page_size: int, page_dtype) -> bool:
    """Pages land at row offsets j * BS of the VMEM buffer; keep them tile aligned."""
    return page_size % sublane_rows(page_dtype) == 0


def default_pages_per_compute_block(page_size: int, max_blocks: int) -> int:
    return max(1, min(max_blocks, 256 // page_size))


def page_loop(bt_ref, seq, head, k_hbm, v_hbm, k_buf, v_buf, sems, *, n_pages, limit,
              pages_per_block, max_blocks, step, init):
    """Fold `step(i, k [T, D], v [T, D], carry)` over the compute blocks of P pages covering
    logical pages [0, n_pages) of sequence `seq`, kv head `head` (T = P * BS).

    Pages are copied one by one from HBM into a two-slot VMEM buffer, block i + 1 in flight
    while block i is computed; only pages < n_pages are copied. V rows of tokens >= limit
    are zeroed (pages that were not copied hold stale data, and 0 * NaN would leak); K rows
    there are left as they are, so `step` must mask their scores.
    """
    bs = k_hbm.shape[2]
    p = pages_per_block
    t = p * bs
    n_blocks = (n_pages + p - 1) // p

    def page_copies(i, slot):
        """(condition, k copy, v copy) for each page of compute block i."""
        out = []
        for j in range(p):
            page = i * p + j
            ok = page < n_pages
            pid = bt_ref[seq * max_blocks + jnp.minimum(page, max_blocks - 1)]
            dst = pl.ds(j * bs, bs)
            kc = pltpu.make_async_copy(k_hbm.at[head, pid], k_buf.at[slot, dst],
                                       sems.at[0, slot])
            vc = pltpu.make_async_copy(v_hbm.at[head, pid], v_buf.at[slot, dst],
                                       sems.at[1, slot])
            out.append((ok, kc, vc))
        return out

    def start(i, slot):
        for ok, kc, vc in page_copies(i, slot):
            @pl.when(ok)
            def _():
                kc.start()
                vc.start()

    def wait(i, slot):
        for ok, kc, vc in page_copies(i, slot):
            @pl.when(ok)
            def _():
                kc.wait()
                vc.wait()

    start(0, 0)

    def body(i, carry):
        slot = i % 2

        @pl.when(i + 1 < n_blocks)
        def _():
            start(i + 1, 1 - slot)

        wait(i, slot)
        k = k_buf[slot]  # [T, D]
        v = v_buf[slot]
        v_tok = i * t + lax.broadcasted_iota(jnp.int32, v.shape, 0)
        v = jnp.where(v_tok < limit, v, jnp.zeros_like(v))
        return step(i, k, v, carry)

    return lax.fori_loop(0, n_blocks, body, init)


def dot_precision(dtype):
    return lax.Precision.HIGHEST if dtype == jnp.float32 else None


def attend_step(q, scale, mask):
    """Online-softmax step for the rows of q [R, D] against a [T, D] K/V block; `mask(i,
    scores)` masks the [R, T] scores of block i."""
    prec = dot_precision(q.dtype)

    def step(i, k, v, carry):
        m, l, acc = carry
        k = k.astype(q.dtype)
        v = v.astype(q.dtype)
        scores = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=prec,
                                 preferred_element_type=jnp.float32) * scale  # [R, T]
        scores = mask(i, scores)

        def pv(pr):  # [R, T] f32 -> [R, D] f32
            return lax.dot_general(pr.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                   precision=prec, preferred_element_type=jnp.float32)

        return common.softmax_step(m, l, acc, scores, pv, keepdims=True)

    return step


def init_carry(rows, dim):
    return (jnp.full((rows, 1), common.NEG_INF, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            jnp.zeros((rows, dim), jnp.float32))


def _kernel(bt_ref, lens_ref,  # SMEM: [S * MB], [S]
            q_ref,  # VMEM [R, D]
            k_hbm, v_hbm,  # HBM [Hkv, NB, BS, D]
            o_ref,  # VMEM [R, D]
            k_buf, v_buf,  # VMEM [2, T, D], T = P * BS
            sems,  # DMA semaphores [2 (k/v), 2 (slot)]
            *, scale, pages_per_block, max_blocks):
    s, h = pl.program_id(0), pl.program_id(1)
    bs = k_hbm.shape[2]
    t = pages_per_block * bs
    kv_len = lens_ref[s]
    n_pages = jnp.minimum((kv_len + bs - 1) // bs, max_blocks)
    q = q_ref[...]  # [R, D]
    rows, d = q.shape

    def mask(i, scores):
        tok = i * t + lax.broadcasted_iota(jnp.int32, scores.shape, 1)
        return common.mask_scores(scores, tok, kv_len)

    m, l, acc = page_loop(bt_ref, s, h, k_hbm, v_hbm, k_buf, v_buf, sems, n_pages=n_pages,
                          limit=kv_len, pages_per_block=pages_per_block,
                          max_blocks=max_blocks, step=attend_step(q, scale, mask),
                          init=init_carry(rows, d))
    out, _ = common.finalize(m, l, acc, keepdims=True)
    o_ref[...] = out.astype(o_ref.dtype)


def paged_decode_attention_tpu(q, k_pages, v_pages, block_tables, kv_lens, *, scale,
                               pages_per_compute_block=None, interpret=False):
    """q [S, H, D], pages [Hkv, NB, BS, D], block_tables [S, MB], kv_lens [S] -> [S, H, D].

    Unvalidated kernel entry (see ops.paged_decode_attention). `interpret` may be a bool
    or a `pltpu.InterpretParams`.
    """
    s, h, d = q.shape
    hkv, _, bs, _ = k_pages.shape
    mb = block_tables.shape[1]
    g = h // hkv
    p = pages_per_compute_block or default_pages_per_compute_block(bs, mb)
    cdt = common.compute_dtype(q.dtype, k_pages.dtype)
    rows = common.round_up(g, sublane_rows(cdt))
    qf = common.fold_decode_q(q, hkv, rows, d, cdt)  # [S, Hkv, R, D]
    kernel = functools.partial(_kernel, scale=float(scale), pages_per_block=p, max_blocks=mb)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(s, hkv),
        in_specs=[
            pl.BlockSpec((None, None, rows, d), lambda i, j, *_: (i, j, 0, 0)),
            pl.BlockSpec(memory_space=pl.ANY),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        out_specs=pl.BlockSpec((None, None, rows, d), lambda i, j, *_: (i, j, 0, 0)),
        scratch_shapes=[
            pltpu.VMEM((2, p * bs, d), k_pages.dtype),
            pltpu.VMEM((2, p * bs, d), v_pages.dtype),
            pltpu.SemaphoreType.DMA((2, 2)),
        ],
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((s, hkv, rows, d), q.dtype),
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
        name="paged_decode_attention_tpu",
    )(block_tables.reshape(-1), kv_lens, qf, k_pages, v_pages)  # [S, Hkv, R, D]
    return common.unfold_decode_o(out, h, d)
