"""The native CPU kernel (cpu_attention.cc through the XLA FFI) against the reference."""
from __future__ import annotations

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.pallas_kernels import dense_attention, paged_attention, paged_attention_reference, paged_decode_attention
from pagedjax.pallas_kernels.paged_attention import cpu_native
from pagedjax.pallas_kernels.paged_attention.ops import native_supported
from test_paged_attention import BF16, F32, _exact_f32_matmuls, assert_close  # noqa: F401
from test_paged_ragged import check, make_batch

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu" or not cpu_native.available(),
                                reason="native kernel: CPU backend with a C++ compiler")
native = cpu_native.paged_attention_native


# page sizes 8/16/32, GQA 1/2/4/8, head dims 64/128/48 (the generic build), shuffled tables
# with junk past each sequence's pages
@pytest.mark.parametrize("bs,g,d", [(16, 3, 64), (8, 1, 48), (32, 8, 128), (16, 2, 64), (8, 4, 128)])
def test_decode(bs, g, d):
    mb = 8
    # short, exactly the table, empty row, kv_len 0, exactly a page, a page plus one
    seqs = [(1, 3), (1, mb * bs), (0, 9), (1, 0), (1, bs), (1, 2 * bs + 1)]
    check(native, make_batch(bs, 2, g, d, F32, seqs, 1, mb), F32)


@pytest.mark.parametrize("bs,g,nq", [(8, 2, 6), (16, 4, 5), (8, 1, 3), (32, 1, 12)])
def test_prefill(bs, g, nq):
    mb = 6
    # fresh prefill, cached prefix with padded slots, several prefix pages, empty row, decode row
    seqs = [(nq, nq), (nq - 2, nq - 2 + bs // 2 + 1), (nq, nq + 3 * bs + 2), (0, 5), (1, mb * bs - 2)]
    check(native, make_batch(bs, 2, g, 32, F32, seqs, nq, mb, seed=1), F32)


def test_one_page_per_sequence_is_the_dense_layout():
    """The dense backend calls the kernel with a [S, 1] table of slots and max_model_len pages."""
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((3, 4, 6, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, 5, 100, 16)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((2, 5, 100, 16)), jnp.float32)
    slots, kv_lens, q_lens = jnp.asarray([[4], [0], [2]], jnp.int32), jnp.asarray([100, 3, 57]), jnp.asarray([1, 3, 4])
    args = (q, k, v, slots, kv_lens.astype(jnp.int32), q_lens.astype(jnp.int32))
    out = check(native, args, F32)
    dense = dense_attention(q, k, v, slots[:, 0], *args[4:], scale=0.2)  # auto: the same kernel
    np.testing.assert_array_equal(np.asarray(dense), np.asarray(out))


def test_auto_picks_native_on_cpu():
    args = make_batch(16, 3, 3, 64, F32, [(1, 40), (1, 7)], 1, 4)
    assert native_supported(jnp.float32, jnp.float32)
    np.testing.assert_array_equal(np.asarray(paged_attention(*args, scale=0.125)), np.asarray(native(*args, scale=0.125)))
    dec = paged_decode_attention(args[0][:, 0], *args[1:5], scale=0.125, impl="native")
    assert_close(dec, paged_attention_reference(*args, scale=0.125)[:, 0], F32)
    bf = make_batch(16, 3, 3, 64, BF16, [(1, 40)], 1, 4)  # bf16 q and pages: q widened, output cast back
    assert native_supported(jnp.bfloat16, jnp.bfloat16) and native_supported(jnp.float32, jnp.bfloat16)
    out = paged_attention(*bf, scale=0.125)
    assert out.dtype == BF16
    np.testing.assert_array_equal(np.asarray(out), np.asarray(native(*bf, scale=0.125)))
    assert_close(out, paged_attention_reference(*bf, scale=0.125), BF16)
    assert not native_supported(jnp.float16, jnp.float32)


def test_chained_inside_jit():
    """Called per layer inside jit with traced lengths, as the engine does."""
    args = make_batch(16, 3, 3, 64, F32, [(1, 40), (1, 77), (1, 5)], 1, 8)

    @jax.jit
    def two_layers(q, k, v, tables, kv_lens, q_lens):
        out = native(q, k, v, tables, kv_lens, q_lens, scale=0.125)
        return native(out, k, v, tables, kv_lens - 1, q_lens, scale=0.125)

    ref1 = paged_attention_reference(*args, scale=0.125)
    want = paged_attention_reference(ref1, *args[1:4], args[4] - 1, args[5], scale=0.125)
    assert_close(two_layers(*args), want, F32)


def test_disabled_or_unbuildable_falls_back(tmp_path):
    """No compiler (or PAGEDJAX_NATIVE_ATTENTION=0): available() is False and auto is ragged."""
    code = ("from pagedjax.pallas_kernels.paged_attention import cpu_native as c, ops; import jax.numpy as jnp; "
            "print(c.available(), ops.native_supported(jnp.float32, jnp.float32))")
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), PAGEDJAX_CACHE=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
    assert "no C++ compiler found" in out.stderr
    env = dict(os.environ, PAGEDJAX_NATIVE_ATTENTION="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_loading_the_kernel_keeps_denormals():
    """The library must not switch the process to flush-to-zero (gcc's crtfastmath.o does that
    for -ffast-math builds)."""
    code = ("import numpy as np; from pagedjax.pallas_kernels.paged_attention import cpu_native as c; "
            "assert c.available(); print(float(np.float32(1e-38) / np.float32(100)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert float(out.stdout) > 0


def test_a_nan_stays_in_its_own_row():
    """A NaN in one query row makes that row's output NaN (as the reference's softmax does) and
    no other: the vectorized softmax must not turn it into a weight of 0."""
    rng = np.random.default_rng(3)
    hkv, nb, bs, d, h = 2, 40, 16, 64, 4
    k, v = (jnp.asarray(rng.standard_normal((hkv, nb, bs, d)), jnp.float32) for _ in range(2))
    tables = jnp.asarray(rng.permutation(nb)[:16].reshape(2, 8), jnp.int32)
    q = rng.standard_normal((6, h, d)).astype(np.float32)
    q[0, 0, 0] = np.nan
    out = np.asarray(cpu_native.packed_attention_native(
        jnp.asarray(q), k, v, tables, jnp.array([37, 100], jnp.int32), jnp.array([0, 3], jnp.int32),
        jnp.array([3, 3], jnp.int32), scale=0.125))
    nan = np.isnan(out).any(-1)  # [token, head]
    assert nan[0, 0] and nan.sum() == 1
