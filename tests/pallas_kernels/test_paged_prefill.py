"""Paged prefill kernels (Q > 1) against `paged_attention_reference`.

`TestPrefillKernels` runs the compiled kernels and skips off their backend; the
`TestPrefillKernelsInterpret` subclass runs the same cases with interpret=True on any backend.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.pallas_kernels import paged_attention, paged_attention_reference
from pagedjax.pallas_kernels.paged_attention import ops
from pagedjax.pallas_kernels.paged_attention.pallas_gpu_prefill import paged_prefill_attention_gpu
from pagedjax.pallas_kernels.paged_attention.pallas_tpu_prefill import paged_prefill_attention_tpu
from test_paged_attention import (BF16, F32, HKV, MB, KernelImpl, _exact_f32_matmuls,  # noqa: F401
                                  assert_close)

NQ = 10  # query slots per sequence


def make_prefill_case(bs, g, d, dtype, seqs, nq=NQ, seed=0, junk_tail=True):
    """seqs: (q_len, cached prefix) per sequence; kv_len = prefix + q_len. Shuffled tables,
    entries past each sequence's pages set to -1 (must never be read).
    Returns (q [S, Q, H, D], k, v, tables, kv_lens, q_lens)."""
    rng = np.random.default_rng(seed)
    s = len(seqs)
    nb = s * MB
    q = jnp.asarray(rng.standard_normal((s, nq, HKV * g, d)), dtype)
    k = jnp.asarray(rng.standard_normal((HKV, nb, bs, d)), dtype)
    v = jnp.asarray(rng.standard_normal((HKV, nb, bs, d)), dtype)
    tables = rng.permutation(nb).reshape(s, MB).astype(np.int32)
    q_lens = np.array([ql for ql, _ in seqs], np.int32)
    kv_lens = np.array([ql + pre for ql, pre in seqs], np.int32)
    assert np.all(kv_lens <= MB * bs)
    if junk_tail:
        for i, n in enumerate(kv_lens):
            tables[i, -(-n // bs):] = -1
    return q, k, v, jnp.asarray(tables), jnp.asarray(kv_lens), jnp.asarray(q_lens)


def prefill_seqs(bs):
    """(q_len, prefix): fresh prefill, a partial-block prefix with padded query slots, a
    several-block prefix, a padding row (q_len 0), a decode-like row over the whole table."""
    return [(NQ, 0), (NQ - 3, bs // 2 + 1), (NQ, 3 * bs + 2), (0, 5), (1, MB * bs - 1)]


# (page size, GQA ratio, head dim, dtype): every size, ratio, head dim and dtype appears.
CASES = [(8, 1, 64, F32), (16, 2, 128, BF16), (32, 4, 48, F32), (8, 8, 128, BF16),
         (16, 4, 64, F32), (32, 2, 48, BF16)]


def check(out, q, k, v, tables, kv_lens, q_lens, scale, dtype):
    ref = paged_attention_reference(q, k, v, tables, kv_lens, q_lens, scale=scale)
    assert_close(out, ref, dtype)
    ql = np.asarray(q_lens)
    for i, n in enumerate(ql):  # padding query slots and rows are exact zeros
        assert not np.any(np.asarray(out[i, n:], np.float32))


class TestPrefillKernels(KernelImpl):

    @pytest.mark.parametrize("kind", ["tpu", "gpu"])
    @pytest.mark.parametrize("bs,g,d,dtype", CASES)
    def test_matches_reference(self, kind, bs, g, d, dtype):
        impl = self.impl(kind)
        args = make_prefill_case(bs, g, d, dtype, prefill_seqs(bs))
        out = jax.jit(functools.partial(paged_attention, impl=impl))(*args)
        check(out, *args, d ** -0.5, dtype)

    @pytest.mark.parametrize("block_q,ppcb", [(2, 1), (4, 3)])
    def test_tpu_query_tiles_and_page_blocks(self, block_q, ppcb):
        """Several query tiles per sequence (a tile may be all padding) and compute blocks
        that straddle the causal horizon."""
        impl = self.impl("tpu")
        interpret = ops._tpu_interpret() if impl.endswith("interpret") else False
        args = make_prefill_case(8, 2, 64, F32, prefill_seqs(8), seed=1)
        out = paged_prefill_attention_tpu(*args, scale=0.125, block_q=block_q,
                                          pages_per_compute_block=ppcb, interpret=interpret)
        check(out, *args, 0.125, F32)

    @pytest.mark.parametrize("block_q,splits,ppcb", [(1, 1, 1), (4, 3, 2), (2, 8, 1)])
    def test_gpu_query_tiles_and_splits(self, block_q, splits, ppcb):
        impl = self.impl("gpu")
        args = make_prefill_case(16, 1, 48, F32, prefill_seqs(16), seed=2)
        out = paged_prefill_attention_gpu(*args, scale=0.125, block_q=block_q,
                                          num_splits=splits, pages_per_compute_block=ppcb,
                                          interpret=impl.endswith("interpret"))
        check(out, *args, 0.125, F32)

    @pytest.mark.parametrize("kind", ["tpu", "gpu"])
    def test_causality_and_odd_group(self, kind):
        """G = 3 (rows padded on GPU); a query never sees a later key: perturbing the keys
        after position p leaves query p's output unchanged."""
        impl = self.impl(kind)
        bs, d = 16, 64
        q, k, v, tables, kv_lens, q_lens = make_prefill_case(
            bs, 3, d, F32, [(NQ, 0), (NQ, 20)], seed=3)
        run = jax.jit(functools.partial(paged_attention, impl=impl))
        out = run(q, k, v, tables, kv_lens, q_lens)
        check(out, q, k, v, tables, kv_lens, q_lens, d ** -0.5, F32)
        # Overwrite every key/value of sequence 0 from position 4 on.
        flat = np.asarray(tables[0])
        k2, v2 = np.array(k), np.array(v)
        for pos in range(4, NQ):
            k2[:, flat[pos // bs], pos % bs] = 1e3
            v2[:, flat[pos // bs], pos % bs] = -1e3
        out2 = run(q, jnp.asarray(k2), jnp.asarray(v2), tables, kv_lens, q_lens)
        np.testing.assert_allclose(np.asarray(out2[0, :4]), np.asarray(out[0, :4]), atol=1e-5)
        np.testing.assert_allclose(np.asarray(out2[1]), np.asarray(out[1]), atol=1e-6)


class TestPrefillKernelsInterpret(TestPrefillKernels):
    INTERPRET = True


def test_auto_routes_prefill_to_kernels(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert ops._resolve("auto", BF16, 16, BF16) == "pallas_tpu"
    assert ops._resolve("auto", BF16, 8, BF16) == "chunked"  # half a bf16 VMEM tile
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert ops._resolve("auto", F32, 16, F32) == "pallas_gpu"
    assert ops._resolve("auto", F32, 24, F32) == "chunked"
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    monkeypatch.setattr(ops.cpu_native, "available", lambda: False)
    assert ops._resolve("auto", F32, 24, F32) == "ragged"


@pytest.mark.parametrize("kind", ["gpu", "tpu"])
@pytest.mark.parametrize("dtype,page_dtype,d", [(BF16, BF16, 48), (F32, F32, 128),
                                                  (F32, BF16, 64)])  # the last: a bf16 KV cache, f32 model
def test_prefill_lowers_for_device(kind, dtype, page_dtype, d, monkeypatch):
    """Lower (not compile) each prefill kernel for its platform from any host: catches Pallas
    lowering-rule errors; Triton/Mosaic compilation itself still needs the device."""
    from jax import export
    s, nq, g, bs, nb = 2, 24, 4, 16, 32
    args = (jax.ShapeDtypeStruct((s, nq, HKV * g, d), dtype),
            jax.ShapeDtypeStruct((HKV, nb, bs, d), page_dtype),
            jax.ShapeDtypeStruct((HKV, nb, bs, d), page_dtype),
            jax.ShapeDtypeStruct((s, MB), jnp.int32), jax.ShapeDtypeStruct((s,), jnp.int32),
            jax.ShapeDtypeStruct((s,), jnp.int32))
    if kind == "gpu":
        fn = functools.partial(paged_prefill_attention_gpu, block_q=4, num_splits=2)
        platform = "cuda"
        checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    else:
        fn, platform, checks = paged_prefill_attention_tpu, "tpu", []
        if jax.default_backend() != "tpu":  # Mosaic lowering asks the host for a TPU kind
            try:
                from jax._src.pallas.mosaic import tpu_info
            except ImportError:
                pytest.skip("private tpu_info unavailable")
            monkeypatch.setitem(tpu_info.registry, jax.devices()[0].device_kind,
                                lambda: tpu_info.get_tpu_info_for_chip(
                                    tpu_info.ChipVersion.TPU_V5E, 1))
    exp = export.export(jax.jit(functools.partial(fn, scale=0.1)), platforms=[platform],
                        disabled_checks=checks)(*args)
    assert ("xla.gpu.triton" if kind == "gpu" else "tpu_custom_call") in exp.mlir_module()
