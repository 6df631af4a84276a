"""XLA paged attention over a flat list of page units: the XLA path on CPU (the fallback
when the native kernel, cpu_native.py, cannot be built; any dtype).

Same contract as `paged_attention_reference` (see reference.py). `paged_attention_chunked`
walks a padded [S, chunk] slab of pages per step, so every sequence pays for the longest one
(one 2,000-token sequence among fifteen 200-token ones costs 16 x 2,000 tokens of gathers).
Here each sequence's pages are cut into units of U pages (U * BS tokens), the units of all
sequences are laid end to end in one list, and a dynamic-trip-count loop takes W units a
step: the work follows the tokens the sequences hold (plus < one unit of padding each), and
the causal horizon of each sequence (its last valid query) ends its list; with a sliding
window its first page inside the window of its earliest query starts it (pages before are
never read). Shapes stay static; one compile per [S, Q] bucket.

Per step: the W units' K/V pages are row-gathered from the pools viewed as
[Hkv * NB, BS * D] (indices computed once, before the loop, and clamped in range so the
gathers need no bounds handling); scores are taken against the queries of each unit's own
sequence; a per-unit max and a one-hot [S, W] merge fold the step into each sequence's
running (max, sum, acc) online softmax. How the scores are formed depends on the rows per
kv head (`score_form`). Measured with scripts/bench_kernels.py --cpu-decode.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from .kv_quant import load
from .reference import F32_DOTS, NEG_INF, cap_scores, first_window_page  # every dot here in f32

MUL_FORM_MAX_ROWS = 8


def score_form(rows: int) -> str:
    """How a step computes scores and P @ V for `rows` (Q * G) query rows per kv head.

    "dot":   rows > 8 (prefill): dot_general with scores [R, T], a matmul per kv head.
    "mul":   2..8 rows (GQA decode): broadcast-multiply + reduce, scores [T, R]; XLA:CPU
             runs these faster than tiny batched dots (about 1.3x on the SmolLM2 step).
    "dot_t": 1 row (MHA decode): dot_general with scores [T, R], K the non-transposed
             operand. The multiply form is pathological there (XLA:CPU materializes the
             broadcast product: 4-6x slower), so it is not used.
    Measured with scripts/bench_kernels.py --cpu-decode and --quick on XLA:CPU.
    """
    if rows > MUL_FORM_MAX_ROWS:
        return "dot"
    return "mul" if rows > 1 else "dot_t"


def default_unit_pages(page_size: int, rows: int) -> tuple[int, int]:
    """(pages per unit, units per step). Decode rows: 64-token units, 8 a step (small
    matmuls; batching units of many sequences pays). Prefill rows: one 128-token unit a
    step (each unit is already a [R, 128] matmul; more would only grow the intermediates
    past the caches and compute dead units)."""
    if rows <= MUL_FORM_MAX_ROWS:
        u = max(1, 64 // page_size)
        return u, max(1, 512 // (u * page_size))
    return max(1, 128 // page_size), 1


def _take_rows(x, idx):
    """x [N, W], idx [M] (in range) -> x[idx] [M, W], one contiguous row per index."""
    dn = lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,),
                                    start_index_map=(0,))
    return lax.gather(x, idx[:, None], dn, (1, x.shape[1]),
                      mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS)


def _fold_rows(q, num_kv_heads):
    """[S, Q, H, D] -> [S, Hkv, Q * G, D]; row = query * G + group head."""
    s, nq, h, d = q.shape
    g = h // num_kv_heads
    return q.reshape(s, nq, num_kv_heads, g, d).transpose(0, 2, 1, 3, 4).reshape(
        s, num_kv_heads, nq * g, d)


def _unfold_rows(o, num_q):
    """[S, Hkv, Q * G, D] -> [S, Q, H, D]."""
    s, hkv, r, d = o.shape
    g = r // num_q
    return o.reshape(s, hkv, num_q, g, d).transpose(0, 2, 1, 3, 4).reshape(s, num_q, hkv * g, d)


def _schedule(block_tables, row_pos, num_pages, page_size, unit_pages, units_per_step,
              num_kv_heads, first_page=None):
    """Flat unit list. Returns (page row ids [steps, W * Hkv * U], unit seq [steps, W],
    unit first token [steps, W], number of loop steps). first_page [S]: each sequence's
    units start there (None: at page 0)."""
    s, mb = block_tables.shape
    u, w = unit_pages, units_per_step
    tu = u * page_size
    mbu = -(-mb // u)  # units in a full table
    last = jnp.max(row_pos, axis=1)  # [S] last position any valid query sees (-1: none)
    if first_page is None:
        n_units = jnp.clip((last + tu) // tu, 0, mbu)  # [S]
    else:
        n_units = jnp.clip((last + 1 - first_page * page_size + tu - 1) // tu, 0, mbu)
    ends = jnp.cumsum(n_units)
    total = ends[-1]
    cap = -(-(s * mbu) // w) * w
    j = jnp.arange(cap, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, j, side="right"), s - 1).astype(jnp.int32)
    unit = j - (ends - n_units)[seq]  # unit index within its sequence
    live = j < total
    page = unit[:, None] * u + jnp.arange(u, dtype=jnp.int32)[None, :]  # [cap, U]
    if first_page is not None:
        page = page + first_page[seq][:, None]
    tables = jnp.pad(jnp.clip(block_tables, 0, num_pages - 1), ((0, 0), (0, mbu * u - mb)))
    phys = tables[seq[:, None], jnp.minimum(page, mbu * u - 1)]
    # Pages past a sequence's horizon (or its table) are never read: point them at page 0.
    used = live[:, None] & (page < mb) & (page * page_size <= last[seq][:, None])
    phys = jnp.where(used, phys, 0)
    heads = (jnp.arange(num_kv_heads, dtype=jnp.int32) * num_pages)[None, :, None]
    ids = (phys[:, None, :] + heads).reshape(cap // w, w * num_kv_heads * u)
    tok0 = unit * tu if first_page is None else unit * tu + first_page[seq] * page_size
    first_tok = jnp.where(live, tok0, jnp.iinfo(jnp.int32).max // 2).reshape(-1, w)
    return ids, seq.reshape(-1, w), first_tok, (total + w - 1) // w


def paged_attention_ragged(q, k_pages, v_pages, block_tables, kv_lens, q_lens, *, scale,
                           sliding_window=None, soft_cap=None,
                           pages_per_unit: int | None = None,
                           units_per_step: int | None = None):
    """Same result as `paged_attention_reference`; work follows each sequence's own length."""
    s, nq, h, d = q.shape
    hkv, nb, bs, _ = k_pages.shape
    g = h // hkv
    r = nq * g
    du, dw = default_unit_pages(bs, r)
    u, w = pages_per_unit or du, units_per_step or dw
    tu = u * bs
    form = score_form(r)
    key_major = form != "dot"
    t_axis = 2 if key_major else 3

    qr = _fold_rows(q, hkv).astype(jnp.float32) * scale  # [S, Hkv, R, D]
    qpos = (kv_lens - q_lens)[:, None] + jnp.arange(nq, dtype=jnp.int32)[None, :]
    qpos = jnp.where(jnp.arange(nq)[None, :] < q_lens[:, None], qpos, -1)  # -1: padding
    qpos = jnp.minimum(qpos, block_tables.shape[1] * bs - 1)  # keys exist only in the table
    row_pos = jnp.repeat(qpos, g, axis=1)  # [S, R] last key position each row sees
    first_page = None
    if sliding_window is not None:  # first key position each row sees (padding rows see none anyway)
        row_lo = jnp.repeat((kv_lens - q_lens)[:, None] + jnp.arange(nq, dtype=jnp.int32)[None, :]
                            - (sliding_window - 1), g, axis=1)  # [S, R]
        first_page = first_window_page(kv_lens, q_lens, bs, sliding_window)
    ids, seqs, first_tok, steps = _schedule(block_tables, row_pos, nb, bs, u, w, hkv, first_page)
    # a page per row: [Hkv * NB, BS * D] (and [Hkv * NB, BS] scales), a unit of pages as [W, Hkv, TU, D]
    take = lambda ids: lambda pages: _take_rows(pages.reshape(hkv * nb, -1), ids).reshape(w, hkv, tu, -1)
    seq_ids = jnp.arange(s, dtype=jnp.int32)

    def body(i, carry):
        m, l, acc = carry  # [S, Hkv, R], [S, Hkv, R], [S, Hkv, R, D]
        sq = seqs[i]  # [W] sequence of each unit
        k, v = load(k_pages, take(ids[i])), load(v_pages, take(ids[i]))  # [W, Hkv, TU, D] float32
        qu = qr[sq]  # [W, Hkv, R, D]
        tok = first_tok[i][:, None] + jnp.arange(tu, dtype=jnp.int32)[None, :]  # [W, TU]
        if key_major:  # scores [W, Hkv, TU, R]
            if form == "mul":
                sc = jnp.sum(k[:, :, :, None, :] * qu[:, :, None, :, :], axis=-1)
            else:  # K as the non-transposed dot operand
                sc = jnp.einsum("wktd,wkrd->wktr", k, qu, precision=F32_DOTS)
            vis = tok[:, :, None] <= row_pos[sq][:, None, :]  # [W, TU, R]
            if sliding_window is not None:
                vis &= tok[:, :, None] >= row_lo[sq][:, None, :]
        else:  # scores [W, Hkv, R, TU]
            sc = jnp.einsum("wkrd,wktd->wkrt", qu, k, precision=F32_DOTS)
            vis = tok[:, None, :] <= row_pos[sq][:, :, None]  # [W, R, TU]
            if sliding_window is not None:
                vis &= tok[:, None, :] >= row_lo[sq][:, :, None]
        sc = jnp.where(vis[:, None], cap_scores(sc, soft_cap), NEG_INF)
        m_unit = jnp.max(sc, axis=t_axis)  # [W, Hkv, R]
        onehot = sq[None, :] == seq_ids[:, None]  # [S, W]
        m_step = jnp.max(jnp.where(onehot[:, :, None, None], m_unit[None], NEG_INF), axis=1)
        m_new = jnp.maximum(m, m_step)
        m_safe = jnp.where(m_new > NEG_INF, m_new, 0.0)
        alpha = jnp.exp(m - m_safe)  # 0 where m was -inf (l, acc are 0 there)
        p = jnp.exp(sc - jnp.expand_dims(m_safe[sq], t_axis))  # vs each unit's sequence max
        l_unit = jnp.sum(p, axis=t_axis)
        if form == "mul":
            o_unit = jnp.sum(p[..., None] * v[:, :, :, None, :], axis=2)  # [W, Hkv, R, D]
        elif form == "dot_t":
            o_unit = jnp.einsum("wkrt,wktd->wkrd", p.transpose(0, 1, 3, 2), v, precision=F32_DOTS)
        else:
            o_unit = jnp.einsum("wkrt,wktd->wkrd", p, v, precision=F32_DOTS)
        oh = onehot.astype(jnp.float32)
        l_new = alpha * l + jnp.einsum("sw,wkr->skr", oh, l_unit, precision=F32_DOTS)
        acc_new = alpha[..., None] * acc + jnp.einsum("sw,wkrd->skrd", oh, o_unit,
                                                      precision=F32_DOTS)
        return m_new, l_new, acc_new

    m0 = jnp.full((s, hkv, r), NEG_INF, jnp.float32)
    l0 = jnp.zeros((s, hkv, r), jnp.float32)
    acc0 = jnp.zeros((s, hkv, r, d), jnp.float32)
    _, l, acc = lax.fori_loop(0, steps, body, (m0, l0, acc0))
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    return _unfold_rows(out, nq).astype(q.dtype)
