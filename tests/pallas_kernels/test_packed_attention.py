"""Packed (ragged) paged attention: every backend against the packed reference, and the
packed reference against the padded one (an independent definition)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.pallas_kernels.paged_attention import (packed_attention_reference, packed_paged_attention,
                                            paged_attention_reference)
from pagedjax.pallas_kernels.paged_attention.cpu_native import available as native_available
from pagedjax.pallas_kernels.paged_attention.packed import from_rows, to_rows, token_sequence_ids
from test_paged_attention import _exact_f32_matmuls  # noqa: F401  (autouse: jnp paths in full f32)

# the compiled Pallas kernel of the backend JAX runs on (none on CPU): same cases as interpret mode
DEVICE_PALLAS = {"gpu": ["pallas_gpu"], "tpu": ["pallas_tpu"]}.get(jax.default_backend(), [])


def make_step(rng, q_lens, ctx_lens, *, h=4, hkv=2, d=32, bs=8, nb=40, mb=8, num_tokens=None, pad_seqs=1):
    """A packed step: sequence i has ctx_lens[i] cached tokens before its q_lens[i] new ones."""
    s = len(q_lens) + pad_seqs
    q_lens = list(q_lens) + [0] * pad_seqs
    kv_lens = [c + q for c, q in zip(list(ctx_lens) + [0] * pad_seqs, q_lens)]
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    t = num_tokens or int(cu[-1]) + 3  # a few tokens past the last sequence: owned by none
    tables = np.stack([rng.permutation(nb)[:mb] for _ in range(s)]).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((t, h, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((hkv, nb, bs, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((hkv, nb, bs, d)), jnp.float32)
    return q, k, v, jnp.asarray(tables), jnp.asarray(kv_lens, jnp.int32), jnp.asarray(cu)


def padded_equivalent(q, k, v, tables, kv_lens, cu):
    """The same step through the padded reference, one row per sequence."""
    cu = np.asarray(cu)
    q_lens = np.diff(cu)
    nq = max(int(q_lens.max()), 1)
    qp = np.zeros((len(q_lens), nq) + q.shape[1:], np.float32)
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        qp[i, :b - a] = np.asarray(q)[a:b]
    out = paged_attention_reference(jnp.asarray(qp), k, v, tables, kv_lens, jnp.asarray(q_lens, jnp.int32),
                                    scale=q.shape[-1] ** -0.5)
    packed = np.zeros(q.shape, np.float32)
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        packed[a:b] = np.asarray(out)[i, :b - a]
    return packed


STEPS = [  # (q_lens, cached tokens before them)
    ([1, 1, 1], [5, 17, 0]),  # decode only
    ([1, 7, 1, 20], [9, 0, 30, 12]),  # decode rows and prompt chunks mixed
    ([33], [0]),  # one prompt
    ([3, 1, 5], [10, 0, 3]),  # speculative-verification-like rows
]


@pytest.mark.parametrize("q_lens,ctx", STEPS)
def test_packed_reference_matches_padded_reference(q_lens, ctx):
    args = make_step(np.random.default_rng(0), q_lens, ctx)
    want = padded_equivalent(*args)
    got = packed_attention_reference(*args, scale=args[0].shape[-1] ** -0.5)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)
    assert np.all(np.asarray(got)[int(args[-1][-1]):] == 0)  # tokens no sequence owns


IMPLS = ["reference", "ragged", "chunked", "pallas_tpu_interpret", "pallas_gpu_interpret"] + DEVICE_PALLAS


@pytest.mark.parametrize("impl", IMPLS + (["native"] if native_available() else []))
@pytest.mark.parametrize("q_lens,ctx", STEPS)
def test_packed_backends_match_reference(impl, q_lens, ctx):
    args = make_step(np.random.default_rng(1), q_lens, ctx)
    want = packed_attention_reference(*args, scale=0.2)
    got = packed_paged_attention(*args, scale=0.2, impl=impl)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=3e-5)


@pytest.mark.parametrize("impl", ["ragged", "pallas_gpu_interpret", *DEVICE_PALLAS])
def test_decode_like_step_uses_one_row_per_token(impl):
    """T <= S: every token is its own decode row; a many-token sequence still works."""
    rng = np.random.default_rng(2)
    args = make_step(rng, [1, 2, 1], [4, 6, 0], num_tokens=6, pad_seqs=3)  # T = 6 = S
    want = packed_attention_reference(*args, scale=0.3)
    got = packed_paged_attention(*args, scale=0.3, impl=impl)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=3e-5)


def test_rows_round_trip():
    q, _, _, tables, kv_lens, cu = make_step(np.random.default_rng(3), [1, 19, 0, 4], [3, 0, 0, 2])
    q_rows, row_tables, row_kv, row_q, token_row, token_slot = to_rows(q, tables, kv_lens, cu, 8)
    assert q_rows.shape[0] == q.shape[0] // 8 + tables.shape[0]
    assert np.asarray(row_q).tolist()[:5] == [1, 8, 8, 3, 4]  # seq 1's 19 tokens take 3 rows
    assert np.asarray(row_kv).tolist()[:5] == [4, 8, 16, 19, 6]  # kv length at each row's last query
    back = from_rows(q_rows, token_row, token_slot)
    owned = int(cu[-1])
    np.testing.assert_array_equal(np.asarray(back)[:owned], np.asarray(q)[:owned])
    assert np.all(np.asarray(back)[owned:] == 0)


def test_row_layout_has_no_loop():
    """The packed -> rows layout runs in every layer of every step: no while loop (jnp's
    binary search is one, which XLA:GPU drives from the host, kernel by kernel)."""
    q, _, _, tables, kv_lens, cu = make_step(np.random.default_rng(3), [1, 19, 0, 4], [3, 0, 0, 2])
    for tile in (1, 8):
        hlo = jax.jit(to_rows, static_argnums=(4,)).lower(q, tables, kv_lens, cu, tile).as_text()
        assert "while" not in hlo


def test_token_sequence_ids_skip_empty_sequences():
    cu = jnp.asarray([0, 2, 2, 5, 5], jnp.int32)
    assert np.asarray(token_sequence_ids(cu, 7)).tolist() == [0, 0, 2, 2, 2, 4, 4]


def test_packed_inside_jit_and_bad_offsets_rejected():
    args = make_step(np.random.default_rng(4), [2, 1], [3, 5])
    f = jax.jit(lambda *a: packed_paged_attention(*a, impl="ragged"))
    np.testing.assert_allclose(np.asarray(f(*args)), np.asarray(packed_attention_reference(*args, scale=32 ** -0.5)),
                               atol=3e-5)
    with pytest.raises(ValueError, match="cu_q_lens must have"):
        packed_paged_attention(*args[:-1], args[-1][:-1])
    with pytest.raises(ValueError, match=r"\[T, H, D\]"):
        packed_paged_attention(args[0][None], *args[1:])
