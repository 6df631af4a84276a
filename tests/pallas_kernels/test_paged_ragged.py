"""The XLA paths (`paged_attention_ragged`, `paged_attention_chunked`) against the reference."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedjax.pallas_kernels import paged_attention, paged_attention_reference, paged_decode_attention
from pagedjax.pallas_kernels.paged_attention.ragged import paged_attention_ragged
from pagedjax.pallas_kernels.paged_attention.reference import paged_attention_chunked
from test_paged_attention import BF16, F32, _exact_f32_matmuls, assert_close  # noqa: F401


def make_batch(bs, hkv, g, d, dtype, seqs, nq, mb, seed=0, junk_tail=True):
    """seqs: (q_len, kv_len) per sequence. Returns (q, k, v, tables, kv_lens, q_lens)."""
    rng = np.random.default_rng(seed)
    s = len(seqs)
    nb = s * mb
    q = jnp.asarray(rng.standard_normal((s, nq, hkv * g, d)), dtype)
    k = jnp.asarray(rng.standard_normal((hkv, nb, bs, d)), dtype)
    v = jnp.asarray(rng.standard_normal((hkv, nb, bs, d)), dtype)
    tables = rng.permutation(nb).reshape(s, mb).astype(np.int32)
    if junk_tail:  # entries past each sequence's pages must never be read
        for i, (_, kv) in enumerate(seqs):
            tables[i, -(-kv // bs):] = -1
    q_lens = jnp.asarray([ql for ql, _ in seqs], jnp.int32)
    kv_lens = jnp.asarray([kv for _, kv in seqs], jnp.int32)
    return q, k, v, jnp.asarray(tables), kv_lens, q_lens


def check(fn, args, dtype, scale=0.2):
    out = jax.jit(functools.partial(fn, scale=scale))(*args)
    ref = paged_attention_reference(*args, scale=scale)
    assert_close(out, ref, dtype)
    for i, n in enumerate(np.asarray(args[-1])):  # padding slots / rows are exact zeros
        assert not np.any(np.asarray(out[i, n:], np.float32))
    return out


# Decode rows (Q * G <= 8: broadcast-multiply forms) and prefill rows (dot forms).
@pytest.mark.parametrize("bs,g,d,dtype", [(16, 3, 64, F32), (8, 1, 48, BF16),
                                          (32, 8, 128, F32), (16, 2, 64, BF16)])
@pytest.mark.parametrize("unit,step", [(None, None), (1, 3), (2, 1)])
def test_ragged_decode(bs, g, d, dtype, unit, step):
    mb = 8
    # one long sequence among short ones, an empty row, kv_len 0, exactly a page, the table
    seqs = [(1, 3), (1, mb * bs), (0, 9), (1, 0), (1, bs), (1, 2 * bs + 1)]
    args = make_batch(bs, 2, g, d, dtype, seqs, 1, mb)
    fn = functools.partial(paged_attention_ragged, pages_per_unit=unit, units_per_step=step)
    check(fn, args, dtype)


@pytest.mark.parametrize("bs,g,nq,unit,step", [(8, 2, 6, None, None), (16, 4, 5, 1, 2),
                                               (8, 1, 3, 3, 2), (32, 1, 12, None, 1)])
def test_ragged_prefill(bs, g, nq, unit, step):
    mb = 6
    # fresh prefill, partial-block prefix + padded slots, several blocks of prefix, empty row,
    # decode-like row
    seqs = [(nq, nq), (nq - 2, nq - 2 + bs // 2 + 1), (nq, nq + 3 * bs + 2), (0, 5),
            (1, mb * bs - 2)]
    args = make_batch(bs, 2, g, 32, F32, seqs, nq, mb, seed=1)
    fn = functools.partial(paged_attention_ragged, pages_per_unit=unit, units_per_step=step)
    check(fn, args, F32)


def test_ragged_through_the_wrapper():
    args = make_batch(16, 3, 3, 64, F32, [(1, 40), (1, 7)], 1, 4)
    out = paged_attention(*args, scale=0.125, impl="ragged")
    np.testing.assert_array_equal(np.asarray(out), np.asarray(paged_attention_ragged(*args, scale=0.125)))
    dec = paged_decode_attention(args[0][:, 0], *args[1:5], scale=0.125, impl="ragged")
    assert_close(dec, paged_attention_reference(*args, scale=0.125)[:, 0], F32)


# Fixed shapes (one compile per path); hypothesis draws lengths and tables.
_S, _Q, _BS, _MB, _NB = 4, 3, 4, 5, 24


@functools.lru_cache(maxsize=None)
def _jitted(name):
    from pagedjax.pallas_kernels.paged_attention.cpu_native import paged_attention_native

    fn = {"ragged": functools.partial(paged_attention_ragged, pages_per_unit=2,
                                      units_per_step=2),
          "chunked": functools.partial(paged_attention_chunked, blocks_per_chunk=2),
          "native": paged_attention_native,
          "reference": paged_attention_reference}[name]
    return jax.jit(functools.partial(fn, scale=0.3))


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_cpu_paths_property(data):
    from pagedjax.pallas_kernels.paged_attention.ops import native_supported

    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1)))
    kv = [data.draw(st.integers(0, _MB * _BS)) for _ in range(_S)]
    ql = [data.draw(st.integers(0, min(_Q, n))) for n in kv]
    h = data.draw(st.sampled_from([2, 4, 8]))  # Q * G = 3, 6 rows: multiply forms; 12: dots
    q = jnp.asarray(rng.standard_normal((_S, _Q, h, 8)), F32)
    k = jnp.asarray(rng.standard_normal((2, _NB, _BS, 8)), F32)
    v = jnp.asarray(rng.standard_normal((2, _NB, _BS, 8)), F32)
    tables = jnp.asarray(rng.integers(0, _NB, (_S, _MB)), jnp.int32)  # pages may be shared
    args = (q, k, v, tables, jnp.asarray(kv, jnp.int32), jnp.asarray(ql, jnp.int32))
    ref = np.asarray(_jitted("reference")(*args))
    names = ["ragged", "chunked"] + (["native"] if native_supported(F32, F32) else [])
    for name in names:
        np.testing.assert_allclose(np.asarray(_jitted(name)(*args)), ref, atol=1e-5,
                                   rtol=1e-5, err_msg=name)
