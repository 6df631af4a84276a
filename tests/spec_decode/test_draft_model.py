"""Speculative decoding with a draft model: greedy outputs are the target's own (transformers'
token for token) whatever the draft, a draft identical to the target has its drafts accepted,
and every block of both pools comes back."""
import numpy as np
import pytest

from pagedjax import LLM, SamplingParams
from pagedjax.spec_decode.config import SpeculativeConfig
from tiny_models import COMMON, FAMILIES, hf_greedy

KW = dict(max_num_seqs=4, max_model_len=256, block_size=8, num_blocks=96, max_num_batched_tokens=64, warmup=False)


def _prompts():
    rng = np.random.default_rng(3)
    return [rng.integers(2, 384, 30).tolist(), rng.integers(2, 384, 75).tolist(), [5, 6, 7]]


def _draft(path, k=3, adaptive=False):
    """adaptive False: k drafts every step, whatever they cost (the tests of the mechanics)."""
    return {"model": str(path), "num_speculative_tokens": k, "adaptive": adaptive}


def test_config_parses_and_rejects():
    cfg = SpeculativeConfig.parse({"model": "/some/dir", "num_speculative_tokens": 3})
    assert (cfg.method, cfg.model, cfg.num_speculative_tokens) == ("draft_model", "/some/dir", 3)
    with pytest.raises(ValueError, match="needs 'model'"):
        SpeculativeConfig.parse({"method": "draft_model", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="apply to method 'ngram'"):
        SpeculativeConfig.parse({"model": "/d", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    with pytest.raises(ValueError, match="does not go with"):
        SpeculativeConfig.parse({"method": "ngram", "model": "/d", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig.parse({"model": "/d", "num_speculative_tokens": 0})
    assert SpeculativeConfig.parse({"model": "/d", "num_speculative_tokens": 3}).adaptive
    assert not SpeculativeConfig.parse({"model": "/d", "num_speculative_tokens": 3, "adaptive": False}).adaptive
    with pytest.raises(ValueError, match="adaptive must be"):
        SpeculativeConfig.parse({"model": "/d", "num_speculative_tokens": 3, "adaptive": "yes"})
    with pytest.raises(ValueError, match="'adaptive' applies to a draft model"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "adaptive": True})


def test_the_target_as_its_own_draft_is_accepted(tiny_checkpoints):
    path, hf_model = tiny_checkpoints("llama")
    prompts = _prompts()
    llm = LLM(str(path), speculative_config=_draft(path), **KW)
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf_model, p, 24) for p in prompts]
    stats = llm.stats()
    # the same weights in float32: the draft's argmax is the target's but at float near-ties
    assert stats["spec_acceptance_rate"] > 0.9 and stats["spec_mean_tokens_per_step"] > 2.5
    assert stats["kv_blocks_free"] == 96
    drafter = llm.engine.drafter
    assert drafter.num_free_blocks == drafter.cache.num_blocks and not drafter._slots
    # an aborted request returns its draft blocks too
    engine = llm.engine
    engine.add_request("gone", prompts[1], SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert drafter.num_free_blocks < drafter.cache.num_blocks
    engine.abort_request("gone")
    assert drafter.num_free_blocks == drafter.cache.num_blocks and llm.stats()["kv_blocks_free"] == 96


def test_another_model_drafts_and_outputs_stay_the_targets(tiny_checkpoints):
    """A different model (mistral-shaped, other weights) as the draft, and a prompt longer than
    a step (the draft reads it in several steps). Preemption, forks, stops and max_tokens:
    test_speculative.py, with both proposers."""
    path, hf_model = tiny_checkpoints("llama")
    draft_path, _ = tiny_checkpoints("mistral")
    prompts = _prompts() + [list(range(2, 150))]
    llm = LLM(str(path), speculative_config=_draft(draft_path, 4), **{**KW, "max_num_batched_tokens": 32})
    outs = llm.generate(prompts, SamplingParams(max_tokens=30, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf_model, p, 30) for p in prompts]
    assert llm.stats()["spec_draft_tokens"] > 0 and llm.stats()["kv_blocks_free"] == 96
    drafter = llm.engine.drafter
    assert drafter.num_free_blocks == drafter.cache.num_blocks


def test_warmup_compiles_the_draft_steps_and_nothing_after(tiny_checkpoints):
    path, _ = tiny_checkpoints("llama")
    llm = LLM(str(path), speculative_config=_draft(path, 2), **{**KW, "warmup": True})
    llm.wait_for_warmup()
    drafter = llm.engine.drafter
    compiled = drafter.num_compiled_steps
    assert compiled == len(drafter.buckets.token_buckets())
    llm.generate(_prompts(), SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert drafter.num_compiled_steps == compiled


def test_a_draft_with_another_vocabulary_is_refused(tiny_checkpoints, tmp_path):
    import transformers

    path, _ = tiny_checkpoints("llama")
    config_cls, model_cls, extra = FAMILIES["llama"]
    cfg = getattr(transformers, config_cls)(**{**COMMON, "vocab_size": 400}, **extra)
    getattr(transformers, model_cls)(cfg).save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(str(path), speculative_config=_draft(tmp_path), **KW)
    with pytest.raises(FileNotFoundError, match="speculative_config: the draft model .*does not exist"):
        LLM(str(path), speculative_config=_draft(tmp_path / "missing"), **KW)


def test_the_draft_pool_shares_the_kv_budget(tiny_checkpoints):
    path, _ = tiny_checkpoints("llama")
    budget_gb = 0.5 / 1024  # 512 KiB for both pools (a full-length pool for 4 requests would need 1 MiB)
    kw = dict(max_num_seqs=4, max_model_len=256, block_size=8, max_num_batched_tokens=64, warmup=False)
    llm = LLM(str(path), speculative_config=_draft(path), kv_cache_memory_gb=budget_gb, **kw)
    pools = sum(llm.engine.kv_pool_bytes_per_device.values()) + sum(x.nbytes for x in llm.engine.drafter.kv)
    assert 0.8 * budget_gb * (1 << 30) < pools <= budget_gb * (1 << 30)
    with pytest.raises(ValueError, match="draft model's fixed share"):
        LLM(str(path), speculative_config=_draft(path), kv_cache_memory_gb=1 / (1 << 20), **kw)


def test_drafts_are_those_of_a_draft_reading_everything_again(tiny_checkpoints):
    """The slot bookkeeping (rejected drafts dropped, only new tokens read): each step's drafts
    equal those of a fresh proposer that reads every token of every request again; sampled,
    so that drafts are rejected."""
    from pagedjax.spec_decode.draft_model import DraftModelProposer, load_draft_model

    path, _ = tiny_checkpoints("llama")
    draft_path = path  # the target as its draft: at temperature 1 some drafts are accepted, some not
    llm = LLM(str(path), speculative_config=_draft(draft_path, 4), **{**KW, "max_num_batched_tokens": 32})
    drafter = llm.engine.drafter
    draft = load_draft_model(str(draft_path), dtype="float32", kv_cache_dtype="auto", vocab_size=384, max_model_len=256)
    fresh = DraftModelProposer(draft, max_num_seqs=4, max_model_len=256, max_num_batched_tokens=32,
                               num_blocks=drafter.cache.num_blocks)
    incremental, compared = drafter.propose, []

    def propose(requests, k, running):
        out = incremental(requests, k, running)
        compared.append(out == fresh.propose(requests, k, set()))  # set(): every slot freed first
        return out

    drafter.propose = propose
    sp = SamplingParams(max_tokens=40, temperature=1.0, seed=0, ignore_eos=True)
    llm.generate(_prompts(), sp, use_tqdm=False)
    stats = llm.stats()
    assert len(compared) > 20 and all(compared)
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]  # some drafts were rejected


def test_an_adaptive_draft_that_does_not_pay_mostly_stops_drafting(tiny_checkpoints):
    """Another model's drafts are almost never accepted (tiny random models disagree), and
    proposing them costs about what a target step does: the adaptive draft model drafts on
    a fraction of the steps (it measures its cost and acceptance, and probes now and then),
    and outputs stay transformers'. The target's step costs are pinned at 1 ms for every size
    (a draft forward pass costs more than that anywhere), so what is drafted does not hang on
    this machine's load; the draft model's costs are measured."""
    from pagedjax.spec_decode.policy import MeasuredCosts

    path, hf_model = tiny_checkpoints("llama")
    draft_path, _ = tiny_checkpoints("mistral")
    prompts = _prompts()
    drafted = {}
    for adaptive in (False, True):
        llm = LLM(str(path), speculative_config=_draft(draft_path, 3, adaptive), **KW)
        llm.engine.spec.step_costs = pinned = MeasuredCosts(lambda t: 1e-3)
        pinned.add = lambda size, seconds: None
        outs = llm.generate(prompts, SamplingParams(max_tokens=60, ignore_eos=True), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf_model, p, 60) for p in prompts]
        stats = llm.stats()
        assert stats["spec_acceptance_rate"] < 0.2 and stats["kv_blocks_free"] == 96
        drafted[adaptive] = stats["spec_draft_tokens"]
        if adaptive:
            assert llm.engine.draft_costs()  # measured (first runs, which compile, are not)
    assert 0 < drafted[True] < drafted[False] / 3, drafted
