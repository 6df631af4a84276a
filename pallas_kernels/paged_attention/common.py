"""Math shared by the kernels: GQA row folding, masking, online softmax, split merge.

Written with plain jnp ops on 1-D/2-D arrays only, so the same helpers trace inside a
Mosaic (TPU) body, a Triton (GPU) body, and plain jnp code.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from . import kv_quant

NEG_INF = float("-inf")


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def compute_dtype(q_dtype, page_dtype):
    """Dtype the kernels feed their dots: the pages' dtype. bf16 pages: q is rounded to bf16
    (as a bf16 KV cache is read everywhere: the MXU / tensor cores' native input, one pass,
    K and V tiles never widened); f32 pages: f32 (a bf16 q widened, exact). The dots
    accumulate in f32 either way, and the softmax state is f32.

    Quantized pages (int8 / float8_e4m3fn, kv_quant.QuantizedPages): q's dtype. The kernels
    feed the dots the raw page values (every int8 and e4m3fn value is exact in bf16 and f32)
    and apply the per-token scales outside them: K's to the scores' columns, V's to the
    probabilities' columns, both in f32. An f32 q: f32 dots (exact up to f32 rounding); a
    bf16 q: bf16 dots, only the scaled probabilities rounded to bf16 (as with bf16 pages)."""
    if kv_quant.is_quantized(page_dtype):
        return jnp.dtype(q_dtype)
    return jnp.dtype(page_dtype)


def fold_decode_q(q: jax.Array, num_kv_heads: int, rows: int, dim: int, dtype) -> jax.Array:
    """[S, H, D] -> [S, Hkv, rows, dim] (G query heads of a kv head as rows, zero padded)."""
    s, h, d = q.shape
    g = h // num_kv_heads
    qg = q.reshape(s, num_kv_heads, g, d).astype(dtype)  # [S, Hkv, G, D]
    return jnp.pad(qg, ((0, 0), (0, 0), (0, rows - g), (0, dim - d)))


def unfold_decode_o(o: jax.Array, num_heads: int, dim: int) -> jax.Array:
    """[S, Hkv, rows, dim'] -> [S, H, D] (drops the row and lane padding)."""
    s, hkv = o.shape[:2]
    g = num_heads // hkv
    return o[:, :, :g, :dim].reshape(s, num_heads, dim)


def fold_prefill_q(q: jax.Array, num_kv_heads: int, num_q: int, group: int, dim: int,
                   dtype) -> jax.Array:
    """[S, Q, H, D] -> [S, Hkv, Qp * Gp, Dp]: query-major rows (row = query * Gp + head).

    The G query heads of a kv head are padded to Gp (>= G) rows and the Q slots to Qp, all
    with zeros; a tile of TQ queries is then TQ * Gp consecutive rows.
    """
    s, nq, h, d = q.shape
    g = h // num_kv_heads
    qg = q.reshape(s, nq, num_kv_heads, g, d).astype(dtype).transpose(0, 2, 1, 3, 4)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, num_q - nq), (0, group - g), (0, dim - d)))
    return qg.reshape(s, num_kv_heads, num_q * group, dim)


