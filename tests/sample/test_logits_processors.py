"""Penalties, logit bias, token masks and prompt logprobs, against references nobody here
wrote (transformers' logits processors and forward pass) or a plain numpy reference on the
same logits; each row's processing is independent of its batch-mates."""
import numpy as np
import pytest
import torch

from pagedjax import LLM, SamplingParams
from tiny_models import hf_greedy

VOCAB = 384


def _prompts(seed, lengths):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, VOCAB, size=k).tolist() for k in lengths]


@pytest.fixture(scope="module")
def llama(tiny_checkpoints):
    path, hf_model = tiny_checkpoints("llama")
    llm = LLM(str(path), max_num_seqs=4, max_model_len=128, block_size=8, num_blocks=64,
              max_num_batched_tokens=64, warmup=False)
    return llm, hf_model


def _hf_logits(hf_model, ids):
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].double().numpy()  # [L, V]


def _reference_greedy(hf_model, prompt, n, bias=None, presence=0.0, frequency=0.0, repetition=1.0, allowed=None):
    """Greedy decoding with the processors applied in numpy to transformers' logits."""
    ids = list(prompt)
    for _ in range(n):
        x = _hf_logits(hf_model, ids)[-1]
        out = ids[len(prompt):]
        if bias:
            for t, b in bias.items():
                x[t] += b
        seen = np.zeros_like(x, bool)
        seen[ids] = True
        x = np.where(seen, np.where(x > 0, x / repetition, x * repetition), x)
        counts = np.bincount(out, minlength=len(x)).astype(np.float64)
        x = x - frequency * counts - presence * (counts > 0)
        if allowed is not None:
            keep = np.zeros_like(x, bool)
            keep[allowed] = True
            x = np.where(keep, x, -np.inf)
        ids.append(int(np.argmax(x)))
    return ids[len(prompt):]


def test_repetition_penalty_matches_transformers(llama):
    llm, hf_model = llama
    prompts = _prompts(0, [5, 12, 30])
    want = []
    for p in prompts:
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, repetition_penalty=1.5,
                                    eos_token_id=None, pad_token_id=0, min_new_tokens=12)
        want.append(out[0, len(p):].tolist())
    # a plain greedy batch-mate next to the penalized rows is unaffected
    params = [SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=1.5)] * 3 + \
             [SamplingParams(max_tokens=12, ignore_eos=True)]
    outs = llm.generate(prompts + [prompts[0]], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:3]] == want
    assert outs[3].outputs[0].token_ids == hf_greedy(hf_model, prompts[0], 12)
    assert want[0] != outs[3].outputs[0].token_ids  # the penalty changed something


@pytest.mark.parametrize("kw", [dict(presence=1.5), dict(frequency=0.9), dict(presence=-0.5, frequency=1.2),
                                dict(bias={7: 8.0, 11: 5.5, 3: -100.0}), dict(repetition=0.7, frequency=0.4)])
def test_penalties_and_bias_match_numpy_reference(llama, kw):
    llm, hf_model = llama
    prompts = _prompts(1, [9, 20])
    want = [_reference_greedy(hf_model, p, 10, **kw) for p in prompts]
    sp = SamplingParams(max_tokens=10, ignore_eos=True, presence_penalty=kw.get("presence", 0.0),
                        frequency_penalty=kw.get("frequency", 0.0), repetition_penalty=kw.get("repetition", 1.0),
                        logit_bias=kw.get("bias"))
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want


def test_allowed_token_ids_and_min_tokens(llama):
    llm, hf_model = llama
    prompt = _prompts(2, [10])[0]
    allowed = [5, 17, 42, 99, 200]
    out = llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True, allowed_token_ids=allowed),
                       use_tqdm=False)[0].outputs[0].token_ids
    assert out == _reference_greedy(hf_model, prompt, 8, allowed=allowed)
    # EOS (id 1) made overwhelmingly likely: min_tokens holds it off, then it stops the request
    sp = SamplingParams(max_tokens=20, min_tokens=6, logit_bias={1: 100.0})
    out = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 7 and 1 not in out.token_ids[:6] and out.token_ids[6] == 1
    assert out.finish_reason == "stop"
    # stop_token_ids are held off as well
    sp = SamplingParams(max_tokens=20, min_tokens=4, ignore_eos=True, stop_token_ids=[9], logit_bias={9: 100.0})
    out = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5 and out.token_ids[4] == 9 and 9 not in out.token_ids[:4]


def test_seeded_sampling_with_penalties_ignores_batch_mates(llama):
    llm, _ = llama
    prompts = _prompts(3, [6, 14, 25, 8])
    sp = SamplingParams(max_tokens=10, temperature=0.9, seed=123, ignore_eos=True, presence_penalty=1.0,
                        frequency_penalty=0.5, logit_bias={4: 3.0})
    alone = llm.generate([prompts[0]], sp, use_tqdm=False)[0].outputs[0].token_ids
    mates = [SamplingParams(max_tokens=7, temperature=1.2, seed=7, repetition_penalty=1.3),
             SamplingParams(max_tokens=12, allowed_token_ids=[3, 4, 5]), SamplingParams(max_tokens=5)]
    batch = llm.generate(prompts, [sp] + mates, use_tqdm=False)
    assert batch[0].outputs[0].token_ids == alone


