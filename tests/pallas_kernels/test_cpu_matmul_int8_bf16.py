"""The int8-weight bf16-dot matmul (pallas_kernels/cpu_matmul/cpu_matmul_fp8.cc, the fp8 kernel
templated on the weight format): its jnp reference (x and w_q in bf16, the dot in f32, times
w_scale) up to the order of the f32 sums; every one of the 256 int8 values widened exactly;
shapes, zero rows, jit, the errors, and matmul_quantized's dispatch by x_dtype (bfloat16: this
kernel; float32: the 16-bit-activation kernel; fp8 weights: the fp8 kernel either way)."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pagedjax.pallas_kernels import cpu_matmul
from pagedjax.pallas_kernels.cpu_matmul import (matmul_fp8, matmul_int8, matmul_int8_bf16, matmul_int8_bf16_reference,
                                       matmul_int8_reference, matmul_quantized)

pytestmark = [
    pytest.mark.skipif(jax.default_backend() != "cpu", reason="native CPU kernels"),
    pytest.mark.skipif(not cpu_matmul.int8_bf16_available(),
                       reason="native int8 bf16-dot matmul: CPU with AVX512-BF16 and a C++ compiler"),
]


def random_inputs(m, o, i, seed):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, i)), jnp.float32)
    w_q = jnp.asarray(rng.integers(-128, 128, (o, i)), jnp.int8)  # the full int8 range, -128 included
    w_scale = jnp.asarray(rng.uniform(1e-4, 1e-2, o), jnp.float32)
    return x, w_q, w_scale


def assert_close(got, want):
    """Equal up to the order of the f32 sums: within a few ulps of the largest output."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6 * np.abs(want).max())


@pytest.mark.parametrize("m", [1, 3, 16, 33, cpu_matmul.INT8_MAX_ROWS])
@pytest.mark.parametrize("o,i", [(832, 576), (576, 1536), (7, 64), (50, 96)])
def test_matches_the_reference(m, o, i):
    """Row tiles of 1-4 rows (M = 1, 3: widened in registers; 16, 33, 64: then from the per-task
    buffer), a partial last output block (832, 50), the scalar tail (O = 7, 50) and I = 96 (a
    multiple of 32, not 64: the 16-bit kernel would refuse it)."""
    x, w_q, w_scale = random_inputs(m, o, i, seed=m * 7 + o + i)
    got = jax.jit(matmul_int8_bf16)(x, w_q, w_scale)
    assert_close(got, matmul_int8_bf16_reference(x, w_q, w_scale))
    dequantized = np.asarray(w_q, np.float64) * np.asarray(w_scale, np.float64)[:, None]
    want = np.asarray(x.astype(jnp.bfloat16), np.float64) @ dequantized.T
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("o", [256, 255])  # 255: the last code through the scalar tail
def test_every_value_exact(o):
    """Weight row c holds the int8 value c - 128 at column c % 32 (zeros elsewhere); one-hot rows
    of x (x 1, -2) pick each out: exactly its value times the power-of-two scale."""
    values = np.arange(-128, 128)[:o].astype(np.int8)
    w = np.zeros((o, 32), np.int8)
    w[np.arange(o), np.arange(o) % 32] = values
    w_q, w_scale = jnp.asarray(w), jnp.full((o,), 0.5, jnp.float32)
    for sign in (1.0, -2.0):
        x = jnp.eye(32, dtype=jnp.float32) * sign
        got = np.asarray(matmul_int8_bf16(x, w_q, w_scale))
        np.testing.assert_array_equal(got, np.asarray(matmul_int8_bf16_reference(x, w_q, w_scale)))
        picked = got[np.arange(o) % 32, np.arange(o)]
        np.testing.assert_array_equal(picked, values.astype(np.float32) * np.float32(sign * 0.5))
        off = np.ones_like(got, bool)
        off[np.arange(o) % 32, np.arange(o)] = False
        np.testing.assert_array_equal(got[off], 0)


