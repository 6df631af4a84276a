"""Swap preemption (issue 50 item 3): with a host KV tier, a preempted request's computed
blocks go to the host (pinned, under swap keys) and come back when it resumes instead of being
recomputed; without room there, it recomputes. Greedy outputs token for token equal to an
unpreempted run, async scheduling on and off; the host's pins all released, no block leaked."""
import numpy as np
import pytest

from pagedjax import SamplingParams
from pagedjax.engine.llm_engine import LLMEngine

BS, SMALL_POOL = 8, 20  # 4 requests of ~9 blocks each: the small pool preempts


def _engine(path, num_blocks, **kw):
    return LLMEngine(str(path), stream_text=False, block_size=BS, num_blocks=num_blocks, max_num_seqs=4,
                     max_model_len=256, **kw)


def _run(engine):
    """4 requests at once: distinct 40-token prompts, 30 greedy tokens each. -> outputs by id."""
    rng = np.random.default_rng(3)
    for i in range(4):
        engine.add_request(str(i), rng.integers(2, 384, 40).tolist(), SamplingParams(max_tokens=30, ignore_eos=True))
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
    return outs


@pytest.fixture(scope="module")
def base(tiny_checkpoints):
    path, _ = tiny_checkpoints("llama")
    engine = _engine(path, 64, async_scheduling=False)
    outs = _run(engine)
    assert engine.stats()["num_preemptions"] == 0
    return path, outs


def _no_leak(engine):
    assert not engine.has_unfinished_requests() and engine.pool.num_free == SMALL_POOL
    engine.pool.check_invariants()
    host = engine.kv_tiers.host
    host.check_invariants()
    assert host.pinned_keys() == [] and not any(isinstance(k, int) for k in host.keys())
    assert all(not p.swapped for p in engine.kv_tiers.policies)


@pytest.mark.parametrize("async_", [False, True])
def test_swapped_preemption_equals_unpreempted_run(base, async_):
    path, expected = base
    engine = _engine(path, SMALL_POOL, kv_offload_gb=0.01, async_scheduling=async_)
    assert _run(engine) == expected
    s = engine.stats()
    assert s["num_preemptions"] > 0 and s["kv_offload_swap_fallbacks"] == 0
    assert s["kv_offload_swapped_out_blocks"] > 0
    assert 0 < s["kv_offload_swapped_in_blocks"] <= s["kv_offload_swapped_out_blocks"]  # hits may cover some
    # only the prompts were computed: a resumed request loads its blocks instead of recomputing them
    assert s["num_computed_prompt_tokens"] <= 4 * 40
    _no_leak(engine)
    from pagedjax.entrypoints.openai.metrics import ServerMetrics

    text = ServerMetrics(engine.stats).render().decode()
    assert f"pagedjax:kv_offload_swapped_out_blocks_total {float(s['kv_offload_swapped_out_blocks'])}" in text


def test_recompute_when_the_host_is_full(base):
    path, expected = base
    probe = _engine(path, SMALL_POOL, kv_offload_gb=0.01)
    gb = 2.5 * probe.kv_tiers.host.spec.block_bytes / (1 << 30)  # 2 blocks: no request's blocks fit
    engine = _engine(path, SMALL_POOL, kv_offload_gb=gb, async_scheduling=True)
    assert engine.kv_tiers.host.num_blocks == 2
    assert _run(engine) == expected
    s = engine.stats()
    assert s["num_preemptions"] > 0 and s["kv_offload_swap_fallbacks"] > 0
    # a preemption swaps only a request whose computed blocks all fit (at most 2 here)
    assert s["kv_offload_swapped_out_blocks"] <= 2 * (s["num_preemptions"] - s["kv_offload_swap_fallbacks"])
    _no_leak(engine)
