"""The KV tiers with sliding-window block release (tiny Mixtral: every layer slides, window 16,
blocks of 8): shared documents evicted from a small device pool come back from the host tier
(and the disk tier), only the blocks the window still reads are loaded, preempted requests
that released blocks recompute; greedy outputs token for token equal to a run without tiers,
no block leaked."""
import numpy as np
import pytest

from pagedjax import SamplingParams
from pagedjax.engine.llm_engine import LLMEngine

BS, NUM_BLOCKS, WINDOW = 8, 11, 16
DOCS, ROUNDS = 4, 3  # docs of 8 blocks: 4 of them (32 blocks) never stay cached in 11


def _engine(path, num_blocks=NUM_BLOCKS, **kw):
    return LLMEngine(str(path), stream_text=False, block_size=BS, num_blocks=num_blocks, max_num_seqs=4,
                     max_model_len=160, max_num_batched_tokens=64, **kw)


def _drain(engine, outs):
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
        engine.pool.check_invariants()


def _workload(engine, seed=0):
    """Rounds of one request per shared document, one at a time (each round finds the docs
    evicted by the round before), then 4 concurrent requests through the small pool
    (preemptions). -> outputs."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(2, 384, 8 * BS).tolist() for _ in range(DOCS)]
    outs = {}
    for rnd in range(ROUNDS):
        for d, doc in enumerate(docs):
            engine.add_request(f"{rnd}-{d}", doc + rng.integers(2, 384, 5).tolist(),
                               SamplingParams(max_tokens=6, ignore_eos=True))
            _drain(engine, outs)
    for i in range(4):  # a doc's prefix, then 40 tokens each: 4 windows of 3 blocks do not fit 11
        engine.add_request(f"c{i}", docs[i][:BS] + rng.integers(2, 384, 2).tolist(),
                           SamplingParams(max_tokens=40, ignore_eos=True))
    _drain(engine, outs)
    return outs


@pytest.fixture(scope="module")
def runs(tiny_checkpoints, tmp_path_factory):
    path, _ = tiny_checkpoints("mixtral")
    folder = tmp_path_factory.mktemp("kv-window-disk")
    made = {}
    for name, kw in [("none", {}), ("host", dict(kv_offload_gb=0.01, async_scheduling=False)),
                     ("host-async", dict(kv_offload_gb=0.01, async_scheduling=True)),
                     ("host+disk", dict(kv_offload_gb=0.01, kv_offload_dir=str(folder))),
                     ("disk-restart", dict(kv_offload_dir=str(folder)))]:  # on the folder host+disk filled
        engine = _engine(path, **kw)
        assert engine.scheduler.window is not None and engine.scheduler.window.window == WINDOW
        made[name] = engine, _workload(engine)
        if engine.kv_tiers is not None:
            engine.close_kv_tiers()
    return made


@pytest.mark.parametrize("name", ["host", "host-async", "host+disk"])
def test_outputs_equal_only_window_blocks_loaded_no_leak(runs, name):
    base_engine, base = runs["none"]
    engine, outs = runs[name]
    assert outs == base  # greedy, token for token
    s, b = engine.stats(), base_engine.stats()
    assert s["kv_blocks_released_outside_window"] > 0 and b["num_preemptions"] > 0
    assert s["num_preemptions"] > 0 and s["kv_offload_swapped_out_blocks"] > 0  # those that released none
    # rounds 2 and 3 find each doc's 8 blocks below the device; a request of 69 tokens starts
    # at 64, where the window (16) reads blocks 6 and 7 only: 2 loaded, 6 skipped
    hit_blocks = (s["kv_offload_host_hit_tokens"] + s.get("kv_offload_disk_hit_tokens", 0)) // BS
    assert hit_blocks >= (ROUNDS - 1) * DOCS * 8
    assert 0 < s["kv_offload_loaded_blocks"] <= hit_blocks - (ROUNDS - 1) * DOCS * 6
    assert s["num_computed_prompt_tokens"] < b["num_computed_prompt_tokens"]
    assert not engine.has_unfinished_requests()
    assert engine.pool.num_free == NUM_BLOCKS
    engine.pool.check_invariants()
    engine.kv_tiers.host.check_invariants()
    assert engine.kv_tiers.host.pinned_keys() == [] and s["kv_offload_swapped_requests"] == 0


def test_restart_on_the_disk_tier_loads_only_window_blocks(runs):
    engine, outs = runs["disk-restart"]
    assert outs == runs["none"][1]
    s = engine.stats()
    hit_blocks = s["kv_offload_disk_hit_tokens"] // BS
    assert hit_blocks >= ROUNDS * DOCS * 8  # the first round too, from the files
    assert 0 < s["kv_offload_loaded_blocks"] <= hit_blocks - ROUNDS * DOCS * 6
    assert engine.pool.num_free == NUM_BLOCKS
    engine.pool.check_invariants()
