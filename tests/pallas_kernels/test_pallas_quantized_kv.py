"""The Pallas kernels (TPU and GPU, decode and prefill, interpret mode here) on a quantized KV
cache (int8 / float8_e4m3fn pages with float16 scales, kv_quant.QuantizedPages) against
`paged_attention_reference` on the dequantized pages.

The kernels feed their dots the raw 8-bit values in q's dtype (exact in f32 and bf16) and
apply the scales to the scores' and probabilities' columns in f32 (common.compute_dtype), so
with an f32 q they match the reference on the dequantized pages to f32 rounding (2e-5); with
a bf16 q the dots take bf16 inputs (q, and the scaled probabilities, rounded), hence 3e-2.
Scales of slots past each sequence's kv_len are poisoned with NaN / inf on the kernels' side:
they must never reach the output. The compiled kernels run the same cases through
`DEVICE_IMPLS` on their device (scripts/gpu_kernel_check.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.pallas_kernels.paged_attention import (kv_quant, ops, packed_paged_attention, paged_attention,
                                            paged_attention_reference, paged_decode_attention)
from pagedjax.pallas_kernels.paged_attention.packed import packed_attention_reference
from pagedjax.pallas_kernels.paged_attention.pallas_tpu import tpu_supported
from test_paged_attention import _exact_f32_matmuls  # noqa: F401  (autouse: jnp paths in full f32)

QDTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
TOL = {jnp.dtype(jnp.float32): dict(rtol=2e-5, atol=2e-5), jnp.dtype(jnp.bfloat16): dict(rtol=3e-2, atol=3e-2)}
HKV, G, D, MB = 2, 2, 64, 4  # GQA 2; pages per sequence
BS = {"tpu": 32, "gpu": 16}  # TPU: 8-bit pages want a multiple of 32 rows (tpu_supported)
KINDS = ["tpu", "gpu"]
# compiled kernels of the backend JAX runs on (none on CPU): the same cases as interpret mode
DEVICE_IMPLS = {"tpu": {"tpu": "pallas_tpu"}, "gpu": {"gpu": "pallas_gpu"},
                "cuda": {"gpu": "pallas_gpu"}}.get(jax.default_backend(), {})


def impl_of(kind, compiled=False):
    if not compiled:
        return f"pallas_{kind}_interpret"
    if kind not in DEVICE_IMPLS:
        pytest.skip(f"compiled pallas_{kind} needs its device (backend is {jax.default_backend()})")
    return DEVICE_IMPLS[kind]


def make_pool(rng, bs, qname, s):
    """Quantized k, v pools [HKV, S * MB, bs, D] (shuffled tables over them) and their
    dequantized f32 copies."""
    nb = s * MB
    pools, deq = [], []
    for _ in range(2):
        x = rng.standard_normal((HKV, nb, bs, D)) * np.exp(rng.uniform(-2, 2, (HKV, nb, bs, 1)))
        data, scales = kv_quant.quantize(jnp.asarray(x, jnp.float32), QDTYPES[qname])
        pools.append(kv_quant.QuantizedPages(data, scales))
        deq.append(kv_quant.dequantize(data, scales))
    tables = jnp.asarray(rng.permutation(nb).reshape(s, MB).astype(np.int32))
    return pools, deq, tables


def poison(pool, tables, kv_lens, bs, value):
    """Set the scales of every slot at or past its sequence's kv_len to `value`."""
    sc = np.asarray(pool.scales, np.float32).copy()
    for i, n in enumerate(np.asarray(kv_lens)):
        for b, page in enumerate(np.asarray(tables)[i]):
            lo = max(int(n) - b * bs, 0)
            sc[:, page, lo:] = value
    return kv_quant.QuantizedPages(pool.data, jnp.asarray(sc, jnp.float16))


def close(out, ref, qdt):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               **TOL[jnp.dtype(qdt)])


