"""Greedy outputs equal transformers' token for token, for each supported family."""
import numpy as np
import pytest

from pagedjax import LLM, SamplingParams
from tiny_models import FAMILIES, hf_greedy

MAX_NEW = 10


def _prompts(seed: int, n: int, vocab: int = 384):
    rng = np.random.default_rng(seed)
    lengths = [1, 7, 8, 9, 16, 33, 5, 60][:n]
    return [rng.integers(2, vocab, size=k).tolist() for k in lengths]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_matches_transformers(family, tiny_checkpoints):
    path, hf_model = tiny_checkpoints(family)
    prompts = _prompts(1, 8)
    expected = [hf_greedy(hf_model, p, MAX_NEW) for p in prompts]
    # fewer slots than prompts, so requests join and leave mid-run
    llm = LLM(str(path), max_num_seqs=3, max_model_len=128, block_size=8, num_blocks=96, warmup=False)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    for prompt, out, want in zip(prompts, outs, expected):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == want
        assert out.outputs[0].finish_reason == "length"
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0


def test_parity_while_buckets_compile_in_background(tiny_checkpoints):
    """warmup=True: generation starts with only the smallest bucket compiled, so the first
    steps cut prompts into 16-token chunks; the outputs do not change."""
    path, hf_model = tiny_checkpoints("qwen3")
    prompts = _prompts(3, 8)
    expected = [hf_greedy(hf_model, p, 12) for p in prompts]
    llm = LLM(str(path), max_num_seqs=4, max_model_len=128, block_size=8, max_num_batched_tokens=128)
    sched = llm.engine.scheduler
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert sched.pool.num_free == sched.pool.num_blocks
    llm.wait_for_warmup()
    assert llm.stats()["warmup_done"] and llm.engine.runner.compiled_shapes == [8, 16, 32, 48, 64, 96, 128]


def test_parity_under_preemption_and_chunked_prefill(tiny_checkpoints):
    """A pool too small for all requests at once, and a token budget that splits prompts."""
    path, hf_model = tiny_checkpoints("llama")
    prompts = _prompts(2, 8)
    expected = [hf_greedy(hf_model, p, 24) for p in prompts]
    llm = LLM(str(path), max_num_seqs=8, max_model_len=128, block_size=8, num_blocks=14,
              max_num_batched_tokens=32, warmup=False)
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.stats()["num_preemptions"] > 0
    assert llm.stats()["kv_blocks_free"] == 14
