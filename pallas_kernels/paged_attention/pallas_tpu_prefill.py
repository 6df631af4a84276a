"""Pallas TPU (Mosaic) paged prefill attention: Q > 1 query slots per sequence.

Grid (S, Hkv, Q tiles), all parallel. A program owns TQ query slots of one sequence and the G
query heads of one kv head, as the TQ * G query-major rows of one [R, D] tile (row =
slot * G + head; TQ is chosen so that R fills whole sublane tiles). Block tables, kv_lens
and q_lens arrive by scalar prefetch; the page pools stay in HBM. The tile walks only the
pages its causal horizon needs (keys [0, last position of its last valid query]),
`pages_per_compute_block` pages per step, double-buffered exactly as the decode kernel
(`pallas_tpu.page_loop`), with the online softmax of common.py. A tile with no valid query
copies nothing and writes zeros. Quantized pages (k_scales / v_scales given): the scale rows
are DMA'd beside the pages and applied per compute block exactly as in the decode kernel.
sliding_window / soft_cap (static, reference.py): with a window a tile's walk starts at the
first page holding a key inside the window of its earliest query.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import common
from .pallas_tpu import (attend_step, default_pages_per_compute_block, init_carry, page_loop,
                         scale_operands, split_refs, sublane_rows)


def default_block_q(group: int, num_q: int, target_rows: int = 128) -> int:
    """Query slots per tile: about target_rows rows, R = TQ * G a multiple of 16 (a bf16
    sublane tile, so also of the f32 one), no more slots than Q rounded up to that step."""
    step = 16 // math.gcd(group, 16)
    tq = common.round_up(max(1, target_rows // group), step)
    return min(tq, common.round_up(num_q, step))


def _kernel(bt_ref, kv_lens_ref, q_lens_ref,  # SMEM: [S * MB], [S], [S]
            q_ref,  # VMEM [R, D], R = TQ * G
            k_hbm, v_hbm,  # HBM [Hkv, NB, BS, D]
            *refs,  # [k_scales, v_scales: HBM [Hkv, NB, BS] f16 (quantized pages),]
            # o_ref: VMEM [R, D]; k_buf, v_buf: VMEM [2, T, D], T = P * BS; sems: DMA
            # semaphores [2 (k/v), 2 (slot)]; [ks_buf, vs_buf: VMEM [2, P, BS]; scale sems]
            scale, group, block_q, pages_per_block, max_blocks, quantized, sliding_window, soft_cap):
    o_ref, k_buf, v_buf, sems, scales = split_refs(refs, quantized)
    s, h, tile = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bs = k_hbm.shape[2]
    first_pos, n_valid, end = common.prefill_tile(kv_lens_ref[s], q_lens_ref[s], tile, block_q)
    n_pages = jnp.minimum((end + bs - 1) // bs, max_blocks)
    q = q_ref[...]  # [R, D]
    rows, d = q.shape

    def mask(tok0, scores):
        row = lax.broadcasted_iota(jnp.int32, scores.shape, 0)
        tok = tok0 + lax.broadcasted_iota(jnp.int32, scores.shape, 1)
        return common.causal_mask(scores, row, tok, first_pos, n_valid, group, sliding_window)

    m, l, acc = page_loop(bt_ref, s, h, k_hbm, v_hbm, k_buf, v_buf, sems, n_pages=n_pages,
                          limit=end, pages_per_block=pages_per_block, max_blocks=max_blocks,
                          step=attend_step(q, scale, mask, soft_cap), init=init_carry(rows, d),
                          scales=scales, first_page=common.window_first_page(first_pos, bs, sliding_window))
    out, _ = common.finalize(m, l, acc, keepdims=True)
    o_ref[...] = out.astype(o_ref.dtype)


def paged_prefill_attention_tpu(q, k_pages, v_pages, block_tables, kv_lens, q_lens, *, scale,
                                block_q=None, pages_per_compute_block=None, interpret=False,
                                k_scales=None, v_scales=None, sliding_window=None, soft_cap=None):
    """q [S, Q, H, D], pages [Hkv, NB, BS, D], block_tables [S, MB], kv_lens / q_lens [S]
    -> [S, Q, H, D] (semantics of `paged_attention_reference`).

    Unvalidated kernel entry (see ops.paged_attention). `block_q` (query slots per tile) is
    rounded up so a tile fills whole sublane tiles; `interpret` may be a bool or a
    `pltpu.InterpretParams`. Quantized pages: int8 / float8_e4m3fn with k_scales / v_scales
    [Hkv, NB, BS] float16 (both or neither), dequantized per compute block.
    sliding_window / soft_cap: static options as in reference.py.
    """
    s, nq, h, d = q.shape
    hkv, _, bs, _ = k_pages.shape
    mb = block_tables.shape[1]
    g = h // hkv
    cdt = common.compute_dtype(q.dtype, k_pages.dtype)
    sub = max(sublane_rows(cdt), sublane_rows(q.dtype))  # q tile in cdt, output in q's dtype
    tq = common.round_up(block_q, sub // math.gcd(g, sub)) if block_q else default_block_q(g, nq)
    n_tiles = -(-nq // tq)
    rows = tq * g
    p = pages_per_compute_block or default_pages_per_compute_block(bs, mb)
    qf = common.fold_prefill_q(q, hkv, n_tiles * tq, g, d, cdt)  # [S, Hkv, Qp * G, D]
    scale_ops, scale_specs, scale_scratch = scale_operands(k_scales, v_scales, p, bs)
    kernel = functools.partial(_kernel, scale=float(scale), group=g, block_q=tq,
                               pages_per_block=p, max_blocks=mb, quantized=bool(scale_ops),
                               sliding_window=sliding_window, soft_cap=soft_cap)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(s, hkv, n_tiles),
        in_specs=[
            pl.BlockSpec((None, None, rows, d), lambda i, j, t, *_: (i, j, t, 0)),
            pl.BlockSpec(memory_space=pl.ANY),
            pl.BlockSpec(memory_space=pl.ANY),
            *scale_specs,
        ],
        out_specs=pl.BlockSpec((None, None, rows, d), lambda i, j, t, *_: (i, j, t, 0)),
        scratch_shapes=[
            pltpu.VMEM((2, p * bs, d), k_pages.dtype),
            pltpu.VMEM((2, p * bs, d), v_pages.dtype),
            pltpu.SemaphoreType.DMA((2, 2)),
            *scale_scratch,
        ],
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((s, hkv, n_tiles * rows, d), q.dtype),
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel")),
        interpret=interpret,
        name="paged_prefill_attention_tpu",
    )(block_tables.reshape(-1), kv_lens, q_lens, qf, k_pages, v_pages, *scale_ops)
    return common.unfold_prefill_o(out, nq, g, h, d)