def run_decode(kind, qname, qdt, compiled=False):
    rng = np.random.default_rng(1)
    bs = BS[kind]
    lens = jnp.asarray([1, bs, bs + 1, 3 * bs - 5, MB * bs, 0], jnp.int32)  # ragged, full, empty
    s = lens.shape[0]
    (kp, vp), (kd, vd), tables = make_pool(rng, bs, qname, s)
    q = jnp.asarray(rng.standard_normal((s, HKV * G, D)), qdt)
    kp, vp = poison(kp, tables, lens, bs, np.nan), poison(vp, tables, lens, bs, np.inf)
    out = jax.jit(lambda *a: paged_decode_attention(*a, impl=impl_of(kind, compiled)))(q, kp, vp, tables, lens)
    ref = paged_attention_reference(q[:, None], kd, vd, tables, lens, jnp.ones(s, jnp.int32), scale=D ** -0.5)
    close(out, ref[:, 0], qdt)
    assert not np.any(np.asarray(out[-1], np.float32))  # kv_len 0 -> zeros


def run_prefill(kind, qname, qdt, compiled=False):
    rng = np.random.default_rng(2)
    bs, nq = BS[kind], 6
    seqs = [(nq, 0), (nq - 2, bs + 3), (0, 5), (1, MB * bs - 1), (nq, 2 * bs - 1)]  # (q_len, prefix)
    s = len(seqs)
    q_lens = jnp.asarray([a for a, _ in seqs], jnp.int32)
    kv_lens = jnp.asarray([a + b for a, b in seqs], jnp.int32)
    (kp, vp), (kd, vd), tables = make_pool(rng, bs, qname, s)
    q = jnp.asarray(rng.standard_normal((s, nq, HKV * G, D)), qdt)
    kp, vp = poison(kp, tables, kv_lens, bs, np.nan), poison(vp, tables, kv_lens, bs, np.nan)
    out = paged_attention(q, kp, vp, tables, kv_lens, q_lens, scale=0.2, impl=impl_of(kind, compiled))
    ref = paged_attention_reference(q, kd, vd, tables, kv_lens, q_lens, scale=0.2)
    close(out, ref, qdt)
    assert not np.any(np.asarray(out[2], np.float32))  # q_len 0 -> zeros


def run_packed(kind, qname, compiled=False):
    """The engine's entry: a packed step of decode and prefill tokens (prefill kernel rows)."""
    rng = np.random.default_rng(3)
    bs = BS[kind]
    s = 4
    (kp, vp), (kd, vd), tables = make_pool(rng, bs, qname, s)
    for q_lens, ctx in (([3, 1, 0, 9], [bs, 2 * bs + 1, 4, 5]),):
        kv_lens = jnp.asarray([a + b for a, b in zip(q_lens, ctx)], jnp.int32)
        cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
        q = jnp.asarray(rng.standard_normal((int(cu[-1]), HKV * G, D)), jnp.float32)
        out = packed_paged_attention(q, kp, vp, tables, kv_lens, cu, impl=impl_of(kind, compiled))
        ref = packed_attention_reference(q, kd, vd, tables, kv_lens, cu, scale=D ** -0.5)
        close(out, ref, jnp.float32)


class TestQuantizedKernels:
    COMPILED = False

    @pytest.mark.parametrize("qname", list(QDTYPES))
    @pytest.mark.parametrize("kind", KINDS)
    def test_decode(self, kind, qname):
        run_decode(kind, qname, jnp.float32, self.COMPILED)

    @pytest.mark.parametrize("qname", list(QDTYPES))
    @pytest.mark.parametrize("kind", KINDS)
    def test_prefill(self, kind, qname):
        run_prefill(kind, qname, jnp.float32, self.COMPILED)

    @pytest.mark.parametrize("kind", KINDS)
    def test_packed_int8(self, kind):
        run_packed(kind, "int8", self.COMPILED)

    @pytest.mark.parametrize("kind", KINDS)
    def test_bf16_q_decode_fp8(self, kind):
        run_decode(kind, "fp8", jnp.bfloat16, self.COMPILED)