def test_every_value_in_every_position():
    """All 256 values at each of the 32 positions of a widened vector (and the buffer path, M = 8):
    a permuted ramp per row against x = powers of two, whose sums are exact in f32."""
    rng = np.random.default_rng(5)
    w = np.stack([rng.permutation(np.arange(-128, 128)) for _ in range(64)]).astype(np.int8)  # [64, 256]
    x = np.zeros((8, 256), np.float32)
    for r in range(8):
        x[r, r::8] = 2.0 ** (np.arange(32) % 12 - 4)  # distinct powers of two
    got = np.asarray(matmul_int8_bf16(jnp.asarray(x), jnp.asarray(w), jnp.ones(64, jnp.float32)))
    want = x.astype(np.float64) @ w.astype(np.float64).T  # exact in f32 (magnitudes < 2^24 ulps)
    np.testing.assert_array_equal(got, want.astype(np.float32))


def test_zero_rows_and_empty():
    x, w_q, w_scale = random_inputs(6, 100, 192, seed=2)
    x = x.at[0].set(0).at[4].set(0)
    got = np.asarray(jax.jit(lambda x, w_q, s: matmul_int8_bf16(x, w_q, s) + 0)(x, w_q, w_scale))
    np.testing.assert_array_equal(got[[0, 4]], 0)
    assert_close(got, matmul_int8_bf16_reference(x, w_q, w_scale))
    empty = jax.jit(lambda x, w_q, s: matmul_int8_bf16(x * 2, w_q, s) + 0)(
        jnp.ones((3, 0)), jnp.ones((5, 0), jnp.int8), jnp.ones(5))
    np.testing.assert_array_equal(np.asarray(empty), np.zeros((3, 5), np.float32))  # I = 0: empty sums


