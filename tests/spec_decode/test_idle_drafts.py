"""Drafts past num_speculative_tokens in the rows a step's token bucket pads anyway (prompt
lookup's idle_speculative_tokens): deeper drafts when few requests remain, the same step
sizes (nothing compiled after warm-up), a full bucket unchanged, greedy outputs unchanged."""
from types import SimpleNamespace

import numpy as np
import pytest

from pagedjax import LLM, SamplingParams
from pagedjax.core.buckets import Buckets
from pagedjax.core.request import Request
from pagedjax.spec_decode.config import SpeculativeConfig
from pagedjax.spec_decode.manager import SpecDecodeManager
from pagedjax.spec_decode.policy import allocate_drafts
from tiny_models import hf_greedy

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
RUNGS = [8, 16, 32, 48, 64]


def _rung(tokens: int) -> int:
    return next(r for r in RUNGS if r >= tokens)


def test_idle_rows_take_deeper_drafts_and_a_full_bucket_is_unchanged():
    steep = {8: 40.0, 16: 45.0, 32: 200.0, 48: 300.0, 64: 400.0}.get
    # one request left: rung 8 holds its token and 7 drafts; k = 4 of them weighed, 3 more in the padding
    assert allocate_drafts([4], [0.6], 1, RUNGS, 64, 64, steep) == [4]
    assert allocate_drafts([4], [0.6], 1, RUNGS, 64, 64, steep, idle_caps=[16]) == [7]
    assert allocate_drafts([4], [0.6], 1, RUNGS, 64, 64, steep, idle_caps=[5]) == [5]  # what the proposer has
    # three left, rung 16 chosen: its 16 - 3 - 12 = 1 idle row goes to the likeliest fifth draft
    assert allocate_drafts([4] * 3, [0.5, 0.9, 0.7], 3, RUNGS, 64, 64, steep) == [4] * 3
    assert allocate_drafts([4] * 3, [0.5, 0.9, 0.7], 3, RUNGS, 64, 64, steep, idle_caps=[16] * 3) == [4, 5, 4]
    # max_drafts (the step's sampled rows) still bounds them
    assert allocate_drafts([4], [0.6], 1, RUNGS, 64, 5, steep, idle_caps=[16]) == [5]
    # a full batch: eight requests' k drafts fill rung 16's padding and no more (their 24 more
    # would need rung 32, which these costs do not pay for): unchanged
    assert allocate_drafts([4] * 8, [0.8] * 8, 8, RUNGS, 64, 64, steep, idle_caps=[16] * 8) == \
        allocate_drafts([4] * 8, [0.8] * 8, 8, RUNGS, 64, 64, steep) == [1] * 8


def test_idle_drafts_never_change_the_rung_and_only_fill_its_padding():
    rng = np.random.default_rng(0)
    for _ in range(500):
        n = int(rng.integers(1, 9))
        caps = rng.integers(0, 5, n).tolist()
        idle_caps = [c + int(rng.integers(0, 13)) if c else 0 for c in caps]
        rates = rng.uniform(0.05, 0.95, n).tolist()
        base = n + int(rng.integers(0, 20))  # decode tokens and maybe a prompt chunk
        costs = dict(zip(RUNGS, np.cumsum(rng.uniform(1, 50, len(RUNGS)))))
        budget, max_drafts = int(rng.choice([32, 64])), int(rng.integers(1, 40))
        old = allocate_drafts(caps, rates, base, RUNGS, budget, max_drafts, costs.get)
        new = allocate_drafts(caps, rates, base, RUNGS, budget, max_drafts, costs.get, idle_caps)
        assert all(o <= m <= c for o, m, c in zip(old, new, idle_caps))
        assert sum(new) <= max_drafts
        if sum(old):
            assert _rung(base + sum(new)) == _rung(base + sum(old)) <= budget  # the same step size
            if base + sum(old) == _rung(base + sum(old)):  # no padding: nothing added
                assert new == old
        else:  # no drafts fit or paid: none past k either
            assert new == old


def _manager(idle=None) -> SpecDecodeManager:
    spec = dict(SPEC) if idle is None else {**SPEC, "idle_speculative_tokens": idle}
    manager = SpecDecodeManager(SpeculativeConfig.parse(spec), Buckets(8, 64, 32), 256)
    for t, seconds in ((8, 0.020), (16, 0.021), (32, 0.024), (48, 0.040), (64, 0.060)):
        manager.step_costs.add(t, seconds)
    return manager


