"""The native matmuls (pallas_kernels/cpu_matmul) against their jnp references on each path
this CPU has (AVX512-BF16, AMX, AVX2 with bf16 or float32 weights), and the model's decode
steps running them."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.pallas_kernels import cpu_matmul
from pagedjax.pallas_kernels.cpu_matmul import matmul_avx2, matmul_bf16, matmul_bf16_reference

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="native CPU kernels")
needs_avx512 = pytest.mark.skipif(not cpu_matmul.available(),
                                  reason="native bf16 matmul: CPU with AVX512-BF16 and a C++ compiler")
needs_avx2 = pytest.mark.skipif(not cpu_matmul.avx2_available(),
                                reason="native AVX2 matmul: CPU with AVX2 and FMA and a C++ compiler")

needs_amx = pytest.mark.skipif(not cpu_matmul.available() or not cpu_matmul.amx_available(),
                               reason="the kernel's AMX path: a CPU with AMX (Sapphire Rapids or later)")
PATHS = [pytest.param(False, id="avx512", marks=needs_avx512), pytest.param(True, id="amx", marks=needs_amx)]


@pytest.mark.parametrize("amx", PATHS)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 16, 29, 32])  # up to 8: the GEMV tiles (16 / MR weight rows a tile)
@pytest.mark.parametrize("o,i", [(16, 32), (20, 64), (44, 96), (112, 64), (960, 576), (576, 1536)])
def test_matches_the_reference(m, o, i, amx):  # 20, 44: weight rows past the last GEMV tile
    rng = np.random.default_rng(m * 7 + o)
    x = jnp.asarray(rng.standard_normal((m, i)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((o, i)) * 0.1, jnp.bfloat16)
    mm = jax.jit(lambda x, w: matmul_bf16(x, w, amx=amx))
    got = np.asarray(mm(x, w))
    want = np.asarray(matmul_bf16_reference(x, w))
    assert got.shape == (m, o) and got.dtype == np.float32
    # same bf16 products, float32 sums in another order: within a few float32 ulps of the sums' scale
    scale = np.sqrt(i) * np.abs(want).mean()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * scale)
    # x is rounded to bf16 like x.astype(bfloat16): exactly representable inputs give exact sums
    xb = x.astype(jnp.bfloat16).astype(jnp.float32)
    np.testing.assert_allclose(np.asarray(mm(xb, w)), got, rtol=0, atol=0)


@needs_amx
@pytest.mark.parametrize("m,o,i", [(4, 100, 32), (17, 48, 96), (64, 16, 64), (300, 80, 160)])
def test_amx_path_odd_shapes(m, o, i):
    """AMX tiles: any M (a last row block of 1-15 rows, several block pairs), one or two weight
    tiles of 16 rows per task (O = 48: a task with a single tile); O % 16 == 0 only."""
    rng = np.random.default_rng(m + o + i)
    x = jnp.asarray(rng.standard_normal((m, i)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((o, i)) * 0.1, jnp.bfloat16)
    if o % 16:
        with pytest.raises(ValueError, match="AMX"):
            matmul_bf16(x, w, amx=True)
        return
    want = np.asarray(matmul_bf16_reference(x, w))
    np.testing.assert_allclose(np.asarray(jax.jit(lambda x, w: matmul_bf16(x, w, amx=True))(x, w)), want,
                               rtol=0, atol=1e-5 * np.sqrt(i) * np.abs(want).mean())


@needs_avx2
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 16, 29, 64])
@pytest.mark.parametrize("o,i", [(1, 8), (7, 40), (50, 64), (960, 576), (576, 1536), (13, 2056)])  # 2056: chunks of I, uneven
def test_avx2_path_matches_the_reference(m, o, i, dtype):
    """Both tile shapes (2 x 6, 1 x 8 by M; padded rows), remainders of O past the tile
    and the task block (O = 1, 7, 50), bf16 and float32 weights."""
    rng = np.random.default_rng(m * 7 + o + i)
    x = jnp.asarray(rng.standard_normal((m, i)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((o, i)) * 0.1, dtype)
    mm = jax.jit(matmul_avx2)
    got = np.asarray(mm(x, w))
    want = np.asarray(jnp.einsum("mi,oi->mo", x.astype(dtype), w, preferred_element_type=jnp.float32,
                                 precision="highest"))
    assert got.shape == (m, o) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.sqrt(i) * np.abs(want).mean())
    if dtype == jnp.bfloat16:  # x rounded like x.astype(bfloat16): bf16-exact inputs give the same sums
        xb = x.astype(jnp.bfloat16).astype(jnp.float32)
        np.testing.assert_allclose(np.asarray(mm(xb, w)), got, rtol=0, atol=0)


@needs_avx2
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_avx2_empty_inputs_give_zeros(dtype):
    """I = 0: every sum is empty (inside jit, where the output buffer is not zeroed for us)."""
    x = jnp.ones((3, 0), jnp.float32)
    got = jax.jit(lambda x, w: matmul_avx2(x * 2, w) + 0)(x, jnp.ones((5, 0), dtype))
    np.testing.assert_array_equal(np.asarray(got), np.zeros((3, 5), np.float32))


@needs_avx2
def test_avx2_errors():
    with pytest.raises(ValueError, match="multiple of 8"):
        matmul_avx2(jnp.ones((2, 12)), jnp.ones((4, 12)))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        matmul_avx2(jnp.ones((2, 16)), jnp.ones((4, 16), jnp.float16))
    limit = cpu_matmul.AVX2_MAX_ROWS["float32"]
    assert cpu_matmul.supported(limit, 576, 7, jnp.float32)
    assert not cpu_matmul.supported(limit + 1, 576, 960, jnp.float32)  # prefill: XLA
    assert not cpu_matmul.supported(16, 12, 960, jnp.float32)  # I % 8
    assert not cpu_matmul.supported(16, 576, 960, jnp.float16)


@needs_avx512
def test_supported_shapes_and_errors():
    assert cpu_matmul.supported(16, 576, 960)
    assert not cpu_matmul.supported(max(cpu_matmul.MAX_ROWS, cpu_matmul.AMX_MAX_ROWS) + 1, 576, 960)  # prefill: XLA
    assert not cpu_matmul.supported(16, 48, 960)  # I % 32
    assert not cpu_matmul.supported(16, 576, 962)  # O % 4
    assert cpu_matmul.supported(16, 576, 100) and cpu_matmul.supported(16, 576, 112)  # AVX512 / either path
    with pytest.raises(ValueError, match="AVX512"):
        matmul_bf16(jnp.ones((cpu_matmul.MAX_ROWS + 1, 32)), jnp.ones((16, 32), jnp.bfloat16), amx=False)
    with pytest.raises(ValueError, match="bfloat16"):
        matmul_bf16(jnp.ones((2, 32)), jnp.ones((4, 32), jnp.float32))
    with pytest.raises(ValueError, match=r"\[M, I\]"):
        matmul_bf16(jnp.ones((2, 64)), jnp.ones((4, 32), jnp.bfloat16))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_decode_steps_run_the_kernel(tiny_checkpoints, dtype):
    """An engine's decode-sized steps call the kernel that serves its weights here (its
    prefill-sized ones keep XLA's dot); where none does, XLA's dot everywhere."""
    from pagedjax import LLM

    path = tiny_checkpoints("llama")[0]
    kw = dict(max_num_seqs=8, max_model_len=128, block_size=8, num_blocks=64, warmup=False)
    engine = LLM(str(path), dtype=dtype, **kw).engine
    runner = engine.runner
    name = cpu_matmul.target(dtype)
    texts = {t: runner.compile_bucket(t).as_text() for t in runner.buckets.token_buckets()}
    if name is None:
        assert not any("pagedjax_matmul" in text for text in texts.values())
        return
    calls = lambda t: texts[t].count(f'custom_call_target="{name}"')
    head = 1 if engine.model.native_head else 0  # the vocab head, on the step's few sampled rows
    prefill = next(t for t in texts if t > cpu_matmul.max_rows(dtype))
    assert calls(8) > head and calls(prefill) == head
