"""The native float8_e4m3fn-weight matmul (pallas_kernels/cpu_matmul/cpu_matmul_fp8.cc): its jnp
reference (x and w_q in bf16, the dot in f32, times w_scale) up to the order of the f32 sums;
every one of the 256 codes widened exactly (NaN codes give NaN); shapes, zero rows, jit,
matmul_quantized's dispatch and the errors."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pagedjax.pallas_kernels import cpu_matmul
from pagedjax.pallas_kernels.cpu_matmul import matmul_fp8, matmul_fp8_reference, matmul_quantized

pytestmark = [
    pytest.mark.skipif(jax.default_backend() != "cpu", reason="native CPU kernels"),
    pytest.mark.skipif(not cpu_matmul.fp8_available(),
                       reason="native fp8 matmul: CPU with AVX512-BF16 and a C++ compiler"),
]

CODES = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)  # every code, NaNs at 0x7F and 0xFF


def random_inputs(m, o, i, seed):
    """Weights drawn from every finite code (subnormals, zeros and 448 included)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, i)), jnp.float32)
    finite = CODES[np.isfinite(CODES.astype(np.float32))]
    w_q = jnp.asarray(rng.choice(finite, (o, i)))
    w_scale = jnp.asarray(rng.uniform(1e-4, 1e-2, o), jnp.float32)
    return x, w_q, w_scale


def assert_close(got, want):
    """Equal up to the order of the f32 sums: within a few ulps of the sum of |terms|."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6 * np.abs(want).max())


@pytest.mark.parametrize("m", [1, 3, 16, 33, cpu_matmul.FP8_MAX_ROWS])
@pytest.mark.parametrize("o,i", [(832, 576), (576, 1536), (7, 64), (50, 96)])
def test_matches_the_reference(m, o, i):
    """Row tiles of 1-4 rows (M = 1, 3, 33: widened in registers, then from the buffer past 4
    rows), a partial last output block (832, 50) and the scalar tail (O = 7, 50)."""
    x, w_q, w_scale = random_inputs(m, o, i, seed=m * 7 + o + i)
    got = jax.jit(matmul_fp8)(x, w_q, w_scale)
    assert_close(got, matmul_fp8_reference(x, w_q, w_scale))
    dequantized = np.asarray(w_q, np.float64) * np.asarray(w_scale, np.float64)[:, None]
    want = np.asarray(x.astype(jnp.bfloat16), np.float64) @ dequantized.T
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("o", [256, 255])  # 255: the last code through the scalar tail
def test_every_code_exact(o):
    """Weight row c holds code c at column c % 32 (zeros elsewhere); one-hot rows of x (x 1,
    -2) pick each out: exactly its value (times the power-of-two scale), NaN for 0x7F / 0xFF
    (whose rows are NaN in every row of x: NaN * 0)."""
    w = np.zeros((o, 32), ml_dtypes.float8_e4m3fn)
    w[np.arange(o), np.arange(o) % 32] = CODES[:o]
    w_q, w_scale = jnp.asarray(w), jnp.full((o,), 0.5, jnp.float32)
    for sign in (1.0, -2.0):
        x = jnp.eye(32, dtype=jnp.float32) * sign
        got = np.asarray(matmul_fp8(x, w_q, w_scale))
        np.testing.assert_array_equal(got, np.asarray(matmul_fp8_reference(x, w_q, w_scale)))
        values = CODES[:o].astype(np.float32)
        picked = got[np.arange(o) % 32, np.arange(o)]
        np.testing.assert_array_equal(picked, values * np.float32(sign * 0.5))
        nan = np.isnan(values)
        assert np.isnan(got[:, nan]).all() and np.isfinite(got[:, ~nan]).all()


def test_zero_rows_and_empty():
    x, w_q, w_scale = random_inputs(6, 100, 192, seed=2)
    x = x.at[0].set(0).at[4].set(0)
    got = np.asarray(jax.jit(lambda x, w_q, s: matmul_fp8(x, w_q, s) + 0)(x, w_q, w_scale))
    np.testing.assert_array_equal(got[[0, 4]], 0)
    assert_close(got, matmul_fp8_reference(x, w_q, w_scale))
    empty = jax.jit(lambda x, w_q, s: matmul_fp8(x * 2, w_q, s) + 0)(
        jnp.ones((3, 0)), jnp.ones((5, 0), jnp.float8_e4m3fn), jnp.ones(5))
    np.testing.assert_array_equal(np.asarray(empty), np.zeros((3, 5), np.float32))  # I = 0: empty sums


def test_wide_head():
    x, w_q, w_scale = random_inputs(cpu_matmul.FP8_MAX_ROWS, 49152 // 4, 576, seed=1)
    assert_close(matmul_quantized(x, w_q, w_scale), matmul_fp8_reference(x, w_q, w_scale))


def test_in_a_jitted_graph():
    """Among other ops, on a bf16 x, through matmul_quantized (act_bits does not apply)."""
    x, w_q, w_scale = random_inputs(4, 256, 320, seed=3)

    @jax.jit
    def f(x, w_q, w_scale):
        return matmul_quantized(jnp.tanh(x).astype(jnp.bfloat16), w_q, w_scale) * 2 + 1

    want = matmul_fp8_reference(jnp.tanh(x).astype(jnp.bfloat16), w_q, w_scale) * 2 + 1
    np.testing.assert_allclose(np.asarray(f(x, w_q, w_scale)), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(matmul_quantized(x, w_q, w_scale, act_bits=8)),
                                  np.asarray(matmul_fp8(x, w_q, w_scale)))


def test_supported_and_targets():
    limit, fp8 = cpu_matmul.FP8_MAX_ROWS, jnp.float8_e4m3fn
    assert cpu_matmul.supported(1, 576, 832, fp8) and cpu_matmul.supported(limit, 1536, 7, fp8)
    assert not cpu_matmul.supported(limit + 1, 576, 832, fp8)  # prefill: the caller's dot
    assert not cpu_matmul.supported(16, 80, 832, fp8)  # I % 32
    assert not cpu_matmul.supported(16, 576, 832, jnp.float8_e5m2)
    assert cpu_matmul.target(fp8) == "pagedjax_matmul_fp8" and cpu_matmul.max_rows(fp8) == limit


def test_errors():
    x, w_q, w_scale = random_inputs(2, 8, 64, seed=4)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        matmul_fp8(x, w_q.astype(jnp.bfloat16), w_scale)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        matmul_fp8(x, w_q.astype(jnp.float8_e5m2), w_scale)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        matmul_fp8(x.astype(jnp.int32), w_q, w_scale)
    with pytest.raises(ValueError, match=r"\[M, I\]"):
        matmul_fp8(x[0], w_q, w_scale)  # rank
    with pytest.raises(ValueError, match=r"\[M, I\]"):
        matmul_fp8(x, w_q, w_scale[:, None])
    with pytest.raises(ValueError, match=r"w_scale \[O\]"):
        matmul_fp8(x, w_q, w_scale[:4])
    with pytest.raises(ValueError, match=r"w_q \[O, I\]"):
        matmul_fp8(jnp.ones((2, 128)), w_q, w_scale)
    with pytest.raises(ValueError, match="multiple of 32"):
        matmul_fp8(x[:, :48], w_q[:, :48], w_scale)
    with pytest.raises(ValueError, match="int8 or float8_e4m3fn only"):
        matmul_quantized(x, w_q.astype(jnp.float8_e5m2), w_scale)
    with pytest.raises(ValueError, match="act_bits must be 8 or 16"):
        matmul_quantized(x, w_q, w_scale, act_bits=4)