class TestQuantizedKernelsCompiled(TestQuantizedKernels):
    """The compiled kernels (skipped off their device)."""
    COMPILED = True


def test_auto_picks_pallas_for_quantized_pages(monkeypatch):
    for backend, want in (("tpu", "pallas_tpu"), ("gpu", "pallas_gpu"), ("cuda", "pallas_gpu")):
        monkeypatch.setattr(ops.jax, "default_backend", lambda b=backend: b)
        for dt in QDTYPES.values():
            assert ops._resolve("auto", jnp.float32, 32, dt) == want
    monkeypatch.setattr(ops.jax, "default_backend", lambda: "tpu")
    assert not tpu_supported(16, jnp.int8) and tpu_supported(32, jnp.float8_e4m3fn)
    assert ops._resolve("auto", jnp.float32, 16, jnp.int8) == "chunked"  # 16-row 8-bit pages
    monkeypatch.setattr(ops.jax, "default_backend", lambda: "gpu")
    assert ops._resolve("auto", jnp.float32, 24, jnp.int8) == "chunked"  # not a power of two


@pytest.mark.parametrize("qname", list(QDTYPES))
@pytest.mark.parametrize("kind", KINDS)
def test_lowers_for_device(kind, qname, monkeypatch):
    """Lower (not compile) the decode and prefill kernels on quantized pages for their
    platform from any host: Pallas lowering rules (Triton / Mosaic); compiling needs the device."""
    from jax import export

    from pagedjax.pallas_kernels.paged_attention.pallas_gpu import paged_decode_attention_gpu
    from pagedjax.pallas_kernels.paged_attention.pallas_gpu_prefill import paged_prefill_attention_gpu
    from pagedjax.pallas_kernels.paged_attention.pallas_tpu import paged_decode_attention_tpu
    from pagedjax.pallas_kernels.paged_attention.pallas_tpu_prefill import paged_prefill_attention_tpu

    s, nq, bs, nb, qdt = 2, 8, 32, 16, jnp.bfloat16
    pages = jax.ShapeDtypeStruct((HKV, nb, bs, D), QDTYPES[qname])
    scales = jax.ShapeDtypeStruct((HKV, nb, bs), jnp.float16)
    tables, lens = jax.ShapeDtypeStruct((s, MB), jnp.int32), jax.ShapeDtypeStruct((s,), jnp.int32)
    if kind == "gpu":
        fns, platform = (paged_decode_attention_gpu, paged_prefill_attention_gpu), "cuda"
        checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    else:
        fns, platform, checks = (paged_decode_attention_tpu, paged_prefill_attention_tpu), "tpu", []
        if jax.default_backend() != "tpu":  # Mosaic lowering asks the host for a TPU kind
            try:
                from jax._src.pallas.mosaic import tpu_info
            except ImportError:
                pytest.skip("private tpu_info unavailable")
            monkeypatch.setitem(tpu_info.registry, jax.devices()[0].device_kind,
                                lambda: tpu_info.get_tpu_info_for_chip(tpu_info.ChipVersion.TPU_V5E, 1))
    decode = lambda q, k, v, ks, vs, t, n: fns[0](q, k, v, t, n, scale=0.1, k_scales=ks, v_scales=vs)
    prefill = lambda q, k, v, ks, vs, t, n: fns[1](q, k, v, t, n, n, scale=0.1, k_scales=ks, v_scales=vs)
    for fn, q in ((decode, jax.ShapeDtypeStruct((s, HKV * G, D), qdt)),
                  (prefill, jax.ShapeDtypeStruct((s, nq, HKV * G, D), qdt))):
        exp = export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)(
            q, pages, pages, scales, scales, tables, lens)
        assert ("xla.gpu.triton" if kind == "gpu" else "tpu_custom_call") in exp.mlir_module()
