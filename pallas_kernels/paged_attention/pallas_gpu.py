"""Pallas GPU (Triton lowering) paged decode attention (Q == 1), split-K / flash-decoding.

Grid (S, Hkv, K): program (s, h, k) owns logical pages [k * PS, (k + 1) * PS) of sequence s,
clipped to its valid pages, and walks them `pages_per_compute_block` pages at a time with a
dynamic trip count (no work past kv_lens). The G query heads of kv head h are the rows of
one [R, Dp] tile (R = G padded to >= 16 and Dp = D padded to a power of two >= 16, as
tl.dot needs), so each K/V page is loaded once per kv head. Each program writes a
normalized partial output and its log-sum-exp; the splits are merged in jnp afterwards.

Quantized pages (int8 / float8_e4m3fn data with float16 scales [Hkv, NB, BS], passed as
k_scales / v_scales): each step gathers the scales of its P pages through the same page ids
as the data ([P, BS] -> a [T] f32 row, masked rows 0), feeds the dots the raw page values
cast to the compute dtype (q's: exact for int8 and e4m3fn), and dequantizes on the fly:
scores[:, t] *= k_scale[t] before masking, and p[:, t] * v_scale[t] goes into the P.V dot;
the softmax state and the accumulator stay f32. The pool is never dequantized as a whole.

sliding_window / soft_cap (static, reference.py): with a window the splits cover the pages
from the first one holding a key inside the query's window (pages before it are never
loaded); soft_cap caps the scaled (dequantized) scores before masking.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from . import common


def gpu_supported(page_size: int) -> bool:
    """Triton blocks need power-of-two sizes."""
    return page_size & (page_size - 1) == 0


def default_pages_per_compute_block(page_size: int) -> int:
    """Pages per loop step: 64 tokens a step, at least 16 keys (tl.dot's minimum N)."""
    return max(1, 64 // page_size)


def default_num_splits(max_blocks: int, min_pages: int, programs: int) -> int:
    """Splits so that ~1024 programs run (programs = S * Hkv without splitting), each split
    keeping >= min_pages pages; at most 16. A guess to be tuned on the device."""
    want = -(-1024 // max(programs, 1))
    return max(1, min(16, want, max_blocks // max(min_pages, 1)))


def page_ids(bt_ref, seq, page0, pages: int, num_pages: int):
    """Physical ids of logical pages [page0, page0 + pages) of sequence seq, clamped into the
    pool (table entries past the end may be junk; their rows are masked off anyway)."""
    ids = bt_ref[seq, pl.ds(page0, pages)]  # [P]
    return jnp.minimum(jnp.maximum(ids, 0), num_pages - 1)


def load_pages(ref, head, ids, rows_ok, dim_p: int, dtype):
    """Gather pages ids [P] of kv head `head` from ref [Hkv, NB, BS, D] as a [P * BS, Dp]
    tile in dtype; rows where rows_ok [P, BS] is False and lanes >= D read as zeros."""
    _, _, bs, d = ref.shape
    p = ids.shape[0]
    lane = jnp.arange(dim_p, dtype=jnp.int32)[None, None, :]  # [1, 1, Dp]
    slot = jnp.arange(bs, dtype=jnp.int32)[None, :, None]  # [1, BS, 1]
    mask = rows_ok[:, :, None]
    if dim_p != d:  # padded head dim: clamp pad lanes in bounds, then mask them to 0
        lane, mask = jnp.minimum(lane, d - 1), mask & (lane < d)
    # else keep the plain range so Triton sees contiguous, vectorizable lanes
    mask = jnp.broadcast_to(mask, (p, bs, dim_p))
    x = plgpu.load(ref.at[head, ids[:, None, None], slot, lane], mask=mask,
                   other=jnp.zeros((), ref.dtype))
    return x.reshape(p * bs, dim_p).astype(dtype)


def load_scales(ref, head, ids, rows_ok):
    """Gather the scales of pages ids [P] of kv head `head` from ref [Hkv, NB, BS] (float16)
    as a [1, P * BS] f32 row (the key order of load_pages); rows_ok [P, BS] False -> 0."""
    bs = ref.shape[2]
    slot = jnp.arange(bs, dtype=jnp.int32)[None, :]  # [1, BS]
    x = plgpu.load(ref.at[head, ids[:, None], slot], mask=rows_ok, other=jnp.zeros((), ref.dtype))
    return x.reshape(1, ids.shape[0] * bs).astype(jnp.float32)


def split_refs(refs, quantized: bool):
    """(k scales ref, v scales ref, *the rest) of a kernel's refs after k_ref, v_ref: the
    scales come first when the pages are quantized, else (None, None, *refs)."""
    return tuple(refs) if quantized else (None, None, *refs)


def scale_scores(scores, ks_ref, head, ids, rows_ok):
    """Dequantize K on the fly: scores [R, T] times the keys' scales (no-op for plain pages)."""
    return scores if ks_ref is None else scores * load_scales(ks_ref, head, ids, rows_ok)


def scale_probs(pr, vs_ref, head, ids, rows_ok):
    """Dequantize V on the fly: p [R, T] times the values' scales (no-op for plain pages)."""
    return pr if vs_ref is None else pr * load_scales(vs_ref, head, ids, rows_ok)


def scale_inputs(k_scales, v_scales):
    """(extra operands, their BlockSpecs) for the scales of quantized pages (whole arrays)."""
    if k_scales is None:
        return (), []
    return (k_scales, v_scales), [pl.BlockSpec(), pl.BlockSpec()]


def dot_precision(dtype):
    return lax.Precision.HIGHEST if dtype == jnp.float32 else None


def _kernel(bt_ref,  # [S, K * PS] int32 (whole)
            lens_ref,  # [S] int32 (whole)
            q_ref,  # [R, Dp] block
            k_ref, v_ref,  # [Hkv, NB, BS, D] (whole)
            *refs,  # [k_scales, v_scales ([Hkv, NB, BS] f16, whole; quantized pages),]
            # o_ref: [R, Dp] f32 block, normalized partial output; lse_ref: [R] f32 block
            scale, pages_per_block, pages_per_split, max_blocks, quantized, sliding_window, soft_cap):
    ks_ref, vs_ref, o_ref, lse_ref = split_refs(refs, quantized)
    s, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    _, nb, bs, d = k_ref.shape
    rows, dp = q_ref.shape
    p = pages_per_block
    t = p * bs
    kv_len = lens_ref[s]
    n_pages = jnp.minimum((kv_len + bs - 1) // bs, max_blocks)
    first = common.window_first_page(kv_len - 1, bs, sliding_window) + split * pages_per_split
    last = jnp.minimum(first + pages_per_split, n_pages)
    n_iter = (jnp.maximum(last - first, 0) + p - 1) // p

    q = q_ref[...]  # [R, Dp]
    prec = dot_precision(q.dtype)

    def body(i, carry):
        m, l, acc = carry
        page0 = first + i * p
        ids = page_ids(bt_ref, s, page0, p, nb)
        page_tok = (page0 + jnp.arange(p, dtype=jnp.int32))[:, None] * bs  # [P, 1]
        rows_ok = page_tok + jnp.arange(bs, dtype=jnp.int32)[None, :] < kv_len  # [P, BS]
        k = load_pages(k_ref, h, ids, rows_ok, dp, q.dtype)  # [T, Dp]
        v = load_pages(v_ref, h, ids, rows_ok, dp, q.dtype)  # [T, Dp]
        scores = plgpu.dot(q, k, trans_b=True, precision=prec) * scale  # [R, T] f32
        scores = common.soft_cap_scores(scale_scores(scores, ks_ref, h, ids, rows_ok), soft_cap)
        tok = page0 * bs + jnp.arange(t, dtype=jnp.int32)[None, :]  # [1, T]
        scores = common.mask_scores(scores, tok, kv_len, sliding_window)

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


def paged_decode_attention_gpu(q, k_pages, v_pages, block_tables, kv_lens, *, scale,
                               pages_per_compute_block=None, num_splits=None,
                               num_warps=4, num_stages=2, interpret=False,
                               k_scales=None, v_scales=None, sliding_window=None, soft_cap=None):
    """q [S, H, D], pages [Hkv, NB, BS, D], block_tables [S, MB], kv_lens [S] -> [S, H, D].

    Unvalidated kernel entry (see ops.paged_decode_attention); BS must be a power of two.
    Quantized pages: k_pages / v_pages int8 or float8_e4m3fn with k_scales / v_scales
    [Hkv, NB, BS] float16 (both or neither), dequantized as each page is read.
    sliding_window / soft_cap: static options as in reference.py.
    """
    s, h, d = q.shape
    hkv, _, bs, _ = k_pages.shape
    mb = block_tables.shape[1]
    g = h // hkv
    p = pages_per_compute_block or default_pages_per_compute_block(bs)
    p = min(common.next_pow2(p), common.next_pow2(mb))
    p = max(p, common.next_pow2(-(-16 // bs)))  # >= 16 keys a step for tl.dot
    ksplit = num_splits or default_num_splits(mb, 4 * p, s * hkv)
    pps = common.round_up(-(-mb // ksplit), p)  # pages per split, multiple of P
    ksplit = -(-mb // pps)
    rows, dp = max(16, common.next_pow2(g)), max(16, common.next_pow2(d))
    cdt = common.compute_dtype(q.dtype, k_pages.dtype)
    qf = common.fold_decode_q(q, hkv, rows, dp, cdt)  # [S, Hkv, R, Dp]
    # [S, K * PS]; a window shifts the splits by a page count that is no multiple of P: P more
    extra = 0 if sliding_window is None else p
    bt = jnp.pad(block_tables, ((0, 0), (0, ksplit * pps - mb + extra)))
    whole = pl.BlockSpec()  # full array; the kernel indexes it
    scale_ops, scale_specs = scale_inputs(k_scales, v_scales)
    kernel = functools.partial(_kernel, scale=float(scale), pages_per_block=p,
                               pages_per_split=pps, max_blocks=mb, quantized=bool(scale_ops),
                               sliding_window=sliding_window, soft_cap=soft_cap)
    o, lse = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((s, hkv, ksplit, rows, dp), jnp.float32),
                   jax.ShapeDtypeStruct((s, hkv, ksplit, rows), jnp.float32)),
        grid=(s, hkv, ksplit),
        in_specs=[whole, whole,
                  pl.BlockSpec((None, None, rows, dp), lambda i, j, k: (i, j, 0, 0)),
                  whole, whole, *scale_specs],
        out_specs=(pl.BlockSpec((None, None, None, rows, dp), lambda i, j, k: (i, j, k, 0, 0)),
                   pl.BlockSpec((None, None, None, rows), lambda i, j, k: (i, j, k, 0))),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="paged_decode_attention_gpu",
    )(bt, kv_lens, qf, k_pages, v_pages, *scale_ops)
    out = common.merge_splits(o, lse)  # [S, Hkv, R, Dp]
    return common.unfold_decode_o(out, h, d).astype(q.dtype)
