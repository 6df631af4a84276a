"""The CPU's small step rungs (min_step_tokens=1: steps of 1, 2 and 4 tokens for small decode
batches, platforms/cpu.py): greedy outputs equal transformers' token for token while requests
join and leave, with async scheduling on and off, and the small rungs are the ones that run.
(The rest of the suite steps from 8 tokens: tests/conftest.py.)"""
import numpy as np
import jax.numpy as jnp
import pytest

from pagedjax import LLM, SamplingParams
from pagedjax.config import EngineConfig
from pagedjax.platforms import get_platform
from tiny_models import hf_greedy

MAX_NEW = 9


@pytest.fixture(scope="module")
def llama(tiny_checkpoints):
    return tiny_checkpoints("llama")


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_small_rungs_match_transformers(llama, async_scheduling):
    path, hf_model = llama
    rng = np.random.default_rng(4)
    prompts = [rng.integers(2, 384, size=k).tolist() for k in (3, 12, 1, 20, 6)]
    lengths = [MAX_NEW, 4, 14, 6, MAX_NEW]  # requests leave at different steps: batches of 3, 2 and 1
    expected = [hf_greedy(hf_model, p, n) for p, n in zip(prompts, lengths)]
    llm = LLM(str(path), max_num_seqs=3, max_model_len=128, block_size=8, num_blocks=64, warmup=False,
              min_step_tokens=1, async_scheduling=async_scheduling)
    runner = llm.engine.runner
    assert llm.engine.buckets.token_buckets()[:4] == [1, 2, 4, 8]
    rungs, fetch = [], runner.fetch
    runner.fetch = lambda pending: (rungs.append(pending.t), fetch(pending))[1]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert {1, 2, 4} <= set(rungs)  # one, two and three requests decoding (3 -> the 4-token rung)
    pool = llm.engine.scheduler.pool
    assert pool.num_free == pool.num_blocks


def test_min_step_tokens_is_checked_and_defaults_to_the_platform(monkeypatch):
    for bad in (0, 3, 32, "8"):
        with pytest.raises(ValueError, match="min_step_tokens"):
            EngineConfig(model="x", min_step_tokens=bad)
    monkeypatch.delenv("PAGEDJAX_MIN_STEP_TOKENS", raising=False)
    assert get_platform("cpu").smallest_step() == get_platform("cpu").smallest_step(jnp.bfloat16) == 1
    assert get_platform("cpu").smallest_step(jnp.float32) == 8  # float32 engines ran slower with 1, 2, 4
    assert get_platform("gpu").smallest_step() == get_platform("tpu").smallest_step(jnp.bfloat16) == 8
    monkeypatch.setenv("PAGEDJAX_MIN_STEP_TOKENS", "4")
    assert get_platform("cpu").smallest_step() == get_platform("cpu").smallest_step(jnp.float32) == 4
    monkeypatch.setenv("PAGEDJAX_MIN_STEP_TOKENS", "5")
    with pytest.raises(ValueError, match="PAGEDJAX_MIN_STEP_TOKENS"):
        get_platform("cpu").smallest_step()
