"""quantization="int8" / "fp8" weights and kv_cache_dtype="int8" / "fp8".

Weights: the oracle is the float32 engine on a checkpoint whose matrices were replaced by their
dequantized 8-bit versions (w_q * scale): the quantized engine must compute that same model.
KV: every attention path on quantized pages equals the reference on the dequantized pages, and
the engine with an 8-bit cache stays close to the float32 one (copy-on-write and the dense
backend included).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.models.kv_cache import kv_bytes_per_token
from pagedjax.models.quantization import dequantize_weight, quantize_weight
from pagedjax import LLM, SamplingParams
from pagedjax.pallas_kernels.paged_attention import kv_quant
from pagedjax.pallas_kernels.paged_attention.ops import packed_paged_attention
from pagedjax.pallas_kernels.paged_attention.packed import packed_attention_reference

ENGINE = dict(max_num_seqs=8, max_model_len=128, block_size=8, num_blocks=96, warmup=False, dtype="float32")
MAX_NEW = 8
_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _prompts():
    rng = np.random.default_rng(1)
    return [rng.integers(2, 384, size=k).tolist() for k in [7, 9, 16, 33, 60]]


def _run(path, **kw):
    """(greedy tokens, prompt log-probs of the prompt tokens, the engine)."""
    llm = LLM(str(path), **{**ENGINE, **kw})
    prompts = _prompts()
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, prompt_logprobs=0),
                        use_tqdm=False)
    lps = np.array([o.prompt_logprobs[i][t] for o, p in zip(outs, prompts) for i, t in enumerate(p) if i])
    return [list(o.outputs[0].token_ids) for o in outs], lps, llm


def _dequantized_checkpoint(model, path, quantization):
    """Saves `model` (torch) with every decoder matrix replaced by dequantize(quantize(w))."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".weight") and any(f".{n}." in name for n in _LINEAR):
                q, s = quantize_weight(p.numpy(), quantization)
                p.copy_(torch.from_numpy(np.asarray(dequantize_weight(q, s))))
    model.save_pretrained(str(path))


@pytest.mark.parametrize("quantization,rows_err", [("int8", 0.5 / 127), ("fp8", 2.0 ** -4)])
def test_quantize_weight(quantization, rows_err):
    rng = np.random.default_rng(0)
    w = rng.normal(size=(3, 40, 64)).astype(np.float32)  # stacked [L, O, I]
    w[1, 5] = 0.0
    q, s = quantize_weight(w, quantization)
    assert q.shape == w.shape and s.shape == (3, 40) and s.dtype == np.float32
    assert q.dtype == (np.int8 if quantization == "int8" else jnp.float8_e4m3fn)
    assert s[1, 5] == 1.0 and not np.asarray(q[1, 5], np.float32).any()
    err = np.abs(np.asarray(dequantize_weight(q, s)) - w)
    amax = np.abs(w).max(-1, keepdims=True)
    if quantization == "int8":
        assert (err <= rows_err * amax * 1.0001 + 1e-7).all()
    else:  # 3 mantissa bits: relative error <= 2^-4 of each value (above the subnormal range)
        assert (err <= rows_err * np.abs(w) + amax / 448 * 2.0 ** -9 + 1e-7).all()


@pytest.mark.parametrize("family,quantization", [("llama", "int8"), ("qwen2", "int8"), ("qwen3", "fp8")])
def test_quantized_weights_compute_the_dequantized_model(tiny_checkpoints, tmp_path, family, quantization):
    path, model = tiny_checkpoints(family)
    import copy

    _dequantized_checkpoint(copy.deepcopy(model), tmp_path / "deq", quantization)
    for name in ("config.json", "generation_config.json"):
        if (path / name).exists():
            (tmp_path / "deq" / name).write_text((path / name).read_text())
    toks_q, lps_q, llm = _run(path, quantization=quantization)
    layer = llm.engine.model.layers[0]
    assert layer.attn.wqkv[...].dtype == (jnp.int8 if quantization == "int8" else jnp.float8_e4m3fn)
    assert layer.mlp.w_down_scale[...].dtype == jnp.float32
    assert llm.stats()["quantization"] == quantization
    toks_d, lps_d, _ = _run(tmp_path / "deq")
    assert np.abs(lps_q - lps_d).max() < 2e-3, np.abs(lps_q - lps_d).max()
    assert toks_q == toks_d


def test_quantized_weights_under_scan(tiny_checkpoints):
    """Stacked layers [L, O, I] get scales [L, O]; same outputs as the unrolled model."""
    path = tiny_checkpoints("llama")[0]
    toks_a, lps_a, _ = _run(path, quantization="int8")
    toks_b, lps_b, llm = _run(path, quantization="int8", scan_layers=True)
    assert llm.engine.model.layers.attn.wqkv_scale[...].ndim == 2
    assert np.abs(lps_a - lps_b).max() < 1e-4 and toks_a == toks_b


