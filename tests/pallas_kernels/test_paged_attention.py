"""Paged attention kernels against `paged_attention_reference`.

`TestDecodeKernels` / `TestPrefillKernels` run the compiled kernels and skip off their
backend; their `...Interpret` subclasses run the same cases with interpret=True on any backend.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.pallas_kernels import (paged_attention, paged_attention_reference, paged_decode_attention,
                            write_kv)
from pagedjax.pallas_kernels.paged_attention import common, ops
from pagedjax.pallas_kernels.paged_attention.pallas_gpu import paged_decode_attention_gpu
from pagedjax.pallas_kernels.paged_attention.pallas_gpu_prefill import paged_prefill_attention_gpu
from pagedjax.pallas_kernels.paged_attention.pallas_tpu import paged_decode_attention_tpu
from pagedjax.pallas_kernels.paged_attention.pallas_tpu_prefill import paged_prefill_attention_tpu
from pagedjax.pallas_kernels.paged_attention.ragged import paged_attention_ragged
from pagedjax.pallas_kernels.paged_attention.reference import (online_softmax_update,
                                                      paged_attention_chunked)

F32, BF16 = jnp.float32, jnp.bfloat16
TOL = {F32: dict(atol=1e-4, rtol=1e-4), BF16: dict(atol=3e-2, rtol=3e-2)}
HKV, MB = 2, 8  # kv heads; blocks per sequence (pool = S * MB <= 64 pages)


def make_case(bs, g, d, dtype, lens, seed=0, junk_tail=False):
    """Random pages with shuffled block tables; returns (q [S,H,D], k, v, tables, kv_lens)."""
    rng = np.random.default_rng(seed)
    s = len(lens)
    nb = s * MB
    q = jnp.asarray(rng.standard_normal((s, HKV * g, d)), dtype)
    k = jnp.asarray(rng.standard_normal((HKV, nb, bs, d)), dtype)
    v = jnp.asarray(rng.standard_normal((HKV, nb, bs, d)), dtype)
    tables = rng.permutation(nb).reshape(s, MB).astype(np.int32)
    if junk_tail:  # entries past each sequence's pages must never be read
        for i, n in enumerate(lens):
            tables[i, -(-n // bs):] = -1
    return q, k, v, jnp.asarray(tables), jnp.asarray(lens, jnp.int32)


@pytest.fixture(autouse=True)
def _exact_f32_matmuls():
    """jnp paths in full f32 (GPU/TPU default precision may use TF32/bf16 passes); the
    kernels set their dot precision explicitly."""
    with jax.default_matmul_precision("highest"):
        yield


def reference_decode(q, k, v, tables, lens, scale):
    ones = jnp.ones(q.shape[:1], jnp.int32)
    return paged_attention_reference(q[:, None], k, v, tables, lens, ones, scale=scale)[:, 0]


def assert_close(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               **TOL[dtype])


# (page size, GQA ratio, head dim, dtype): every size, ratio, head dim and dtype appears.
CASES = [(8, 1, 64, F32), (16, 2, 128, BF16), (32, 4, 48, F32), (8, 8, 128, F32),
         (16, 4, 64, BF16), (32, 8, 48, BF16), (16, 1, 48, F32), (8, 2, 64, BF16)]


def lengths(bs):
    """1, exactly a page, a page plus one, several pages, the whole table, empty."""
    return [1, bs, bs + 1, 5 * bs + 3, MB * bs, 0]


class KernelImpl:
    INTERPRET = False

    def impl(self, kind):
        if self.INTERPRET:
            return f"pallas_{kind}_interpret"
        backend = jax.default_backend()
        if (kind == "tpu") != (backend == "tpu") or (kind == "gpu" and backend == "cpu"):
            pytest.skip(f"compiled pallas_{kind} needs its device (backend is {backend})")
        return f"pallas_{kind}"


class TestDecodeKernels(KernelImpl):

    @pytest.mark.parametrize("kind", ["tpu", "gpu"])
    @pytest.mark.parametrize("bs,g,d,dtype", CASES)
    def test_matches_reference(self, kind, bs, g, d, dtype):
        impl = self.impl(kind)
        q, k, v, tables, lens = make_case(bs, g, d, dtype, lengths(bs))
        out = jax.jit(functools.partial(paged_decode_attention, impl=impl))(q, k, v, tables, lens)
        ref = reference_decode(q, k, v, tables, lens, d ** -0.5)
        assert_close(out, ref, dtype)
        assert not np.any(np.asarray(out[-1], np.float32))  # kv_len 0 -> zeros

    @pytest.mark.parametrize("kind", ["tpu", "gpu"])
    def test_junk_table_tail_and_q_lens(self, kind):
        impl = self.impl(kind)
        bs, d = 16, 64
        q, k, v, tables, lens = make_case(bs, 4, d, F32, [3, 17, 40, 0], seed=1, junk_tail=True)
        q4, q_lens = q[:, None], jnp.array([1, 0, 1, 1], jnp.int32)  # slot 1 is padding
        out = paged_attention(q4, k, v, tables, lens, q_lens, scale=0.3, impl=impl)
        ref = paged_attention_reference(q4, k, v, tables, lens, q_lens, scale=0.3)
        assert_close(out, ref, F32)
        assert not np.any(np.asarray(out[1]))

    @pytest.mark.parametrize("ppcb", [1, 3])
    def test_tpu_pages_per_compute_block(self, ppcb):
        impl = self.impl("tpu")
        interpret = ops._tpu_interpret() if impl.endswith("interpret") else False
        q, k, v, tables, lens = make_case(8, 2, 64, F32, lengths(8), seed=2)
        out = paged_decode_attention_tpu(q, k, v, tables, lens, scale=0.125,
                                         pages_per_compute_block=ppcb, interpret=interpret)
        assert_close(out, reference_decode(q, k, v, tables, lens, 0.125), F32)

    @pytest.mark.parametrize("splits,ppcb", [(1, 2), (3, 1), (8, 4)])
    def test_gpu_splits(self, splits, ppcb):
        impl = self.impl("gpu")
        q, k, v, tables, lens = make_case(16, 2, 48, F32, lengths(16), seed=3)
        out = paged_decode_attention_gpu(q, k, v, tables, lens, scale=0.125, num_splits=splits,
                                         pages_per_compute_block=ppcb,
                                         interpret=impl.endswith("interpret"))
        assert_close(out, reference_decode(q, k, v, tables, lens, 0.125), F32)


class TestDecodeKernelsInterpret(TestDecodeKernels):
    INTERPRET = True


# ---------------------------------------------------------------- jnp paths (any backend)

@pytest.mark.parametrize("bs,chunk", [(8, 1), (16, 3), (32, 8)])
def test_chunked_prefill_matches_reference(bs, chunk):
    rng = np.random.default_rng(4)
    s, nq, g, d = 4, 6, 2, 64
    _, k, v, tables, _ = make_case(bs, g, d, F32, [0] * s, seed=4)
    q = jnp.asarray(rng.standard_normal((s, nq, HKV * g, d)), F32)
    q_lens = jnp.array([6, 3, 0, 1], jnp.int32)  # full, partial, empty, decode-like
    kv_lens = jnp.array([6, 2 * bs + 5, 9, 3 * bs], jnp.int32)
    ref = paged_attention_reference(q, k, v, tables, kv_lens, q_lens, scale=0.2)
    out = paged_attention_chunked(q, k, v, tables, kv_lens, q_lens, scale=0.2,
                                  blocks_per_chunk=chunk)
    assert_close(out, ref, F32)
    assert not np.any(np.asarray(out[1, 3:])) and not np.any(np.asarray(out[2]))
    # Causality: query j of a full prefill (kv_len == q_len) only sees keys 0..j.
    q0 = paged_attention_reference(q[:1, :1], k, v, tables[:1], kv_lens[:1] - 5, q_lens[:1] - 5,
                                   scale=0.2)
    np.testing.assert_allclose(np.asarray(out[0, 0]), np.asarray(q0[0, 0]), atol=1e-5)
    auto = paged_attention(q, k, v, tables, kv_lens, q_lens, scale=0.2)  # CPU: ragged
    assert_close(auto, ref, F32)


def test_softmax_step_matches_online_softmax_update():
    rng = np.random.default_rng(5)
    r, t, dv = 4, 12, 8
    scores = jnp.asarray(rng.standard_normal((2, r, t)), F32).at[:, 1, :5].set(-jnp.inf)
    scores = scores.at[0, 2].set(-jnp.inf)  # a fully masked row in the first chunk
    vals = jnp.asarray(rng.standard_normal((2, t, dv)), F32)
    m, l, acc = jnp.full((r,), -jnp.inf), jnp.zeros((r,)), jnp.zeros((r, dv))
    mk, lk, acck = m[:, None], l[:, None], acc
    for c in range(2):
        m, l, acc = online_softmax_update(m, l, acc, scores[c], vals[c])
        mk, lk, acck = common.softmax_step(mk, lk, acck, scores[c], lambda p: p @ vals[c],
                                           keepdims=True)
        np.testing.assert_allclose(np.asarray(mk[:, 0]), np.asarray(m), atol=1e-6)
        np.testing.assert_allclose(np.asarray(acck), np.asarray(acc), atol=1e-5)


def test_merge_splits_equals_full_softmax():
    rng = np.random.default_rng(6)
    scores = jnp.asarray(rng.standard_normal((3, 24)), F32)  # [R, T]
    vals = jnp.asarray(rng.standard_normal((24, 5)), F32)
    outs, lses = [], []
    for sl in (slice(0, 10), slice(10, 10), slice(10, 24)):  # the middle split is empty
        sc = scores[:, sl]
        m0, l0, a0 = jnp.full((3,), -jnp.inf), jnp.zeros((3,)), jnp.zeros((3, 5))
        m, l, a = common.softmax_step(m0, l0, a0, sc, lambda p, sl=sl: p @ vals[sl],
                                      keepdims=False) if sc.shape[1] else (m0, l0, a0)
        o, lse = common.finalize(m, l, a, keepdims=False)
        outs.append(o)
        lses.append(lse)
    merged = common.merge_splits(jnp.stack(outs), jnp.stack(lses))
    want = jax.nn.softmax(scores, axis=-1) @ vals
    np.testing.assert_allclose(np.asarray(merged), np.asarray(want), atol=1e-5)


def test_write_kv_round_trip_and_padding():
    rng = np.random.default_rng(7)
    hkv, nb, bs, d = 2, 6, 8, 16
    k_pages = jnp.zeros((hkv, nb, bs, d), F32)
    v_pages = jnp.zeros((hkv, nb, bs, d), F32)
    toks = 11
    k = jnp.asarray(rng.standard_normal((toks, hkv, d)), F32)
    v = jnp.asarray(rng.standard_normal((toks, hkv, d)), F32)
    table = np.array([4, 1], np.int32)  # one sequence on pages 4 then 1
    slots = np.array([table[i // bs] * bs + i % bs for i in range(toks)], np.int32)
    slots[[3, 7]] = -1  # padding tokens are dropped
    k_pages, v_pages = write_kv(k_pages, v_pages, k, v, jnp.asarray(slots))
    flat_k = np.asarray(k_pages).reshape(hkv, nb * bs, d)
    flat_v = np.asarray(v_pages).reshape(hkv, nb * bs, d)
    for i, sl in enumerate(slots):
        if sl >= 0:
            np.testing.assert_array_equal(flat_k[:, sl], np.asarray(k[i]))
            np.testing.assert_array_equal(flat_v[:, sl], np.asarray(v[i]))
    written = slots[slots >= 0]
    untouched = np.setdiff1d(np.arange(nb * bs), written)
    assert not np.any(flat_k[:, untouched]) and not np.any(flat_v[:, untouched])
    # Attention over the written cache equals dense attention over the kept tokens.
    q = jnp.asarray(rng.standard_normal((1, hkv * 2, d)), F32)
    out = paged_decode_attention(q, k_pages, v_pages, jnp.asarray(table[None]),
                                 jnp.array([toks], jnp.int32), impl="reference")
    kd = np.asarray(k).copy()  # dropped tokens' slots stay zero in the cache
    vd = np.asarray(v).copy()
    kd[[3, 7]] = 0
    vd[[3, 7]] = 0
    kd, vd = np.repeat(kd, 2, axis=1), np.repeat(vd, 2, axis=1)  # [T, H, D]
    sc = np.einsum("hd,thd->ht", np.asarray(q[0]), kd) / np.sqrt(d)
    p = np.exp(sc - sc.max(-1, keepdims=True))
    want = np.einsum("ht,thd->hd", p / p.sum(-1, keepdims=True), vd)
    np.testing.assert_allclose(np.asarray(out[0]), want, atol=1e-5)


# ---------------------------------------------------------------- validation and routing

def _args():
    q, k, v, tables, lens = make_case(8, 2, 16, F32, [3, 9])
    return dict(q=q, k_pages=k, v_pages=v, block_tables=tables, kv_lens=lens)


@pytest.mark.parametrize("change,exc,match", [
    (dict(q=jnp.zeros((2, 1, 4, 16))), ValueError, "q must have rank 3"),
    (dict(k_pages=jnp.zeros((2, 16, 8))), ValueError, "k_pages must have rank 4"),
    (dict(q=jnp.zeros((2, 3, 16))), ValueError, "multiple of kv heads"),
    (dict(q=jnp.zeros((2, 4, 32))), ValueError, "head dim"),
    (dict(v_pages=jnp.zeros((2, 16, 4, 16))), ValueError, "shapes differ"),
    (dict(v_pages=jnp.zeros((2, 16, 8, 16), BF16)), TypeError, "dtypes differ"),
    (dict(block_tables=jnp.zeros((2, 8), jnp.int64 if jax.config.jax_enable_x64
                                  else jnp.float32)), TypeError, "block_tables must be int32"),
    (dict(kv_lens=jnp.zeros((2,), jnp.uint32)), TypeError, "kv_lens must be int32"),
    (dict(kv_lens=jnp.zeros((3,), jnp.int32)), ValueError, "sequence counts differ"),
    (dict(q=jnp.zeros((2, 4, 16), jnp.float16)), TypeError, "float32 or bfloat16"),
    (dict(impl="cuda"), ValueError, "unknown impl"),
])
def test_validation_errors(change, exc, match):
    args = _args()
    impl = change.pop("impl", "auto") if "impl" in change else "auto"
    args.update(change)
    with pytest.raises(exc, match=match):
        jax.jit(functools.partial(paged_decode_attention, impl=impl))(**args)


def test_validation_prefill_and_write_kv():
    a = _args()
    q4 = a["q"][:, None].repeat(3, axis=1)
    lens = jnp.ones((2,), jnp.int32)
    with pytest.raises(TypeError, match="q_lens must be int32"):
        paged_attention(q4, a["k_pages"], a["v_pages"], a["block_tables"], a["kv_lens"],
                        lens.astype(jnp.float32))
    k = jnp.zeros((4, 2, 16), F32)
    with pytest.raises(TypeError, match="slot_mapping must be int32"):
        write_kv(a["k_pages"], a["v_pages"], k, k, jnp.zeros((4,), jnp.float32))
    with pytest.raises(ValueError, match="must be \\[T, 2, 16\\]"):
        write_kv(a["k_pages"], a["v_pages"], k[:, :1], k[:, :1], jnp.zeros((4,), jnp.int32))
    if jax.default_backend() == "cpu":
        with pytest.raises(ValueError, match="needs a GPU backend"):
            paged_decode_attention(**a, impl="pallas_gpu")
        with pytest.raises(ValueError, match="needs a TPU backend"):  # the prefill kernel
            paged_attention(q4, a["k_pages"], a["v_pages"], a["block_tables"], a["kv_lens"],
                            lens, impl="pallas_tpu")


def test_auto_routing(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    monkeypatch.setattr(ops.cpu_native, "available", lambda: True)
    assert ops._resolve("auto", F32, 16, F32) == "native"
    assert ops._resolve("auto", BF16, 16, BF16) == "native"
    assert ops._resolve("auto", F32, 16, BF16) == "native"  # a bf16 KV cache under an f32 model
    monkeypatch.setattr(ops.cpu_native, "available", lambda: False)  # no compiler
    assert ops._resolve("auto", F32, 16, F32) == "ragged"
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert ops._resolve("auto", BF16, 16, BF16) == "pallas_tpu"
    assert ops._resolve("auto", BF16, 8, BF16) == "chunked"  # half a bf16 VMEM tile
    assert ops._resolve("auto", F32, 16, F32) == "pallas_tpu"
    with pytest.raises(ValueError, match="impl='native' needs"):
        ops._resolve("native", F32, 16, F32)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert ops._resolve("auto", BF16, 8, BF16) == "pallas_gpu"
    assert ops._resolve("auto", F32, 24, F32) == "chunked"


# ---------------------------------------------------------------- lowering smoke tests (CPU)

@pytest.mark.parametrize("kind", ["gpu", "tpu"])
@pytest.mark.parametrize("dtype,page_dtype,d", [(BF16, BF16, 48), (F32, F32, 128),
                                                  (F32, BF16, 64)])  # the last: a bf16 KV cache, f32 model
def test_lowers_for_device(kind, dtype, page_dtype, d, monkeypatch):
    """Lower (not compile) each kernel for its platform from any host: catches Pallas
    lowering-rule errors; Triton/Mosaic compilation itself still needs the device."""
    from jax import export
    s, g, bs, nb = 4, 4, 16, 32
    args = (jax.ShapeDtypeStruct((s, HKV * g, d), dtype),
            jax.ShapeDtypeStruct((HKV, nb, bs, d), page_dtype),
            jax.ShapeDtypeStruct((HKV, nb, bs, d), page_dtype),
            jax.ShapeDtypeStruct((s, MB), jnp.int32), jax.ShapeDtypeStruct((s,), jnp.int32))
    if kind == "gpu":
        fn, platform = paged_decode_attention_gpu, "cuda"
        checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    else:
        fn, platform, checks = paged_decode_attention_tpu, "tpu", []
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


# ---------------------------------------------------------------- f32 dots of the jnp paths

@pytest.mark.parametrize("path", ["reference", "chunked", "ragged", "packed_reference", "dense"])
@pytest.mark.parametrize("num_q", [1, 4, 8])  # ragged: 8 query rows per kv head multiply and sum, 16 dot
def test_jnp_paths_ask_for_float32_dots(path, num_q):
    """Every dot of the jnp paths asks for HIGHEST precision: on GPU/TPU the default rounds f32
    operands to TF32 / bf16 passes, which would break "softmax and accumulation in float32"."""
    from pagedjax.pallas_kernels import dense_attention
    from pagedjax.pallas_kernels.paged_attention import packed_attention_reference

    s, h, d, bs, nb = 2, 4, 16, 8, 16
    q = jnp.ones((s, num_q, h, d), F32)
    pages = jnp.ones((HKV, nb, bs, d), F32)
    tables, lens = jnp.zeros((s, MB), jnp.int32), jnp.full((s,), 5, jnp.int32)
    q_lens = jnp.full((s,), num_q, jnp.int32)
    if path == "packed_reference":
        fn = lambda: packed_attention_reference(q.reshape(s * num_q, h, d), pages, pages, tables, lens,
                                                jnp.arange(s + 1, dtype=jnp.int32) * num_q, scale=0.25)
    elif path == "dense":
        cache = jnp.ones((HKV, s, 64, d), F32)
        fn = lambda: dense_attention(q, cache, cache, jnp.arange(s, dtype=jnp.int32), lens, q_lens, scale=0.25,
                                     chunk_tokens=16, impl="xla")
    else:
        fn = lambda: paged_attention(q, pages, pages, tables, lens, q_lens, scale=0.25, impl=path)
    with jax.default_matmul_precision("default"):  # not this module's autouse "highest"
        text = jax.jit(fn).lower().as_text()
    dots = [line for line in text.splitlines() if "dot_general" in line]
    assert len(dots) > (2 if path == "ragged" and num_q == 8 else 0)  # ragged: beyond its 2 one-hot merges
    assert all("HIGHEST" in line for line in dots), [line for line in dots if "HIGHEST" not in line][:2]