def unfold_prefill_o(o: jax.Array, num_q: int, group: int, num_heads: int,
                     dim: int) -> jax.Array:
    """[S, Hkv, Qp * Gp, Dp] -> [S, Q, H, D] (drops query, head and lane padding)."""
    s, hkv, rows, dp = o.shape
    g = num_heads // hkv
    o = o.reshape(s, hkv, rows // group, group, dp)[:, :, :num_q, :g, :dim]
    return o.transpose(0, 2, 1, 3, 4).reshape(s, num_q, num_heads, dim)


def prefill_tile(kv_len, q_len, tile, q_tile: int):
    """Query tile `tile` (TQ = q_tile slots) of a sequence.

    Returns (first_pos, n_valid, end): the absolute position of the tile's first query slot,
    how many of its slots are valid queries, and one past the last position any of them
    attends to (0 for an empty tile), i.e. the tile needs keys [0, end).
    """
    first_q = tile * q_tile
    first_pos = kv_len - q_len + first_q
    n_valid = jnp.clip(q_len - first_q, 0, q_tile)
    end = jnp.where(n_valid > 0, jnp.maximum(first_pos + n_valid, 0), 0)
    return first_pos, n_valid, end


def window_first_page(first_pos, page_size: int, sliding_window):
    """First page holding a key inside the window of a query at first_pos (0 without a
    window): where a walk over the pages of that query and later ones starts."""
    if sliding_window is None:
        return 0
    return jnp.maximum(first_pos - (sliding_window - 1), 0) // page_size


def soft_cap_scores(scores: jax.Array, soft_cap) -> jax.Array:
    """soft_cap * tanh(scores / soft_cap) (None: scores as they are)."""
    if soft_cap is None:
        return scores
    return soft_cap * jnp.tanh(scores / soft_cap)


def causal_mask(scores: jax.Array, row, tok, first_pos, n_valid, group: int,
                sliding_window=None) -> jax.Array:
    """Prefill masking of scores [R, T] for a tile of query-major rows.

    Row r is query slot r // group of the tile, at position first_pos + r // group; it sees
    key positions tok <= that position (and, with a window W, > that position - W), and
    nothing when r // group >= n_valid. Written without integer division: r // group >= x
    <=>  r >= x * group; r // group < x  <=>  r < x * group.
    """
    ok = (row >= (tok - first_pos) * group) & (row < n_valid * group)
    if sliding_window is not None:
        ok &= row < (tok - first_pos + sliding_window) * group
    return jnp.where(ok, scores, NEG_INF)


def mask_scores(scores: jax.Array, tok: jax.Array, kv_len, sliding_window=None) -> jax.Array:
    """scores [R, T] with keys at absolute positions tok (broadcastable to [R, T]).

    Decode (Q == 1): the query sits at kv_len - 1, so causality is `tok < kv_len` (and a
    window W keeps tok >= kv_len - W).
    """
    ok = tok < kv_len
    if sliding_window is not None:
        ok &= tok >= kv_len - sliding_window
    return jnp.where(ok, scores, NEG_INF)


def softmax_step(m, l, acc, scores, pv, *, keepdims: bool):
    """One online-softmax step over a chunk of keys (same math as `online_softmax_update`).

    m, l: running max / sum, [R, 1] if keepdims else [R]; acc: [R, Dv] f32;
    scores: [R, T] f32 (masked entries -inf); pv: p [R, T] f32 -> p @ values [R, Dv] f32.
    Rows with no valid key so far keep m = -inf, l = 0, acc = 0.
    """
    col = (lambda x: x) if keepdims else (lambda x: x[:, None])
    m_new = jnp.maximum(m, jnp.max(scores, axis=-1, keepdims=keepdims))
    m_safe = jnp.where(m_new > NEG_INF, m_new, 0.0)
    alpha = jnp.exp(m - m_safe)
    p = jnp.exp(scores - col(m_safe))
    l_new = alpha * l + jnp.sum(p, axis=-1, keepdims=keepdims)
    acc_new = col(alpha) * acc + pv(p)
    return m_new, l_new, acc_new


def finalize(m, l, acc, *, keepdims: bool):
    """-> (out [R, Dv] = acc / l (0 where l == 0), lse = m + log l (-inf where l == 0))."""
    col = (lambda x: x) if keepdims else (lambda x: x[:, None])
    ok = l > 0
    l_safe = jnp.where(ok, l, 1.0)
    out = jnp.where(col(ok), acc / col(l_safe), 0.0)
    lse = jnp.where(ok, m + jnp.log(l_safe), NEG_INF)
    return out, lse


def merge_splits(o: jax.Array, lse: jax.Array) -> jax.Array:
    """Log-sum-exp merge of split-K partials.

    o: [..., K, R, D] f32 normalized partials; lse: [..., K, R] (-inf for empty splits).
    Returns [..., R, D] (zeros where every split is empty).
    """
    top = jnp.max(lse, axis=-2, keepdims=True)  # [..., 1, R]
    top = jnp.where(top > NEG_INF, top, 0.0)
    w = jnp.exp(lse - top)  # [..., K, R]; 0 for empty splits
    den = jnp.sum(w, axis=-2)  # [..., R]
    num = jnp.sum(w[..., None] * o, axis=-3)  # [..., R, D]
    return jnp.where(den[..., None] > 0, num / jnp.where(den > 0, den, 1.0)[..., None], 0.0)
