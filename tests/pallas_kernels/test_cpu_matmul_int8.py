"""The native int8-weight matmul (pallas_kernels/cpu_matmul/cpu_matmul_int8.cc): bit for bit its
jnp reference (x quantized per row, the integer dot exact), which is close to the float matmul
against the dequantized weights; shapes, zero rows, jit, and the errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu_matmul
from pallas_kernels.cpu_matmul import matmul_int8, matmul_int8_reference, matmul_quantized

pytestmark = [
    pytest.mark.skipif(jax.default_backend() != "cpu", reason="native CPU kernels"),
    pytest.mark.skipif(not cpu_matmul.int8_available(),
                       reason="native int8 matmul: CPU with AVX512-VNNI and a C++ compiler"),
]


def quantize(w):
    """w [O, I] float -> (w_q [O, I] int8, w_scale [O] float32): per output channel, symmetric."""
    w = np.asarray(w, np.float32)
    scale = np.abs(w).max(axis=1) / 127
    w_q = np.clip(np.round(w / np.where(scale > 0, scale, 1)[:, None]), -127, 127).astype(np.int8)
    return jnp.asarray(w_q), jnp.asarray(scale, jnp.float32)


def random_inputs(m, o, i, seed):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, i)), jnp.float32)
    w_q = jnp.asarray(rng.integers(-128, 128, (o, i)), jnp.int8)  # the full int8 range, -128 included
    w_scale = jnp.asarray(rng.uniform(1e-4, 1e-2, o), jnp.float32)
    return x, w_q, w_scale


@pytest.mark.parametrize("m", [1, 2, 3, 5, 16, 33, cpu_matmul.INT8_MAX_ROWS])
@pytest.mark.parametrize("o,i", [(832, 576), (576, 1536), (7, 64), (50, 128), (4096, 576)])
def test_matches_the_reference(m, o, i):
    """Row tiles of 1-4 rows (M = 1, 2, 3, 5, 33), a last output block that is partial (O = 50,
    832 past 64s) or only the scalar tail (O = 7); integer sums exact, so the same floats."""
    x, w_q, w_scale = random_inputs(m, o, i, seed=m * 7 + o + i)
    got = np.asarray(jax.jit(matmul_int8)(x, w_q, w_scale))
    want = np.asarray(matmul_int8_reference(x, w_q, w_scale))
    assert got.shape == (m, o) and got.dtype == np.float32
    np.testing.assert_array_equal(got, want)


def test_wide_head():
    x, w_q, w_scale = random_inputs(32, 49152 // 4, 576, seed=1)
    np.testing.assert_array_equal(np.asarray(matmul_quantized(x, w_q, w_scale)),
                                  np.asarray(matmul_int8_reference(x, w_q, w_scale)))


def test_zero_rows_give_zeros():
    x, w_q, w_scale = random_inputs(6, 100, 192, seed=2)
    x = x.at[0].set(0).at[4].set(0)
    got = np.asarray(jax.jit(lambda x, w_q, s: matmul_int8(x, w_q, s) + 0)(x, w_q, w_scale))
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got[[0, 4]], 0)
    np.testing.assert_array_equal(got, np.asarray(matmul_int8_reference(x, w_q, w_scale)))
    empty = jax.jit(lambda x, w_q, s: matmul_int8(x * 2, w_q, s) + 0)(jnp.ones((3, 0)), jnp.ones((5, 0), jnp.int8),
                                                                      jnp.ones(5))
    np.testing.assert_array_equal(np.asarray(empty), np.zeros((3, 5), np.float32))  # I = 0: empty sums


@pytest.mark.parametrize("m,o,i", [(1, 832, 576), (16, 576, 1536)])
def test_reference_is_close_to_the_float_matmul(m, o, i):
    """Quantizing x per row costs well under 2% against x @ the dequantized weights, and
    per-channel int8 weights about as much against the float weights."""
    rng = np.random.default_rng(m + o)
    x = rng.standard_normal((m, i)).astype(np.float32)
    w = (rng.standard_normal((o, i)) * 0.02).astype(np.float32)
    w_q, w_scale = quantize(w)
    dequantized = np.asarray(w_q, np.float32) * np.asarray(w_scale)[:, None]
    got = np.asarray(matmul_int8_reference(jnp.asarray(x), w_q, w_scale))
    rel = lambda a, b: np.linalg.norm(a - b) / np.linalg.norm(b)
    assert rel(got, x @ dequantized.T) < 2e-2
    assert rel(got, x @ w.T) < 2e-2
    np.testing.assert_array_equal(np.asarray(matmul_int8(jnp.asarray(x), w_q, w_scale)), got)


def test_in_a_jitted_graph():
    """Among other ops and on a bf16 x (taken as float32)."""
    x, w_q, w_scale = random_inputs(4, 256, 320, seed=3)

    @jax.jit
    def f(x, w_q, w_scale):
        h = jnp.tanh(x)
        return matmul_quantized(h.astype(jnp.bfloat16), w_q, w_scale) * 2 + 1

    want = matmul_int8_reference(jnp.tanh(x).astype(jnp.bfloat16), w_q, w_scale) * 2 + 1
    np.testing.assert_allclose(np.asarray(f(x, w_q, w_scale)), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_supported_and_targets():
    limit = cpu_matmul.INT8_MAX_ROWS
    assert cpu_matmul.supported(1, 576, 832, jnp.int8) and cpu_matmul.supported(limit, 1536, 7, jnp.int8)
    assert not cpu_matmul.supported(limit + 1, 576, 832, jnp.int8)  # prefill: the caller's dot
    assert not cpu_matmul.supported(16, 96, 832, jnp.int8)  # I % 64
    assert not cpu_matmul.supported(16, 576, 832, jnp.float8_e4m3fn)
    assert cpu_matmul.target(jnp.int8) == "pagedjax_matmul_int8" and cpu_matmul.max_rows(jnp.int8) == limit
    assert cpu_matmul.target(jnp.float8_e4m3fn) is None and cpu_matmul.max_rows(jnp.float8_e4m3fn) == 0


def test_errors():
    x, w_q, w_scale = random_inputs(2, 8, 64, seed=4)
    with pytest.raises(ValueError, match="int8"):
        matmul_int8(x, w_q.astype(jnp.bfloat16), w_scale)
    with pytest.raises(ValueError, match="int8"):
        matmul_int8(x.astype(jnp.int32), w_q, w_scale)
    with pytest.raises(ValueError, match=r"\[M, I\]"):
        matmul_int8(x[0], w_q, w_scale)  # rank
    with pytest.raises(ValueError, match=r"\[M, I\]"):
        matmul_int8(x, w_q, w_scale[:, None])
    with pytest.raises(ValueError, match=r"w_scale \[O\]"):
        matmul_int8(x, w_q, w_scale[:4])
    with pytest.raises(ValueError, match=r"w_q \[O, I\]"):
        matmul_int8(jnp.ones((2, 128)), w_q, w_scale)
    with pytest.raises(ValueError, match="multiple of 64"):
        matmul_int8(x[:, :48], w_q[:, :48], w_scale)
    with pytest.raises(ValueError, match="int8 only"):
        matmul_quantized(x, w_q.astype(jnp.float8_e4m3fn), w_scale)
