"""Dense per-slot attention against `paged_attention_reference` (a slot = one block of L rows)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.pallas_kernels import dense_attention, paged_attention_reference, write_kv

HKV = 2


def _case(num_slots, max_len, lens, q_lens, nq, g=2, d=16, seed=0):
    rng = np.random.default_rng(seed)
    s = len(lens)
    q = jnp.asarray(rng.standard_normal((s, nq, HKV * g, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((HKV, num_slots, max_len, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((HKV, num_slots, max_len, d)), jnp.float32)
    slots = jnp.asarray(rng.permutation(num_slots)[:s], jnp.int32)
    return q, k, v, slots, jnp.asarray(lens, jnp.int32), jnp.asarray(q_lens, jnp.int32)


@pytest.fixture(autouse=True)
def _exact_f32_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


@pytest.mark.parametrize("max_len,chunk", [(64, 16), (40, 16), (40, 128), (100, 32)])
@pytest.mark.parametrize("nq", [1, 5])
def test_matches_paged_reference(max_len, chunk, nq):
    """Decode and prefill rows, a padding row (kv_len 0), lengths on and off chunk edges, and
    slot lengths that chunk_tokens does not divide (the last chunk is shifted back)."""
    lens = [1, max_len, 17, 0, max_len - 3, 32]
    q_lens = [1, nq, min(nq, 17), 0, nq, 1]
    q, k, v, slots, kv_lens, ql = _case(8, max_len, lens, q_lens, nq)
    got = dense_attention(q, k, v, slots, kv_lens, ql, scale=0.25, chunk_tokens=chunk, impl="xla")
    want = paged_attention_reference(q, k, v, slots[:, None], kv_lens, ql, scale=0.25)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    assert not np.asarray(got)[3].any()  # padding row: zeros


def test_reads_only_rows_below_kv_len():
    """Rows past each sequence's length (the rest of its reservation) never matter."""
    q, k, v, slots, kv_lens, ql = _case(4, 64, [10, 33], [1, 1], 1)
    got = dense_attention(q, k, v, slots, kv_lens, ql, scale=0.3, chunk_tokens=16, impl="xla")
    rows = jnp.arange(64)[None, None, :, None]
    k2, v2 = jnp.where(rows >= 33, 1e4, k), jnp.where(rows >= 33, -1e4, v)  # stale rows: large, finite
    k2, v2 = jnp.where(rows >= 48, jnp.nan, k2), jnp.where(rows >= 48, jnp.nan, v2)  # chunks never visited
    again = dense_attention(q, k2, v2, slots, kv_lens, ql, scale=0.3, chunk_tokens=16, impl="xla")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(again))


def test_write_then_attend_jitted():
    """write_kv with slot_mapping = slot * L + position, then attention, under jit."""
    num_slots, max_len, d = 3, 48, 8
    k = jnp.zeros((HKV, num_slots, max_len, d))
    v = jnp.zeros((HKV, num_slots, max_len, d))
    rng = np.random.default_rng(1)
    new_k = jnp.asarray(rng.standard_normal((5, HKV, d)), jnp.float32)
    new_v = jnp.asarray(rng.standard_normal((5, HKV, d)), jnp.float32)
    slot_mapping = jnp.asarray([2 * max_len + p for p in range(5)], jnp.int32)
    k, v = write_kv(k, v, new_k, new_v, slot_mapping)
    q = jnp.asarray(rng.standard_normal((1, 5, HKV, d)), jnp.float32)
    args = (q, k, v, jnp.asarray([2], jnp.int32), jnp.asarray([5], jnp.int32), jnp.asarray([5], jnp.int32))
    got = jax.jit(lambda *a: dense_attention(*a, scale=1.0, chunk_tokens=16, impl="xla"))(*args)
    want = paged_attention_reference(q, k, v, args[3][:, None], args[4], args[5], scale=1.0)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("max_len,chunk", [(64, 16), (100, 32)])
def test_gpu_walks_the_whole_slot_with_a_trip_count_known_when_compiling(max_len, chunk, monkeypatch):
    """On GPUs (traced with the backend reported as "gpu") the chunk loop covers the whole slot,
    a trip count XLA knows (a device-read one makes XLA:GPU's host wait at every iteration),
    and gives what the walk up to the longest sequence gives."""
    import functools
    import re

    lens, q_lens = [1, 17, 0, max_len - 3], [1, 3, 0, 3]
    args = _case(6, max_len, lens, q_lens, 3)
    fn = functools.partial(dense_attention, scale=0.25, chunk_tokens=chunk, impl="xla")
    want = jax.jit(fn)(*args)
    assert "known_trip_count" not in jax.jit(fn).lower(*args).compile().as_text()  # up to the longest: dynamic
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    gpu = jax.jit(lambda *a: fn(*a))
    trips = re.findall(r'"known_trip_count":\{"n":"(\d+)"', gpu.lower(*args).compile().as_text())
    assert trips == [str(-(-max_len // chunk))]
    np.testing.assert_allclose(np.asarray(gpu(*args)), np.asarray(want), atol=1e-6, rtol=1e-6)