def _quantized_pool(rng, dtype, hkv=2, nb=12, bs=8, d=32):
    pages = rng.normal(size=(hkv, nb, bs, d)).astype(np.float32)
    pages[..., 3] *= 8  # an outlier channel
    q, s = kv_quant.quantize(jnp.asarray(pages), dtype)
    return kv_quant.QuantizedPages(q, s)


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn])
@pytest.mark.parametrize("impl", ["reference", "chunked", "ragged", "native"])
def test_attention_paths_on_quantized_pages(dtype, impl):
    rng = np.random.default_rng(3)
    kp, vp = _quantized_pool(rng, dtype), _quantized_pool(rng, dtype)
    tables = jnp.asarray([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]], jnp.int32)
    kv_lens = jnp.asarray([30, 5, 17], jnp.int32)
    cu = jnp.asarray([0, 4, 5, 12], jnp.int32)  # 4, 1 and 7 query tokens
    q = jnp.asarray(rng.normal(size=(12, 4, 32)), jnp.float32)
    want = packed_attention_reference(q, kv_quant.dequantize(kp.data, kp.scales),
                                      kv_quant.dequantize(vp.data, vp.scales), tables, kv_lens, cu, scale=0.2)
    got = jax.jit(lambda q, kp, vp: packed_paged_attention(q, kp, vp, tables, kv_lens, cu, scale=0.2,
                                                           impl=impl))(q, kp, vp)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_pallas_refuses_quantized_pages():
    rng = np.random.default_rng(0)
    kp = _quantized_pool(rng, jnp.int8)
    with pytest.raises(TypeError, match="QuantizedPages"):
        packed_paged_attention(jnp.zeros((2, 4, 32)), kp.data, kp.data, jnp.zeros((2, 4), jnp.int32),
                               jnp.ones(2, jnp.int32), jnp.asarray([0, 1, 2], jnp.int32))


def test_rotation_is_its_own_inverse():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(5, 3, 64)), jnp.float32)
    np.testing.assert_allclose(np.asarray(kv_quant.rotate(kv_quant.rotate(x))), np.asarray(x), atol=1e-5)
    odd = jnp.ones((2, 24))
    assert kv_quant.rotate(odd) is odd  # not a power of two: as is


def test_kv_bytes_count_the_scales():
    bf16 = kv_bytes_per_token(30, 3, 64, jnp.bfloat16)
    int8 = kv_bytes_per_token(30, 3, 64, jnp.int8)
    assert bf16 == 2 * 30 * 3 * 64 * 2 and int8 == 2 * 30 * 3 * (64 + 2)
    assert bf16 / int8 >= 1.9  # SmolLM2-135M's shape: ~1.94x the tokens in the same memory


@pytest.fixture(scope="module")
def f32_llama(tiny_checkpoints):
    return _run(tiny_checkpoints("llama")[0])


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_quantized_kv_cache_close_to_float32(tiny_checkpoints, f32_llama, kv_cache_dtype):
    toks, lps, llm = _run(tiny_checkpoints("llama")[0], kv_cache_dtype=kv_cache_dtype)
    kv = llm.engine.runner.kv[0]
    assert isinstance(kv, kv_quant.QuantizedPages) and kv.scales.dtype == jnp.float16
    assert llm.stats()["kv_cache_dtype"] == ("int8" if kv_cache_dtype == "int8" else "float8_e4m3fn")
    diff = np.abs(lps - f32_llama[1])
    assert diff.mean() < (0.02 if kv_cache_dtype == "int8" else 0.15), diff.mean()  # e4m3: 3 mantissa bits
    assert sum(a == b for a, b in zip(toks, f32_llama[0])) >= 3


def test_quantized_kv_copy_on_write_and_dense(tiny_checkpoints):
    """n=2 greedy forks the prompt's last block (its scales copied with it) and equals n=1; the
    dense backend reads the same int8 values through its own path."""
    path = tiny_checkpoints("llama")[0]
    toks, lps, _ = _run(path, kv_cache_dtype="int8")
    llm = LLM(str(path), **{**ENGINE, "kv_cache_dtype": "int8"})
    outs = llm.generate(_prompts()[:3], SamplingParams(n=2, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    for out, want in zip(outs, toks):
        assert [list(c.token_ids) for c in out.outputs] == [want, want]
    assert llm.stats()["num_cow_copies"] > 0
    toks_d, lps_d, _ = _run(path, kv_cache_dtype="int8", kv_cache="dense", num_blocks=None)
    assert np.abs(lps_d - lps).max() < 1e-3 and toks_d == toks


def test_bad_quantization_is_refused():
    with pytest.raises(ValueError, match="quantization must be None or one of"):
        LLM(None, quantization="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM(None, kv_cache_dtype="int4")


def test_compressed_tensors_checkpoint(tiny_checkpoints, tmp_path):
    """A pre-quantized checkpoint (compressed-tensors, int8 per channel, as llm-compressor
    writes it) loads in its own scheme and computes what quantization="int8" computes."""
    import json

    from safetensors.numpy import save_file

    path = tiny_checkpoints("llama")[0]
    from pagedjax.models.weights import load_tensors_from_dir

    tensors = {}
    for name, w in load_tensors_from_dir(path).items():
        if name.endswith(".weight") and any(f".{n}." in name for n in _LINEAR):
            q, s = quantize_weight(w, "int8")
            tensors[name], tensors[f"{name}_scale"] = q, s[:, None]
        else:
            tensors[name] = np.asarray(w)
    out = tmp_path / "ct"
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                      "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                                                  "strategy": "channel"}}}}
    (out / "config.json").write_text(json.dumps(config))
    toks_ct, lps_ct, llm = _run(out)
    assert llm.stats()["quantization"] == "int8"
    layer = llm.engine.model.layers[0]
    np.testing.assert_array_equal(np.asarray(layer.attn.wo[...]), tensors["model.layers.0.self_attn.o_proj.weight"])
    toks, lps, _ = _run(path, quantization="int8")
    assert toks_ct == toks and np.abs(lps_ct - lps).max() < 1e-4
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 4
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="4-bit int weights are not supported"):
        LLM(str(out), **ENGINE)
