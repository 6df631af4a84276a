"""Speculative decoding with prompt lookup: greedy outputs identical to plain decoding (and to
transformers), sampled outputs distributed exactly as the target model's, every block back."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax import LLM, SamplingParams
from pagedjax.sample.sampler import SamplingInputs, verify_drafts
from pagedjax.spec_decode.config import SpeculativeConfig
from pagedjax.spec_decode.ngram import propose
from pagedjax.spec_decode.policy import allocate_drafts
from tiny_models import hf_greedy

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _prompts():
    rng = np.random.default_rng(0)
    pattern = rng.integers(2, 384, 7).tolist()
    return [pattern * 4, rng.integers(2, 384, 23).tolist(), (pattern[:3] + [9]) * 5 + [11], [5, 6, 7]]


def test_propose_finds_the_latest_longest_match():
    t = np.array([1, 2, 3, 4, 5, 9, 1, 2, 3])
    assert propose(t, 3, 1, 3) == [4, 5, 9]
    assert propose(np.array([1, 2, 8, 1, 2, 7, 1, 2]), 2, 1, 2) == [7, 1]  # most recent match wins
    assert propose(np.array([5, 6, 7]), 3, 1, 3) == []
    # a match running into the end after a whole period (p <= n): the drafts go on around it
    assert propose(np.array([8, 7, 1, 2, 7, 1, 2]), 4, 1, 4) == [7, 1, 2, 7]
    assert propose(np.array([1, 2, 8, 1, 2, 7, 1, 2]), 4, 1, 2) == [7, 1, 2]  # p = 3 > n = 2: cut
    assert propose(np.array([3, 9, 9, 9, 9, 9]), 4, 1, 4) == [9, 9, 9, 9]
    assert propose(np.array([4, 5, 6, 5, 6, 5, 6]), 5, 1, 4) == [5, 6, 5, 6, 5]
    assert propose(np.array([3, 9, 9, 9, 9, 9]), 4, 1, 4, repeat_period=False) == [9]
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig.parse({"method": "ngram"})
    with pytest.raises(ValueError, match="not supported"):
        SpeculativeConfig.parse({"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="exceeds"):
        SpeculativeConfig.parse({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2})


def test_allocate_drafts_weighs_every_rung():
    rungs = [16, 32, 48, 64]
    # 48 costs barely more than 32 (as XLA:CPU's tiles often make it): eight requests with four
    # likely drafts each fit in 48 and pay there, although moving 16 -> 32 alone would not
    step = {16: 60.0, 32: 100.0, 48: 101.0, 64: 200.0}.get
    assert allocate_drafts([4] * 8, [0.8] * 8, 8, rungs, 64, 64, step) == [4] * 8
    # costs that rise steeply: the drafts stay in the free padding of the 16-token step, best first
    steep = {16: 60.0, 32: 200.0, 48: 300.0, 64: 400.0}.get
    # (the j-th draft of a request is worth rate^j: the 11 best of these 20 fill 16 - 5 slots)
    assert allocate_drafts([4] * 5, [0.9, 0.2, 0.6, 0.5, 0.3], 5, rungs, 64, 64, steep) == [4, 1, 3, 2, 1]
    # the limits hold: caps, max_drafts, the token budget; no drafts, no allocation
    assert allocate_drafts([2, 0, 9], [0.9] * 3, 3, rungs, 64, 64, step) == [2, 0, 9]
    assert sum(allocate_drafts([4] * 8, [0.9] * 8, 8, rungs, 64, 5, step)) == 5
    assert sum(allocate_drafts([4] * 8, [0.9] * 8, 8, rungs, 16, 64, step)) == 8
    assert allocate_drafts([0, 0], [0.5, 0.5], 2, rungs, 64, 64, step) == [0, 0]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_outputs_are_identical_with_and_without_speculation(family, tiny_checkpoints):
    path, hf_model = tiny_checkpoints(family)
    prompts = _prompts()
    kw = dict(max_num_seqs=4, max_model_len=256, block_size=8, num_blocks=96, max_num_batched_tokens=64,
              warmup=False)
    spec = LLM(str(path), speculative_config=SPEC, **kw)
    sp = SamplingParams(max_tokens=40, ignore_eos=True, logprobs=2)
    outs = spec.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf_model, p, 40) for p in prompts]
    stats = spec.stats()
    assert stats["spec_draft_tokens"] > 0 and stats["spec_accepted_tokens"] > 0
    assert stats["spec_mean_tokens_per_step"] > 1.2
    assert stats["kv_blocks_free"] == 96
    plain = LLM(str(path), **kw).generate(prompts, sp, use_tqdm=False)
    for a, b in zip(outs, plain):  # logprobs of each emitted token as plain decoding gives them
        for da, db in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert da.keys() == db.keys()
            assert list(da.values()) == pytest.approx(list(db.values()), abs=1e-4)


@pytest.mark.parametrize("proposer", ["ngram", "draft_model"])
def test_speculation_with_preemption_forks_stops_and_max_tokens(proposer, tiny_checkpoints):
    """Prompt lookup, and a draft model (the target as its own draft: drafts are accepted, so
    stops and max_tokens land inside accepted runs; test_draft_model.py has the rest)."""
    path, hf_model = tiny_checkpoints("llama")
    prompts = _prompts()
    spec = SPEC if proposer == "ngram" else {"model": str(path), "num_speculative_tokens": 4, "adaptive": False}
    llm = LLM(str(path), speculative_config=spec, max_num_seqs=6, max_model_len=256, block_size=8, num_blocks=20,
              max_num_batched_tokens=32, warmup=False)
    want = [hf_greedy(hf_model, p, 30) for p in prompts]
    outs = llm.generate(prompts, SamplingParams(max_tokens=30, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.stats()["num_preemptions"] > 0 and llm.stats()["spec_accepted_tokens"] > 0
    # n=2 greedy forks, each speculating on its own
    two = llm.generate([prompts[0]], SamplingParams(max_tokens=12, n=2, ignore_eos=True), use_tqdm=False)[0]
    assert [o.token_ids for o in two.outputs] == [want[0][:12]] * 2
    # a stop token in the middle of accepted drafts ends the output there; max_tokens is never exceeded
    stop = want[0][7]
    cut = llm.generate([prompts[0]], SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.token_ids == want[0][:want[0].index(stop) + 1] and cut.finish_reason == "stop"
    for m in (1, 2, 5, 9):
        o = llm.generate([prompts[0]], SamplingParams(max_tokens=m, ignore_eos=True), use_tqdm=False)[0]
        assert o.outputs[0].token_ids == want[0][:m]
    assert llm.stats()["kv_blocks_free"] == 20
    drafter = llm.engine.drafter
    assert drafter is None or drafter.num_free_blocks == drafter.cache.num_blocks


def test_verification_keeps_the_target_distribution():
    """Many rows with the same logits and a draft: the emitted token (the draft if accepted,
    else the redraw) is distributed as softmax(logits / T) after top-k, whatever the draft."""
    n, v = 20000, 6
    logits = jnp.asarray(np.tile([[2.0, 1.5, 0.3, -0.5, 1.0, -3.0]], (n, 1)), jnp.float32)
    for draft, temp, top_k in ((0, 1.0, 0), (3, 1.0, 0), (1, 0.7, 3), (5, 1.3, 0)):
        p = SamplingInputs(jnp.full(n, temp), jnp.full(n, top_k, jnp.int32), jnp.ones(n), jnp.zeros(n),
                           jnp.arange(n, dtype=jnp.uint32), jnp.zeros(n, jnp.int32), jnp.zeros(n, bool),
                           draft_next=jnp.full(n, draft, jnp.int32))
        accepted, resampled = jax.jit(verify_drafts)(logits, p)
        emitted = np.where(np.asarray(accepted), draft, np.asarray(resampled))
        x = np.asarray(logits[0], np.float64) / temp
        if top_k:
            x = np.where(x >= np.sort(x)[-top_k], x, -np.inf)
        want = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
        got = np.bincount(emitted, minlength=v) / n
        assert np.abs(got - want).sum() / 2 < 0.015, (draft, temp, got, want)


def test_sampled_outputs_follow_the_target_distribution(tiny_checkpoints):
    """The engine end to end: the second generated token is verified as a draft (the prompt
    holds most of the vocabulary, so the proposer almost always finds the first token in it)
    and must follow the model's own distribution given the first (temperature 0.8, top-k 4),
    computed from its raw logprobs: a chi-square test over many seeds, with and without
    speculation."""
    path, _ = tiny_checkpoints("llama")
    prompt = np.random.default_rng(1).permutation(np.arange(2, 384))[:320].tolist()
    kw = dict(max_num_seqs=32, max_model_len=384, block_size=16, num_blocks=1024, max_num_batched_tokens=512,
              warmup=False)
    n, temp = 800, 0.8
    params = [SamplingParams(max_tokens=3, temperature=temp, top_k=4, seed=s, ignore_eos=True) for s in range(n)]
    spec_cfg = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    for cfg in (spec_cfg, None):
        llm = LLM(str(path), speculative_config=cfg, **kw)
        pairs = [tuple(o.outputs[0].token_ids[:2]) for o in llm.generate([prompt] * n, params, use_tqdm=False)]
        if cfg:
            assert llm.stats()["spec_draft_tokens"] > n // 2
        chi2, cells = 0.0, 0
        for t1 in set(p[0] for p in pairs):
            seen = [p[1] for p in pairs if p[0] == t1]
            top = llm.generate([prompt + [t1]], SamplingParams(max_tokens=1, logprobs=20), use_tqdm=False)
            raw = sorted(top[0].outputs[0].logprobs[0].items(), key=lambda kv: -kv[1])[:4]
            x = np.array([lp for _, lp in raw]) / temp
            q = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
            assert set(seen) <= {t for t, _ in raw}, (cfg, t1, raw, seen[:20])  # only the top 4 are ever drawn
            for (t, _), prob in zip(raw, q):
                expected = prob * len(seen)
                if expected > 0:
                    chi2 += (seen.count(t) - expected) ** 2 / expected
                    cells += 1
        df = cells - len(set(p[0] for p in pairs))
        assert chi2 < df + 5 * np.sqrt(2 * df), (cfg, chi2, df)


def test_draft_depth_weighs_acceptance_against_the_draft_models_cost():
    from pagedjax.spec_decode.policy import draft_depth
    flat = lambda t: 0.020  # a weight-bound target: a step costs the same whatever its tokens
    per_draft = lambda ms: (lambda j: j * ms / 1e3)
    assert draft_depth([0.9] * 4, 4, flat, per_draft(1)) == 4  # a cheap, good draft: all of it
    assert draft_depth([0.9] * 4, 4, flat, per_draft(20)) == 0  # as costly as the target: none
    assert draft_depth([0.05] * 4, 4, flat, per_draft(2)) == 0  # a cheap draft that is never right: none
    assert draft_depth([1.0], 4, flat, per_draft(1)) == 4  # always accepted (no division by 1 - a)
    assert draft_depth([], 4, flat, per_draft(1)) == 0
    # a middling draft: deeper drafts are ever less likely to count, so the depth stops short of k
    assert 0 < draft_depth([0.6] * 4, 8, flat, per_draft(4)) < 8
    # a target whose step cost grows with its tokens makes deep drafts cost more
    growing = lambda t: 0.010 + 0.002 * t
    assert draft_depth([0.7] * 8, 4, growing, per_draft(0.5)) < draft_depth([0.7] * 8, 4, flat, per_draft(0.5))
    # only depths whose drafts a step can verify: 4 rows x 2 drafts fit in 8, x 3 do not
    assert draft_depth([0.9] * 4, 4, flat, per_draft(1), max_drafts=8) == 2
    assert draft_depth([0.9] * 4, 4, flat, per_draft(1), max_drafts=3) == 0
    # data parallel: 8 requests over 2 ranks make steps of 4 rows; a target whose cost grows with its
    # rows then drafts deeper than if all 8 shared one step
    assert draft_depth([0.8] * 8, 4, growing, per_draft(0.1), rows=4) > draft_depth([0.8] * 8, 4, growing, per_draft(0.1))
    assert draft_depth([0.9] * 4, 4, lambda t: 0.0, lambda j: 0.0) in range(5)  # nothing measured: no division by 0


def test_measured_costs_are_recent_medians_and_guess_the_nearest():
    from pagedjax.spec_decode.policy import COST_SAMPLES, MeasuredCosts
    costs = MeasuredCosts(lambda size: float(size))
    assert costs(16) == 16.0  # nothing measured yet
    for seconds in (0.010, 0.011, 0.500, 0.012):  # one slow outlier does not move a median much
        costs.add(8, seconds)
    assert costs(8) == pytest.approx(0.0115) and costs(32) == costs(8)
    costs.add(32, 0.040)
    assert costs(24) == 0.040 and costs(12) == costs(8) and costs.as_dict() == {8: costs(8), 32: 0.040}
    for _ in range(COST_SAMPLES):
        costs.add(8, 0.020)  # old samples age out
    assert costs(8) == 0.020


def test_measured_costs_forget_a_size_not_measured_for_long():
    """A size measured in a slow minute, and avoided since because it looked expensive, is
    forgotten after MAX_SAMPLE_AGE measurements of other sizes: priced as its nearest measured
    neighbour again, it gets tried (and measured) again."""
    from pagedjax.spec_decode.policy import MAX_SAMPLE_AGE, MeasuredCosts
    costs = MeasuredCosts(float)
    costs.add(16, 0.090)  # a neighbour slowed this one down
    for _ in range(MAX_SAMPLE_AGE - 1):
        costs.add(8, 0.020)
    assert costs(16) == 0.090  # still remembered
    costs.add(8, 0.020)
    assert costs(16) == costs(8) == 0.020 and costs.as_dict() == {8: 0.020}
    costs.add(16, 0.030)  # tried again: known again
    assert costs(16) == 0.030
