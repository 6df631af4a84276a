"""Pallas GPU (Triton lowering) paged prefill attention: Q > 1 query slots per sequence.

Grid (S, Hkv, Q tiles, K splits). Program (s, h, t, k) owns TQ query slots of sequence s and
the G query heads of kv head h, as the [R, Dp] tile of query-major rows (row = slot * Gp +
head, Gp = G padded to a power of two, R = TQ * Gp >= 16, Dp = D padded to a power of two
>= 16: what tl.dot needs). It walks the logical pages [k * PS, (k + 1) * PS) clipped to the
tile's causal horizon (keys up to the last position of its last valid query),
`pages_per_compute_block` pages per step with a dynamic trip count, so K/V pages are read
once per (kv head, query tile) and never past the horizon. Each program writes a normalized
partial output and its log-sum-exp; with K > 1 splits (long prefixes, few tiles) they are
merged in jnp afterwards, with K == 1 the partial is the answer.

Quantized pages (k_scales / v_scales given) are dequantized per step exactly as in the
decode kernel (pallas_gpu.py): scales gathered through the same page ids, applied to the
scores' and probabilities' columns in f32. sliding_window / soft_cap (static, reference.py):
with a window a tile's splits cover the pages from the first one holding a key inside the
window of its earliest query.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from . import common
from .pallas_gpu import (default_num_splits, default_pages_per_compute_block, dot_precision,
                         load_pages, page_ids, scale_inputs, scale_probs, scale_scores,
                         split_refs)


def default_block_q(group_p: int, num_q: int, target_rows: int = 64) -> int:
    """Query slots per tile (a power of two): about target_rows rows, >= 16 rows, and no
    more slots than Q needs."""
    tq = max(1, target_rows // group_p)
    tq = min(tq, common.next_pow2(num_q))
    return max(tq, common.next_pow2(-(-16 // group_p)))


def _kernel(bt_ref,  # [S, K * PS] int32 (whole)
            kv_lens_ref, q_lens_ref,  # [S] int32 (whole)
            q_ref,  # [R, Dp] block, R = TQ * Gp
            k_ref, v_ref,  # [Hkv, NB, BS, D] (whole)
            *refs,  # [k_scales, v_scales ([Hkv, NB, BS] f16, whole; quantized pages),]
            # o_ref: [R, Dp] f32 block, normalized partial output; lse_ref: [R] f32 block
            scale, group, block_q, pages_per_block, pages_per_split, max_blocks, quantized,
            sliding_window, soft_cap):
    ks_ref, vs_ref, o_ref, lse_ref = split_refs(refs, quantized)
    s, h = pl.program_id(0), pl.program_id(1)
    tile, split = pl.program_id(2), pl.program_id(3)
    _, nb, bs, _ = k_ref.shape
    rows, dp = q_ref.shape
    p = pages_per_block
    t = p * bs
    first_pos, n_valid, end = common.prefill_tile(kv_lens_ref[s], q_lens_ref[s], tile, block_q)
    n_pages = jnp.minimum((end + bs - 1) // bs, max_blocks)
    first = common.window_first_page(first_pos, bs, sliding_window) + split * pages_per_split
    last = jnp.minimum(first + pages_per_split, n_pages)
    n_iter = (jnp.maximum(last - first, 0) + p - 1) // p

    q = q_ref[...]  # [R, Dp]
    prec = dot_precision(q.dtype)
    row = jnp.arange(rows, dtype=jnp.int32)[:, None]  # [R, 1]

    def body(i, carry):
        m, l, acc = carry
        page0 = first + i * p
        ids = page_ids(bt_ref, s, page0, p, nb)
        page_tok = (page0 + jnp.arange(p, dtype=jnp.int32))[:, None] * bs  # [P, 1]
        rows_ok = page_tok + jnp.arange(bs, dtype=jnp.int32)[None, :] < end  # [P, BS]
        k = load_pages(k_ref, h, ids, rows_ok, dp, q.dtype)  # [T, Dp]
        v = load_pages(v_ref, h, ids, rows_ok, dp, q.dtype)  # [T, Dp]
        scores = plgpu.dot(q, k, trans_b=True, precision=prec) * scale  # [R, T] f32
        scores = common.soft_cap_scores(scale_scores(scores, ks_ref, h, ids, rows_ok), soft_cap)
        tok = page0 * bs + jnp.arange(t, dtype=jnp.int32)[None, :]  # [1, T]
        scores = common.causal_mask(scores, row, tok, first_pos, n_valid, group, sliding_window)

        def pv(pr):  # [R, T] f32 -> [R, Dp] f32
            pr = scale_probs(pr, vs_ref, h, ids, rows_ok)
            return plgpu.dot(pr.astype(v.dtype), v, precision=prec)

        return common.softmax_step(m, l, acc, scores, pv, keepdims=False)

    m0 = jnp.full((rows,), common.NEG_INF, jnp.float32)
    l0 = jnp.zeros((rows,), jnp.float32)
    acc0 = jnp.zeros((rows, dp), jnp.float32)
    m, l, acc = lax.fori_loop(0, n_iter, body, (m0, l0, acc0))
    out, lse = common.finalize(m, l, acc, keepdims=False)
    o_ref[...] = out
    lse_ref[...] = lse


def paged_prefill_attention_gpu(q, k_pages, v_pages, block_tables, kv_lens, q_lens, *, scale,
                                block_q=None, pages_per_compute_block=None, num_splits=None,
                                num_warps=4, num_stages=2, interpret=False,
                                k_scales=None, v_scales=None, sliding_window=None, soft_cap=None):
    """q [S, Q, H, D], pages [Hkv, NB, BS, D], block_tables [S, MB], kv_lens / q_lens [S]
    -> [S, Q, H, D] (semantics of `paged_attention_reference`).

    Unvalidated kernel entry (see ops.paged_attention); BS must be a power of two. block_q
    (query slots per tile) is rounded to a power of two giving >= 16 rows. Quantized pages:
    int8 / float8_e4m3fn with k_scales / v_scales [Hkv, NB, BS] float16 (both or neither).
    sliding_window / soft_cap: static options as in reference.py.
    """
    s, nq, h, d = q.shape
    hkv, _, bs, _ = k_pages.shape
    mb = block_tables.shape[1]
    g = h // hkv
    gp = common.next_pow2(g)
    tq = default_block_q(gp, nq)
    if block_q:
        tq = max(common.next_pow2(block_q), common.next_pow2(-(-16 // gp)))
    n_tiles = -(-nq // tq)
    rows, dp = tq * gp, max(16, common.next_pow2(d))
    p = pages_per_compute_block or default_pages_per_compute_block(bs)
    p = min(common.next_pow2(p), common.next_pow2(mb))
    p = max(p, common.next_pow2(-(-16 // bs)))  # >= 16 keys a step for tl.dot
    ksplit = num_splits or default_num_splits(mb, 4 * p, s * hkv * n_tiles)
    pps = common.round_up(-(-mb // ksplit), p)  # pages per split, multiple of P
    ksplit = -(-mb // pps)
    cdt = common.compute_dtype(q.dtype, k_pages.dtype)
    qf = common.fold_prefill_q(q, hkv, n_tiles * tq, gp, dp, cdt)  # [S, Hkv, Qp * Gp, Dp]
    # [S, K * PS]; a window shifts the splits by a page count that is no multiple of P: P more
    extra = 0 if sliding_window is None else p
    bt = jnp.pad(block_tables, ((0, 0), (0, ksplit * pps - mb + extra)))
    whole = pl.BlockSpec()  # full array; the kernel indexes it
    scale_ops, scale_specs = scale_inputs(k_scales, v_scales)
    kernel = functools.partial(_kernel, scale=float(scale), group=gp, block_q=tq,
                               pages_per_block=p, pages_per_split=pps, max_blocks=mb,
                               quantized=bool(scale_ops), sliding_window=sliding_window, soft_cap=soft_cap)
    o, lse = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((s, hkv, ksplit, n_tiles * rows, dp), jnp.float32),
                   jax.ShapeDtypeStruct((s, hkv, ksplit, n_tiles * rows), jnp.float32)),
        grid=(s, hkv, n_tiles, ksplit),
        in_specs=[whole, whole, whole,
                  pl.BlockSpec((None, None, rows, dp), lambda i, j, t, k: (i, j, t, 0)),
                  whole, whole, *scale_specs],
        out_specs=(pl.BlockSpec((None, None, None, rows, dp),
                                lambda i, j, t, k: (i, j, k, t, 0)),
                   pl.BlockSpec((None, None, None, rows), lambda i, j, t, k: (i, j, k, t))),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="paged_prefill_attention_gpu",
    )(bt, kv_lens, q_lens, qf, k_pages, v_pages, *scale_ops)
    out = o[:, :, 0] if ksplit == 1 else common.merge_splits(o, lse)  # [S, Hkv, Qp * Gp, Dp]
    return common.unfold_prefill_o(out, nq, gp, h, d).astype(q.dtype)
