"""The native int8-weight matmul (pallas_kernels/cpu_matmul/cpu_matmul_int8.cc): bit for bit its
jnp reference (x quantized per row, the integer dot exact), which is close to the float matmul
against the dequantized weights; shapes, zero rows, jit, and the errors. Both activation modes:
act_bits=8 (W8A8, vpdpbusd) and 16 (x as int16, vpdpwssd; what matmul_quantized runs for
x_dtype=float32; bf16 x: test_cpu_matmul_int8_bf16.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.pallas_kernels import cpu_matmul
from pagedjax.pallas_kernels.cpu_matmul import matmul_int8, matmul_int8_reference, matmul_quantized

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


@pytest.mark.parametrize("act_bits", [8, 16])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 33, cpu_matmul.INT8_MAX_ROWS])
@pytest.mark.parametrize("o,i", [(832, 576), (576, 1536), (7, 64), (50, 128), (4096, 576)])
def test_matches_the_reference(m, o, i, act_bits):
    """Row tiles of 1-4 rows (M = 1, 2, 3, 5, 33), a last output block that is partial (O = 50,
    832 past 64s) or only the scalar tail (O = 7, 50); integer sums exact (16 bits: in lanes,
    then the same float tree), so the same floats."""
    x, w_q, w_scale = random_inputs(m, o, i, seed=m * 7 + o + i)
    got = np.asarray(jax.jit(matmul_int8, static_argnames="act_bits")(x, w_q, w_scale, act_bits=act_bits))
    want = np.asarray(matmul_int8_reference(x, w_q, w_scale, act_bits=act_bits))
    assert got.shape == (m, o) and got.dtype == np.float32
    np.testing.assert_array_equal(got, want)


def test_wide_head():
    x, w_q, w_scale = random_inputs(32, 49152 // 4, 576, seed=1)
    np.testing.assert_array_equal(np.asarray(matmul_quantized(x, w_q, w_scale, x_dtype=jnp.float32)),  # 16-bit
                                  np.asarray(matmul_int8_reference(x, w_q, w_scale, act_bits=16)))
    np.testing.assert_array_equal(np.asarray(matmul_quantized(x, w_q, w_scale, act_bits=8, x_dtype=jnp.float32)),
                                  np.asarray(matmul_int8_reference(x, w_q, w_scale)))


def test_16_bit_lanes_at_the_largest_i():
    """The worst case at I = INT8_A16_MAX_IN: every x_q 32767 (or -32767) against -128 fills
    each int32 lane to 2147418112 in magnitude, exact; the total (3.4e10) is past int32 and
    comes from the float tree."""
    i = cpu_matmul.INT8_A16_MAX_IN
    x = jnp.stack([jnp.ones(i), -jnp.ones(i), jnp.linspace(-1, 1, i)]).astype(jnp.float32)
    w_q = jnp.full((5, i), -128, jnp.int8).at[4, ::2].set(127)
    w_scale = jnp.full((5,), 1e-3, jnp.float32)
    got = np.asarray(matmul_int8(x, w_q, w_scale, act_bits=16))
    np.testing.assert_array_equal(got, np.asarray(matmul_int8_reference(x, w_q, w_scale, act_bits=16)))
    want = np.asarray(x) @ (np.asarray(w_q, np.float64) * 1e-3).T
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("act_bits", [8, 16])
def test_zero_rows_give_zeros(act_bits):
    x, w_q, w_scale = random_inputs(6, 100, 192, seed=2)
    x = x.at[0].set(0).at[4].set(0)
    got = np.asarray(jax.jit(lambda x, w_q, s: matmul_int8(x, w_q, s, act_bits) + 0)(x, w_q, w_scale))
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got[[0, 4]], 0)
    np.testing.assert_array_equal(got, np.asarray(matmul_int8_reference(x, w_q, w_scale, act_bits)))
    empty = jax.jit(lambda x, w_q, s: matmul_int8(x * 2, w_q, s, act_bits) + 0)(
        jnp.ones((3, 0)), jnp.ones((5, 0), jnp.int8), jnp.ones(5))
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


@pytest.mark.parametrize("m,o,i", [(1, 832, 576), (16, 576, 1536), (64, 960, 576)])
def test_16_bit_activations_are_close_to_the_float_matmul(m, o, i):
    """16-bit activations: under 1e-4 relative against x @ the dequantized weights (Gaussian x;
    8-bit: ~1e-2), and still under 1e-3 with a few outlier channels (x30) setting each row's
    scale, where 8-bit is some 100x coarser."""
    rng = np.random.default_rng(m + o + i)
    w = (rng.standard_normal((o, i)) * 0.02).astype(np.float32)
    w_q, w_scale = quantize(w)
    dequantized = np.asarray(w_q, np.float64) * np.asarray(w_scale, np.float64)[:, None]
    for outliers, bound in ((1, 1e-4), (30, 1e-3)):
        x = rng.standard_normal((m, i)).astype(np.float32)
        x[:, :3] *= outliers
        want = x.astype(np.float64) @ dequantized.T
        rel = lambda a: np.linalg.norm(a - want) / np.linalg.norm(want)
        got = np.asarray(matmul_quantized(jnp.asarray(x), w_q, w_scale, x_dtype=jnp.float32))  # act_bits 16
        assert rel(got) < bound
        np.testing.assert_array_equal(got, np.asarray(matmul_int8_reference(jnp.asarray(x), w_q, w_scale, 16)))
        assert rel(np.asarray(matmul_int8(jnp.asarray(x), w_q, w_scale, act_bits=8))) > 50 * rel(got)


def test_in_a_jitted_graph():
    """Among other ops and on a bf16 x (taken as float32)."""
    x, w_q, w_scale = random_inputs(4, 256, 320, seed=3)

    @jax.jit
    def f(x, w_q, w_scale):
        h = jnp.tanh(x)
        return matmul_quantized(h.astype(jnp.bfloat16), w_q, w_scale, x_dtype=jnp.float32) * 2 + 1

    want = matmul_int8_reference(jnp.tanh(x).astype(jnp.bfloat16), w_q, w_scale, act_bits=16) * 2 + 1
    np.testing.assert_allclose(np.asarray(f(x, w_q, w_scale)), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_supported_and_targets():
    limit = cpu_matmul.INT8_MAX_ROWS
    assert cpu_matmul.supported(1, 576, 832, jnp.int8) and cpu_matmul.supported(limit, 1536, 7, jnp.int8)
    assert not cpu_matmul.supported(limit + 1, 576, 832, jnp.int8)  # prefill: the caller's dot
    assert not cpu_matmul.supported(16, 96, 832, jnp.int8)  # I % 64
    i_max = cpu_matmul.INT8_A16_MAX_IN
    assert cpu_matmul.supported(1, i_max, 8, jnp.int8) and not cpu_matmul.supported(1, i_max + 64, 8, jnp.int8)
    assert not cpu_matmul.supported(16, 576, 832, jnp.float8_e5m2)  # fp8 e4m3: test_cpu_matmul_fp8.py
    assert cpu_matmul.target(jnp.int8) == "pagedjax_matmul_int8" and cpu_matmul.max_rows(jnp.int8) == limit
    assert cpu_matmul.target(jnp.float8_e5m2) is None and cpu_matmul.max_rows(jnp.float8_e5m2) == 0


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
    with pytest.raises(ValueError, match="int8 or float8_e4m3fn only"):
        matmul_quantized(x, w_q.astype(jnp.float8_e5m2), w_scale)
    for bad in (4, 32, 0, "16", True):
        with pytest.raises(ValueError, match="act_bits must be 8 or 16"):
            matmul_int8(x, w_q, w_scale, act_bits=bad)
        with pytest.raises(ValueError, match="act_bits must be 8 or 16"):
            matmul_quantized(x, w_q, w_scale, act_bits=bad)
        with pytest.raises(ValueError, match="act_bits must be 8 or 16"):
            matmul_int8_reference(x, w_q, w_scale, act_bits=bad)
    i = cpu_matmul.INT8_A16_MAX_IN + 64
    with pytest.raises(ValueError, match="I <= 8192"):
        matmul_int8(jnp.ones((1, i)), jnp.ones((4, i), jnp.int8), jnp.ones(4), act_bits=16)
    matmul_int8(jnp.ones((1, i)), jnp.ones((4, i), jnp.int8), jnp.ones(4), act_bits=8)  # no such limit