def _decoding(n: int) -> list[Request]:
    """n requests about to decode, each copying a 30-token passage of its prompt (prompt lookup
    has 24 tokens to draft from)."""
    reqs = []
    for i in range(n):
        passage = [10 + 30 * i + j for j in range(30)]
        req = Request(str(i), passage + passage[:5], SamplingParams(max_tokens=100), seed=0,
                      output_token_ids=[passage[5]])
        req.num_computed_tokens = req.num_tokens - 1
        reqs.append(req)
    return reqs


def test_the_manager_drafts_deeper_when_one_request_remains():
    manager = _manager()
    assert manager.config.idle_speculative_tokens == 16 and manager.config.proposal_depth == 16
    last = _decoding(1)
    manager.propose([SimpleNamespace(running=last)])
    assert len(last[0].draft_token_ids) == 16
    assert manager.allocate(last, 1, 64) == [7]  # 1 + 7 = the 8 tokens of the smallest step
    # a full batch of 8: the k drafts of each fill 8 + 24 = 32 tokens, as without idle drafting
    full = _decoding(8)
    manager.propose([SimpleNamespace(running=full)])
    assert manager.allocate(full, 8, 64) == [3] * 8
    off = _manager(idle=4)  # idle_speculative_tokens = k: off
    off.propose([SimpleNamespace(running=last)])
    assert len(last[0].draft_token_ids) == 4 and off.allocate(last, 1, 64) == [4]
    assert off.allocate(full, 8, 64) == [3] * 8


def test_idle_speculative_tokens_is_checked():
    assert SpeculativeConfig.parse({"num_speculative_tokens": 4}).idle_speculative_tokens == 16
    assert SpeculativeConfig.parse({"num_speculative_tokens": 16}).proposal_depth == 16
    with pytest.raises(ValueError, match="between num_speculative_tokens"):
        SpeculativeConfig.parse({"num_speculative_tokens": 4, "idle_speculative_tokens": 3})
    with pytest.raises(ValueError, match="idle_speculative_tokens"):
        SpeculativeConfig.parse({"num_speculative_tokens": 4, "idle_speculative_tokens": "8"})
    with pytest.raises(ValueError, match="apply to method 'ngram'"):
        SpeculativeConfig.parse({"model": "some/dir", "num_speculative_tokens": 4, "idle_speculative_tokens": 8})


def test_idle_drafts_compile_nothing_after_warmup_and_keep_greedy_outputs(tiny_checkpoints):
    """A batch whose requests end at different lengths, so that its last steps decode one or
    two of them: those verify more than k drafts, in step sizes compiled at warm-up, and the
    greedy outputs are transformers' token for token."""
    path, hf_model = tiny_checkpoints("llama")
    rng = np.random.default_rng(0)
    pattern = rng.integers(2, 384, 7).tolist()
    prompts = [pattern * 4, rng.integers(2, 384, 23).tolist(), (pattern[:3] + [9]) * 5 + [11], pattern * 3 + [5]]
    lengths = [48, 6, 10, 40]
    llm = LLM(str(path), speculative_config=SPEC, max_num_seqs=4, max_model_len=256, block_size=8, num_blocks=96,
              max_num_batched_tokens=64)
    llm.wait_for_warmup()
    compiled = llm.stats()["num_compilations"]
    deepest, sizes = [0], set()

    def observe(record):
        for out in record.outs:
            if out is not None and out.drafts:
                deepest[0] = max(deepest[0], *map(len, out.drafts))
                sizes.add(llm.engine.buckets.token_bucket(sum(out.q_lens)))

    llm.engine.step_observers.append(observe)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in lengths]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf_model, p, m) for p, m in zip(prompts, lengths)]
    assert llm.stats()["num_compilations"] == compiled  # no new step shape
    assert deepest[0] > SPEC["num_speculative_tokens"]  # drafts past k were verified
    assert sizes <= set(llm.engine.buckets.token_buckets())
    spec = llm.engine.spec
    assert 0 < spec.num_idle_draft_tokens and spec.num_accepted_idle_draft_tokens <= spec.num_idle_draft_tokens
    assert llm.stats()["kv_blocks_free"] == 96
