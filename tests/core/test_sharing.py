"""Prefix caching, copy-on-write forks, parallel sampling and beam search."""
import numpy as np
import pytest

from pagedjax import LLM, BeamSearchParams, SamplingParams

BS = 8


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    path, _ = tiny_checkpoints("llama")
    return LLM(str(path), max_num_seqs=8, max_model_len=160, block_size=BS, num_blocks=160, warmup=False)


def shared_prefix_prompts(n, prefix_len=37, seed=0):
    rng = np.random.default_rng(seed)
    prefix = rng.integers(2, 384, size=prefix_len).tolist()
    return [prefix + rng.integers(2, 384, size=int(rng.integers(1, 12))).tolist() for _ in range(n)]


def test_outputs_identical_with_prefix_caching_and_chunking_on_and_off(tiny_checkpoints):
    path, _ = tiny_checkpoints("llama")
    prompts = shared_prefix_prompts(10)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    results = {}
    for caching in (True, False):
        for budget in (16, 256):
            llm = LLM(str(path), max_num_seqs=4, max_model_len=160, block_size=BS, num_blocks=64,
                      enable_prefix_caching=caching, max_num_batched_tokens=budget, warmup=False)
            results[caching, budget] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            stats = llm.stats()
            assert stats["kv_blocks_free"] == 64
            assert (stats["prefix_cache_hit_tokens"] > 0) == caching
    first = results[True, 256]
    assert all(r == first for r in results.values())


def test_shared_system_prompt_is_computed_once(llm):
    prompts = shared_prefix_prompts(20, prefix_len=64, seed=1)
    before = llm.stats()
    llm.engine.pool.reset_prefix_cache()
    llm.generate(prompts[:1], SamplingParams(max_tokens=1), use_tqdm=False)
    llm.generate(prompts[1:], SamplingParams(max_tokens=1), use_tqdm=False)
    stats = llm.stats()
    hits = stats["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
    shareable = 19 * (64 // BS) * BS
    assert hits >= 0.95 * shareable


def test_shared_prompt_of_requests_arriving_together_is_computed_once(llm):
    """All added before the first step: the first computes the 64-token prefix, the others
    wait for its blocks and hit them; greedy tokens are those of each prompt computed alone."""
    prompts = shared_prefix_prompts(8, prefix_len=64, seed=2)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    llm.engine.pool.reset_prefix_cache()
    before = llm.stats()
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.stats()
    assert stats["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"] == 7 * 64
    computed = stats["num_computed_prompt_tokens"] - before["num_computed_prompt_tokens"]
    assert computed == 64 + sum(len(p) - 64 for p in prompts)
    for prompt, out in zip(prompts, outs):
        llm.engine.pool.reset_prefix_cache()
        assert out.outputs[0].token_ids == unshared(llm, prompt, params)


def unshared(llm, prompt, params):
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("prompt_len, copies", [(13, 3), (16, 0)])
def test_parallel_sampling_forks_share_blocks_and_copy_only_the_written_one(llm, prompt_len, copies):
    prompt = list(range(10, 10 + prompt_len))
    llm.engine.pool.reset_prefix_cache()
    before = llm.stats()
    out = llm.generate([prompt], SamplingParams(n=4, max_tokens=10, temperature=1.0, seed=7, ignore_eos=True),
                       use_tqdm=False)[0]
    stats = llm.stats()
    assert stats["num_cow_copies"] - before["num_cow_copies"] == copies  # n-1 iff the last prompt block is partial
    assert stats["num_forks"] - before["num_forks"] == 3
    assert stats["num_computed_prompt_tokens"] - before["num_computed_prompt_tokens"] == prompt_len
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    for i, o in enumerate(out.outputs):  # each branch: exactly the tokens of an unshared run with its seed
        assert o.token_ids == unshared(llm, prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=7 + i,
                                                                   ignore_eos=True))
    again = llm.generate([prompt], SamplingParams(n=4, max_tokens=10, temperature=1.0, seed=7, ignore_eos=True),
                         use_tqdm=False)[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]
    assert stats["kv_blocks_free"] == 160


@pytest.mark.parametrize("length_penalty, early_stopping", [(1.0, False), (0.5, True), (2.0, "never")])
def test_beam_search_matches_transformers(tiny_checkpoints, llm, length_penalty, early_stopping):
    torch = pytest.importorskip("torch")
    _, hf = tiny_checkpoints("llama")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(2, 384, size=k).tolist() for k in (5, 8, 13)]
    params = BeamSearchParams(beam_width=4, max_tokens=12, length_penalty=length_penalty,
                              early_stopping=early_stopping)
    outs = llm.beam_search(prompts, params=params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            g = hf.generate(torch.tensor([prompt]), max_new_tokens=12, num_beams=4, do_sample=False,
                            length_penalty=length_penalty, early_stopping=early_stopping, eos_token_id=1,
                            pad_token_id=0, return_dict_in_generate=True, output_scores=True)
        want = g.sequences[0, len(prompt):].tolist()
        if 1 in want:
            want = want[:want.index(1) + 1]
        assert out.sequences[0].token_ids == want
        assert out.sequences[0].score == pytest.approx(float(g.sequences_scores[0]), abs=1e-4)
    assert llm.stats()["kv_blocks_free"] == 160  # pruned and finished beams gave every block back
