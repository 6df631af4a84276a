"""dtype="bfloat16": bf16 matrices, float32 activations; kv_cache_dtype on its own.

Against the same tiny model in float32: raw log-probabilities agree to bf16 rounding, and greedy
outputs agree except where the float32 model itself has a near-tie.
"""
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.models.loader import load_model
from pagedjax import LLM, SamplingParams
from tiny_models import FAMILIES

ENGINE = dict(max_num_seqs=8, max_model_len=128, block_size=8, num_blocks=96, warmup=False)
MAX_NEW = 8


def _prompts():
    rng = np.random.default_rng(1)
    return [rng.integers(2, 384, size=k).tolist() for k in [7, 8, 9, 16, 33, 5, 60]]


def _run(path, **kw):
    """(greedy tokens, prompt logprobs of the prompt tokens, KV dtype) of the prompts."""
    llm = LLM(str(path), **ENGINE, **kw)
    prompts = _prompts()
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, prompt_logprobs=0),
                        use_tqdm=False)
    lps = np.array([o.prompt_logprobs[i][t] for o, p in zip(outs, prompts) for i, t in enumerate(p) if i])
    return [list(o.outputs[0].token_ids) for o in outs], lps, llm.engine.runner.kv[0].dtype


@pytest.fixture(scope="module")
def runs(tiny_checkpoints):
    return {family: {dt: _run(tiny_checkpoints(family)[0], dtype=dt) for dt in ("float32", "bfloat16")}
            for family in sorted(FAMILIES)}


def test_matrices_in_bf16_the_rest_in_float32(tiny_checkpoints):
    model, _, _ = load_model(tiny_checkpoints("qwen2")[0], dtype="bfloat16")  # q/k/v biases
    layer = model.layers[0]
    for p in (model.embed, model.lm_head, layer.attn.wqkv, layer.attn.wo, layer.mlp.w_gate_up, layer.mlp.w_down):
        if p is not None:
            assert p[...].dtype == jnp.bfloat16
    for p in (model.norm, layer.input_norm, layer.post_attention_norm, layer.attn.bqkv):
        assert p[...].dtype == jnp.float32
    assert model.dtype == jnp.bfloat16


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logprobs_agree_with_float32(runs, family):
    (_, lp32, kv32), (_, lp16, kv16) = runs[family]["float32"], runs[family]["bfloat16"]
    assert (kv32, kv16) == (jnp.float32, jnp.bfloat16)  # kv_cache_dtype "auto": the model dtype
    diff = np.abs(lp32 - lp16)  # log-probabilities of size ~7 nats
    assert diff.mean() < 0.04 and diff.max() < 0.25, (diff.mean(), diff.max())


def test_greedy_mostly_agrees_with_float32(runs):
    """Over 4 families x 7 prompts, most first-8-token outputs are identical (the rest part at
    a near-tie of the random tiny model)."""
    same = total = 0
    for family in runs:
        for a, b in zip(runs[family]["float32"][0], runs[family]["bfloat16"][0]):
            same += a == b
            total += 1
    assert same >= 0.7 * total, f"{same}/{total}"


def test_kv_cache_dtype_apart_from_the_model_dtype(tiny_checkpoints, runs):
    path = tiny_checkpoints("llama")[0]
    toks, lps, kv = _run(path, dtype="float32", kv_cache_dtype="bfloat16")
    assert kv == jnp.bfloat16
    assert np.abs(lps - runs["llama"]["float32"][1]).max() < 0.1  # only K/V rounded
    toks, lps, kv = _run(path, dtype="bfloat16", kv_cache_dtype="float32")
    assert kv == jnp.float32
    assert np.abs(lps - runs["llama"]["bfloat16"][1]).max() < 0.1


def test_dense_backend(tiny_checkpoints, runs):
    """kv_cache="dense" in bf16 reads bf16 KV through the same kernel; only the step shapes
    (and so the matmul tilings) differ from the paged run."""
    toks, lps, kv = _run(tiny_checkpoints("mistral")[0], dtype="bfloat16", kv_cache="dense")
    assert kv == jnp.bfloat16
    assert np.abs(lps - runs["mistral"]["bfloat16"][1]).max() < 0.05
    assert sum(a == b for a, b in zip(toks, runs["mistral"]["bfloat16"][0])) >= 5


def test_forks_copy_on_write_in_bf16(tiny_checkpoints, runs):
    """n=2 greedy: both samples fork the prompt's last, partly filled block (copy-on-write of a
    bf16 pool) and equal the n=1 output."""
    llm = LLM(str(tiny_checkpoints("qwen3")[0]), dtype="bfloat16", **ENGINE)
    prompts = _prompts()[:3]
    outs = llm.generate(prompts, SamplingParams(n=2, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    for out, want in zip(outs, runs["qwen3"]["bfloat16"][0]):
        assert [list(c.token_ids) for c in out.outputs] == [want, want]


def test_bad_dtypes_are_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM(None, kv_cache_dtype="float16")
    with pytest.raises(ValueError, match="dtype must be 'auto' or one of"):
        LLM(None, dtype="int8")


def test_command_line_flags():
    """`--dtype` / `--kv-cache-dtype` (generate and serve share these engine arguments)."""
    import argparse

    from pagedjax.entrypoints.cli_args import add_engine_arguments, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    kw = engine_kwargs(parser.parse_args(["--dtype", "bfloat16", "--kv-cache-dtype", "float32"]))
    assert (kw["dtype"], kw["kv_cache_dtype"]) == ("bfloat16", "float32")
    kw = engine_kwargs(parser.parse_args([]))
    assert (kw["dtype"], kw["kv_cache_dtype"]) == ("auto", "auto")
