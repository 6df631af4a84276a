"""Pallas TPU (Mosaic) paged decode attention (Q == 1).

Grid (S, Hkv), both parallel. Block tables (flattened to 1-D, SMEM-friendly) and kv_lens
arrive by scalar prefetch; the page pools stay in HBM (memory space ANY). Each grid step
walks only its sequence's valid pages, `pages_per_compute_block` pages per step of a
dynamic-trip-count loop, copying page by page into a two-slot VMEM buffer: block i + 1 is
in flight while block i is computed. The G query heads of the kv head are the rows of one
[R, D] tile (R = G padded to the sublane tile), so K/V are read once per kv head.

Quantized pages (int8 / float8_e4m3fn data, k_scales / v_scales [Hkv, NB, BS] float16 in
HBM beside them): each page's [BS] scale row is DMA'd with its data page, through the same
block-table entry, into row j of a [2, P, BS] VMEM buffer (one row per page, the whole lane
extent of the row, on its own semaphores). A compute block reads its [P, BS] scales as a
[1, T] f32 row and dequantizes on the fly: the dots take the raw 8-bit values cast to the
compute dtype (q's; exact), the scores' columns are multiplied by the K scales and the
probabilities' columns by the V scales, in f32. Page size: a multiple of 32 (the 8-bit data
tile's rows, `tpu_supported`). sliding_window / soft_cap (static, reference.py): with a window
the walk starts at the first page holding a key inside the query's window (pages before are
never copied), and the mask keeps the window; soft_cap caps the scaled scores before masking.
Not yet run on a TPU (interpret mode only): the [P, BS] ->
[1, T] reshape is a small relayout Mosaic may lower slowly (or, for BS < 128, refuse).
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
    """Pages land at row offsets j * BS of the VMEM buffer; keep them tile aligned (8 rows
    for f32, 16 for bf16, 32 for int8 / float8_e4m3fn pages)."""
    return page_size % sublane_rows(page_dtype) == 0


def default_pages_per_compute_block(page_size: int, max_blocks: int) -> int:
    return max(1, min(max_blocks, 256 // page_size))


def page_loop(bt_ref, seq, head, k_hbm, v_hbm, k_buf, v_buf, sems, *, n_pages, limit,
              pages_per_block, max_blocks, step, init, scales=None, first_page=0):
    """Fold `step(tok0, k [T, D], v [T, D], ks, vs, carry)` over the compute blocks of P pages
    covering logical pages [first_page, n_pages) of sequence `seq`, kv head `head` (T = P * BS;
    tok0: the absolute position of the block's first key).

    Pages are copied one by one from HBM into a two-slot VMEM buffer, block i + 1 in flight
    while block i is computed; only pages < n_pages are copied. V rows of tokens >= limit
    are zeroed (pages that were not copied hold stale data, and 0 * NaN would leak); K rows
    there are left as they are, so `step` must mask their scores.

    scales: None (ks, vs are None) or (ks_hbm, vs_hbm [Hkv, NB, BS], ks_buf, vs_buf
    [2, P, BS] VMEM, scale_sems [2, 2]) for quantized pages: each page's scale row is copied
    with it; ks, vs are then the block's scales as [1, T] f32 rows (vs zeroed past limit).
    """
    bs = k_hbm.shape[2]
    p = pages_per_block
    t = p * bs
    n_blocks = (n_pages - first_page + p - 1) // p  # <= 0: nothing to walk

    def page_copies(i, slot):
        """(condition, k copy, v copy) for each page of compute block i."""
        out = []
        for j in range(p):
            page = first_page + i * p + j
            ok = page < n_pages
            pid = bt_ref[seq * max_blocks + jnp.minimum(page, max_blocks - 1)]
            dst = pl.ds(j * bs, bs)
            copies = [pltpu.make_async_copy(k_hbm.at[head, pid], k_buf.at[slot, dst],
                                            sems.at[0, slot]),
                      pltpu.make_async_copy(v_hbm.at[head, pid], v_buf.at[slot, dst],
                                            sems.at[1, slot])]
            if scales is not None:  # the page's [BS] scale rows, into row j
                ks_hbm, vs_hbm, ks_buf, vs_buf, scale_sems = scales
                copies += [pltpu.make_async_copy(ks_hbm.at[head, pid], ks_buf.at[slot, j],
                                                 scale_sems.at[0, slot]),
                           pltpu.make_async_copy(vs_hbm.at[head, pid], vs_buf.at[slot, j],
                                                 scale_sems.at[1, slot])]
            out.append((ok, copies))
        return out

    def start(i, slot):
        for ok, copies in page_copies(i, slot):
            @pl.when(ok)
            def _():
                for c in copies:
                    c.start()

    def wait(i, slot):
        for ok, copies in page_copies(i, slot):
            @pl.when(ok)
            def _():
                for c in copies:
                    c.wait()

    start(0, 0)

    def body(i, carry):
        slot = i % 2

        @pl.when(i + 1 < n_blocks)
        def _():
            start(i + 1, 1 - slot)

        wait(i, slot)
        k = k_buf[slot]  # [T, D]
        v = v_buf[slot]
        tok0 = first_page * bs + i * t
        v_tok = tok0 + lax.broadcasted_iota(jnp.int32, v.shape, 0)
        v = jnp.where(v_tok < limit, v, jnp.zeros_like(v))
        ks = vs = None
        if scales is not None:
            ks_buf, vs_buf = scales[2], scales[3]
            ks = ks_buf[slot].astype(jnp.float32).reshape(1, t)  # [P, BS] -> [1, T]
            vs = vs_buf[slot].astype(jnp.float32).reshape(1, t)
            s_tok = tok0 + lax.broadcasted_iota(jnp.int32, vs.shape, 1)
            vs = jnp.where(s_tok < limit, vs, 0.0)
        return step(tok0, k, v, ks, vs, carry)

    return lax.fori_loop(0, n_blocks, body, init)


def dot_precision(dtype):
    return lax.Precision.HIGHEST if dtype == jnp.float32 else None


def attend_step(q, scale, mask, soft_cap=None):
    """Online-softmax step for the rows of q [R, D] against a [T, D] K/V block; `mask(tok0,
    scores)` masks the [R, T] scores of the block whose first key sits at tok0. ks, vs: None,
    or the block's K / V scales as [1, T] f32 rows (quantized pages: k and v hold the raw
    8-bit values). soft_cap: the scaled (dequantized) scores are capped before masking."""
    prec = dot_precision(q.dtype)

    def step(tok0, k, v, ks, vs, carry):
        m, l, acc = carry
        k = k.astype(q.dtype)
        v = v.astype(q.dtype)
        scores = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=prec,
                                 preferred_element_type=jnp.float32) * scale  # [R, T]
        if ks is not None:
            scores = scores * ks  # dequantize K: each key's column times its scale
        scores = mask(tok0, common.soft_cap_scores(scores, soft_cap))

        def pv(pr):  # [R, T] f32 -> [R, D] f32
            if vs is not None:
                pr = pr * vs  # dequantize V: each value's weight times its scale
            return lax.dot_general(pr.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                   precision=prec, preferred_element_type=jnp.float32)

        return common.softmax_step(m, l, acc, scores, pv, keepdims=True)

    return step


def init_carry(rows, dim):
    return (jnp.full((rows, 1), common.NEG_INF, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            jnp.zeros((rows, dim), jnp.float32))


def scale_operands(k_scales, v_scales, pages_per_block, page_size):
    """(extra operands, their specs, extra scratch) for the scales of quantized pages: the
    scale pools stay in HBM, a [2, P, BS] VMEM buffer each and a [2, 2] DMA semaphore."""
    if k_scales is None:
        return (), [], []
    buf = (2, pages_per_block, page_size)
    return ((k_scales, v_scales), [pl.BlockSpec(memory_space=pl.ANY)] * 2,
            [pltpu.VMEM(buf, k_scales.dtype), pltpu.VMEM(buf, v_scales.dtype),
             pltpu.SemaphoreType.DMA((2, 2))])


def split_refs(refs, quantized: bool):
    """Kernel refs after k_hbm, v_hbm -> (o_ref, k_buf, v_buf, sems, scales or None)."""
    if not quantized:
        o_ref, k_buf, v_buf, sems = refs
        return o_ref, k_buf, v_buf, sems, None
    ks_hbm, vs_hbm, o_ref, k_buf, v_buf, sems, ks_buf, vs_buf, scale_sems = refs
    return o_ref, k_buf, v_buf, sems, (ks_hbm, vs_hbm, ks_buf, vs_buf, scale_sems)


def _kernel(bt_ref, lens_ref,  # SMEM: [S * MB], [S]
            q_ref,  # VMEM [R, D]
            k_hbm, v_hbm,  # HBM [Hkv, NB, BS, D]
            *refs,  # [k_scales, v_scales: HBM [Hkv, NB, BS] f16 (quantized pages),]
            # o_ref: VMEM [R, D]; k_buf, v_buf: VMEM [2, T, D], T = P * BS; sems: DMA
            # semaphores [2 (k/v), 2 (slot)]; [ks_buf, vs_buf: VMEM [2, P, BS]; scale sems]
            scale, pages_per_block, max_blocks, quantized, sliding_window, soft_cap):
    o_ref, k_buf, v_buf, sems, scales = split_refs(refs, quantized)
    s, h = pl.program_id(0), pl.program_id(1)
    bs = k_hbm.shape[2]
    kv_len = lens_ref[s]
    n_pages = jnp.minimum((kv_len + bs - 1) // bs, max_blocks)
    q = q_ref[...]  # [R, D]
    rows, d = q.shape

    def mask(tok0, scores):
        tok = tok0 + lax.broadcasted_iota(jnp.int32, scores.shape, 1)
        return common.mask_scores(scores, tok, kv_len, sliding_window)

    m, l, acc = page_loop(bt_ref, s, h, k_hbm, v_hbm, k_buf, v_buf, sems, n_pages=n_pages,
                          limit=kv_len, pages_per_block=pages_per_block,
                          max_blocks=max_blocks, step=attend_step(q, scale, mask, soft_cap),
                          init=init_carry(rows, d), scales=scales,
                          first_page=common.window_first_page(kv_len - 1, bs, sliding_window))
    out, _ = common.finalize(m, l, acc, keepdims=True)
    o_ref[...] = out.astype(o_ref.dtype)


def paged_decode_attention_tpu(q, k_pages, v_pages, block_tables, kv_lens, *, scale,
                               pages_per_compute_block=None, interpret=False,
                               k_scales=None, v_scales=None, sliding_window=None, soft_cap=None):
    """q [S, H, D], pages [Hkv, NB, BS, D], block_tables [S, MB], kv_lens [S] -> [S, H, D].

    Unvalidated kernel entry (see ops.paged_decode_attention). `interpret` may be a bool
    or a `pltpu.InterpretParams`. Quantized pages: int8 / float8_e4m3fn with k_scales /
    v_scales [Hkv, NB, BS] float16 (both or neither), dequantized per compute block.
    sliding_window / soft_cap: static options as in reference.py.
    """
    s, h, d = q.shape
    hkv, _, bs, _ = k_pages.shape
    mb = block_tables.shape[1]
    g = h // hkv
    p = pages_per_compute_block or default_pages_per_compute_block(bs, mb)
    cdt = common.compute_dtype(q.dtype, k_pages.dtype)
    rows = common.round_up(g, sublane_rows(cdt))
    qf = common.fold_decode_q(q, hkv, rows, d, cdt)  # [S, Hkv, R, D]
    scale_ops, scale_specs, scale_scratch = scale_operands(k_scales, v_scales, p, bs)
    kernel = functools.partial(_kernel, scale=float(scale), pages_per_block=p, max_blocks=mb,
                               quantized=bool(scale_ops), sliding_window=sliding_window, soft_cap=soft_cap)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(s, hkv),
        in_specs=[
            pl.BlockSpec((None, None, rows, d), lambda i, j, *_: (i, j, 0, 0)),
            pl.BlockSpec(memory_space=pl.ANY),
            pl.BlockSpec(memory_space=pl.ANY),
            *scale_specs,
        ],
        out_specs=pl.BlockSpec((None, None, rows, d), lambda i, j, *_: (i, j, 0, 0)),
        scratch_shapes=[
            pltpu.VMEM((2, p * bs, d), k_pages.dtype),
            pltpu.VMEM((2, p * bs, d), v_pages.dtype),
            pltpu.SemaphoreType.DMA((2, 2)),
            *scale_scratch,
        ],
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((s, hkv, rows, d), q.dtype),
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
        name="paged_decode_attention_tpu",
    )(block_tables.reshape(-1), kv_lens, qf, k_pages, v_pages, *scale_ops)  # [S, Hkv, R, D]
    return common.unfold_decode_o(out, h, d)
