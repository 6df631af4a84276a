"""models.llama.linear: which matmul a bf16 prompt-sized x [M, I] . w[O, I]^T takes on CPU, and
that every path gives the bf16 dot's result."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.models import llama


def bf16_reference(x, w):
    return np.asarray(jnp.einsum("mi,oi->mo", x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32,
                                 precision="highest"))


@pytest.mark.parametrize("lacks_bf16", [True, False])
@pytest.mark.parametrize("rows", [llama.WIDEN_BF16_MIN_ROWS - 1, llama.WIDEN_BF16_MIN_ROWS, 300])
def test_prompt_sized_bf16_widens_only_without_bf16_arithmetic(monkeypatch, rows, lacks_bf16):
    """A CPU without bf16 arithmetic (AVX2 only): from WIDEN_BF16_MIN_ROWS rows the weights are
    widened to float32 inside the call and XLA's f32 dot runs; the same sums either way."""
    monkeypatch.setattr(llama, "_cpu_lacks_bf16", lambda: lacks_bf16)
    monkeypatch.setattr(llama.cpu_matmul, "supported", lambda *a: False)  # XLA's dots only
    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.standard_normal((rows, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((48, 64)) * 0.1, jnp.bfloat16)
    fn = lambda x, w: llama.linear(x, w, native=True)
    text = jax.jit(fn).lower(x, w).as_text()
    widened = "tensor<48x64xbf16>) -> tensor<48x64xf32>" in text  # a float32 copy of w feeds the dot
    assert widened == (lacks_bf16 and rows >= llama.WIDEN_BF16_MIN_ROWS)
    got = np.asarray(jax.jit(fn)(x, w))
    want = bf16_reference(x, w)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).mean() * 8)


def test_not_native_keeps_the_bf16_dot(monkeypatch):
    """Off the single-device CPU path (native=False: accelerators, sharded meshes) nothing is widened."""
    monkeypatch.setattr(llama, "_cpu_lacks_bf16", lambda: True)
    x = jnp.ones((llama.WIDEN_BF16_MIN_ROWS, 64), jnp.float32)
    w = jnp.ones((48, 64), jnp.bfloat16)
    assert "tensor<48x64xf32>" not in jax.jit(lambda x, w: llama.linear(x, w)).lower(x, w).as_text()


@pytest.mark.parametrize("backend", ["cpu", "gpu", "tpu"])
def test_float32_weights_ask_for_full_f32_passes_on_accelerators(monkeypatch, backend):
    """GPU/TPU round float32 dot inputs to TF32 / bf16 by default; float32 weights ask for HIGHEST
    there (the f32 parity with transformers on an H200 passed with it). CPU programs stay as they
    were, and bf16 weights keep the default."""
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    x = jnp.ones((4, 64), jnp.float32)
    f32 = jax.jit(lambda x, w: llama.linear(x, w)).lower(x, jnp.ones((48, 64), jnp.float32)).as_text()
    bf16 = jax.jit(lambda x, w: llama.linear(x, w)).lower(x, jnp.ones((48, 64), jnp.bfloat16)).as_text()
    assert ("HIGHEST" in f32) == (backend != "cpu")
    assert "HIGHEST" not in bf16