def test_penalties_survive_preemption_and_n(tiny_checkpoints):
    """A pool too small for every request: preempted requests reload their counts; n=2 forks
    keep their own counts."""
    path, hf_model = tiny_checkpoints("llama")
    llm = LLM(str(path), max_num_seqs=6, max_model_len=128, block_size=8, num_blocks=12,
              max_num_batched_tokens=32, warmup=False)
    prompts = _prompts(4, [20, 15, 22, 18])
    sp = SamplingParams(max_tokens=16, ignore_eos=True, frequency_penalty=1.1, presence_penalty=0.3)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in outs] == \
        [_reference_greedy(hf_model, p, 16, frequency=1.1, presence=0.3) for p in prompts]
    two = llm.generate([prompts[0]], SamplingParams(max_tokens=6, n=2, ignore_eos=True, frequency_penalty=1.1,
                                                    presence_penalty=0.3), use_tqdm=False)[0]
    assert [o.token_ids for o in two.outputs] == [_reference_greedy(hf_model, prompts[0], 6, frequency=1.1,
                                                                    presence=0.3)] * 2
    assert llm.stats()["kv_blocks_free"] == 12


def _hf_prompt_logprobs(hf_model, ids):
    x = _hf_logits(hf_model, ids)
    lp = x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)
    return lp  # [L, V]: row i predicts token i + 1


def test_prompt_logprobs_match_a_full_forward_pass_with_prefix_caching(llama):
    llm, hf_model = llama
    shared = _prompts(5, [24])[0]
    prompt = shared + [7, 8, 9, 10, 11]
    llm.generate([shared + [3]], SamplingParams(max_tokens=2), use_tqdm=False)  # caches the shared blocks
    hits = llm.stats()["prefix_cache_hit_tokens"]
    out = llm.generate([prompt, shared + [4, 5]], [SamplingParams(max_tokens=3, prompt_logprobs=3),
                                                    SamplingParams(max_tokens=3)], use_tqdm=False)
    assert llm.stats()["prefix_cache_hit_tokens"] > hits  # the plain request still hit the cache
    plp = out[0].prompt_logprobs
    assert out[1].prompt_logprobs is None
    ref = _hf_prompt_logprobs(hf_model, prompt)
    assert len(plp) == len(prompt) and plp[0] is None
    for i in range(1, len(prompt)):
        entry = plp[i]
        assert entry[prompt[i]] == pytest.approx(ref[i - 1, prompt[i]], abs=2e-4)
        top = np.argsort(-ref[i - 1])[:3]
        assert set(top) <= set(entry) and len(entry) <= 4
    # scoring only: max_tokens=0 returns the prompt logprobs and no tokens
    scored = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=0), use_tqdm=False)[0]
    assert scored.outputs[0].token_ids == [] and scored.outputs[0].finish_reason == "length"
    assert [e if e is None else e[t] for e, t in zip(scored.prompt_logprobs, prompt)][1:] == \
        pytest.approx([ref[i - 1, prompt[i]] for i in range(1, len(prompt))], abs=2e-4)
    assert llm.stats()["kv_blocks_free"] == 64


def test_prompt_logprobs_across_chunks_and_long_prompts(tiny_checkpoints):
    """A prompt longer than the step budget is computed in chunks; every position is scored."""
    path, hf_model = tiny_checkpoints("qwen2")
    llm = LLM(str(path), max_num_seqs=2, max_model_len=256, block_size=8, num_blocks=64,
              max_num_batched_tokens=32, warmup=False)
    prompt = _prompts(6, [90])[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    ref = _hf_prompt_logprobs(hf_model, prompt)
    got = [out.prompt_logprobs[i][prompt[i]] for i in range(1, len(prompt))]
    assert got == pytest.approx([ref[i - 1, prompt[i]] for i in range(1, len(prompt))], abs=2e-4)


def test_processor_checks():
    with pytest.raises(ValueError, match="presence_penalty"):
        SamplingParams(presence_penalty=2.5)
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=0.0)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={5: 101})
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)
    with pytest.raises(ValueError, match="max_tokens may be 0"):
        SamplingParams(max_tokens=0)
    assert SamplingParams(logit_bias={"12": -3}).logit_bias == {12: -3.0}


def test_out_of_vocabulary_ids_are_refused(llama):
    llm, _ = llama
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate([[3, 4]], SamplingParams(logit_bias={VOCAB + 5: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate([[3, 4]], SamplingParams(allowed_token_ids=[VOCAB]), use_tqdm=False)
    assert llm.stats()["kv_blocks_free"] == 64