def test_wide_head():
    x, w_q, w_scale = random_inputs(cpu_matmul.INT8_MAX_ROWS, 49152 // 4, 576, seed=1)
    assert_close(matmul_quantized(x, w_q, w_scale), matmul_int8_bf16_reference(x, w_q, w_scale))


def test_in_a_jitted_graph():
    """Among other ops, on a bf16 x (rounding it again changes nothing)."""
    x, w_q, w_scale = random_inputs(4, 256, 320, seed=3)

    @jax.jit
    def f(x, w_q, w_scale):
        return matmul_quantized(jnp.tanh(x).astype(jnp.bfloat16), w_q, w_scale, x_dtype=jnp.bfloat16) * 2 + 1

    want = matmul_int8_bf16_reference(jnp.tanh(x).astype(jnp.bfloat16), w_q, w_scale) * 2 + 1
    np.testing.assert_allclose(np.asarray(f(x, w_q, w_scale)), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("act_bits", [8, 16])
def test_matmul_quantized_dispatch_by_x_dtype(act_bits):
    """int8 weights: x_dtype bfloat16 (the default) runs this kernel (act_bits checked, not used),
    float32 (or float16) the x-quantizing kernel at act_bits; fp8 weights: the fp8 kernel for
    either x_dtype."""
    x, w_q, w_scale = random_inputs(16, 64, 576, seed=6)
    bf16 = np.asarray(matmul_int8_bf16(x, w_q, w_scale))
    quantized_x = np.asarray(matmul_int8(x, w_q, w_scale, act_bits=act_bits))
    assert not np.array_equal(bf16, quantized_x)  # the two kernels tell apart
    run = lambda **kw: np.asarray(jax.jit(lambda x: matmul_quantized(x, w_q, w_scale, act_bits=act_bits, **kw))(x))
    np.testing.assert_array_equal(run(), bf16)
    np.testing.assert_array_equal(run(x_dtype=jnp.bfloat16), bf16)
    np.testing.assert_array_equal(run(x_dtype="bfloat16"), bf16)
    np.testing.assert_array_equal(run(x_dtype=jnp.float32), quantized_x)
    np.testing.assert_array_equal(run(x_dtype=jnp.float16), quantized_x)
    np.testing.assert_array_equal(quantized_x, np.asarray(matmul_int8_reference(x, w_q, w_scale, act_bits)))
    small = jnp.clip(w_q, -8, 8)  # exact in e4m3 too
    f8 = small.astype(jnp.float32).astype(jnp.float8_e4m3fn)
    want = np.asarray(matmul_fp8(x, f8, w_scale))
    np.testing.assert_array_equal(want, np.asarray(matmul_int8_bf16(x, small, w_scale)))  # one kernel: the same sums
    for x_dtype in (jnp.bfloat16, jnp.float32):
        np.testing.assert_array_equal(np.asarray(matmul_quantized(x, f8, w_scale, act_bits, x_dtype=x_dtype)), want)


def test_matmul_quantized_without_the_kernel(monkeypatch):
    """Where AVX512-BF16 is missing, int8 weights with a bf16 x take the 16-bit-activation kernel."""
    x, w_q, w_scale = random_inputs(4, 64, 128, seed=7)
    monkeypatch.setattr(cpu_matmul, "int8_bf16_available", lambda: False)
    np.testing.assert_array_equal(np.asarray(matmul_quantized(x, w_q, w_scale)),
                                  np.asarray(matmul_int8_reference(x, w_q, w_scale, act_bits=16)))


def test_supported_covers_both_int8_kernels():
    """What supported() offers for int8 each int8 kernel takes: rows up to INT8_MAX_ROWS, I % 64."""
    limit = cpu_matmul.INT8_MAX_ROWS
    assert cpu_matmul.supported(limit, 1536, 7, jnp.int8) and not cpu_matmul.supported(limit + 1, 576, 8, jnp.int8)
    assert cpu_matmul.max_rows(jnp.int8) == limit
    x, w_q, w_scale = random_inputs(limit, 12, 1536, seed=8)
    for x_dtype in (jnp.bfloat16, jnp.float32):
        assert matmul_quantized(x, w_q, w_scale, x_dtype=x_dtype).shape == (limit, 12)


def test_errors():
    x, w_q, w_scale = random_inputs(2, 8, 64, seed=4)
    with pytest.raises(ValueError, match="w_q int8"):
        matmul_int8_bf16(x, w_q.astype(jnp.bfloat16), w_scale)
    with pytest.raises(ValueError, match="w_q int8"):
        matmul_int8_bf16(x, w_q.astype(jnp.float8_e4m3fn), w_scale)
    with pytest.raises(ValueError, match="w_q int8"):
        matmul_int8_bf16(x.astype(jnp.int32), w_q, w_scale)
    with pytest.raises(ValueError, match=r"\[M, I\]"):
        matmul_int8_bf16(x[0], w_q, w_scale)  # rank
    with pytest.raises(ValueError, match=r"\[M, I\]"):
        matmul_int8_bf16(x, w_q, w_scale[:, None])
    with pytest.raises(ValueError, match=r"w_scale \[O\]"):
        matmul_int8_bf16(x, w_q, w_scale[:4])
    with pytest.raises(ValueError, match=r"w_q \[O, I\]"):
        matmul_int8_bf16(jnp.ones((2, 128)), w_q, w_scale)
    with pytest.raises(ValueError, match="multiple of 32"):
        matmul_int8_bf16(x[:, :48], w_q[:, :48], w_scale)
    with pytest.raises(ValueError, match="x_dtype"):
        matmul_quantized(x, w_q, w_scale, x_dtype=jnp.int8)
    with pytest.raises(ValueError, match="act_bits must be 8 or 16"):
        matmul_quantized(x, w_q, w_scale, act_bits=4)  # checked whichever kernel x_dtype picks
    with pytest.raises(ValueError, match="int8 or float8_e4m3fn only"):
        matmul_quantized(x, w_q.astype(ml_dtypes.float8_e5m2), w_scale)
