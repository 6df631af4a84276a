"""The host KV tier (kv_offload_gb) wired into the engine: a device pool so small that shared
prefixes are evicted between requests, asked again; greedy outputs token for token equal to
those without the tier, the tier actually hit, no block leaked, the bytes loaded back equal
to the bytes saved; the model dtype's pool (bf16 on a CPU with AVX512-BF16: the native write)
and an int8 pool; async scheduling on and off; tensor and data parallelism; preemption."""
import numpy as np
import pytest

from pagedjax import SamplingParams
from pagedjax.config import EngineConfig
from pagedjax.engine.llm_engine import LLMEngine

BS, NUM_BLOCKS = 8, 24  # a doc of 64 tokens is 8 blocks: 4 docs (32+ blocks) never fit the pool together
DOCS, ROUNDS = 4, 3


def _engine(path, num_blocks=NUM_BLOCKS, **kw):
    return LLMEngine(str(path), stream_text=False, block_size=BS, num_blocks=num_blocks, max_num_seqs=4,
                     max_model_len=256, **kw)


def _workload(engine, seed=0):
    """Rounds of one request per shared document (a new question each time), one at a time,
    so each round finds the docs evicted from the device by the round before. -> outputs."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(2, 384, 8 * BS).tolist() for _ in range(DOCS)]
    outs = {}
    for rnd in range(ROUNDS):
        for d, doc in enumerate(docs):
            rid = f"{rnd}-{d}"
            engine.add_request(rid, doc + rng.integers(2, 384, 5).tolist(),
                               SamplingParams(max_tokens=6, ignore_eos=True))
            while engine.has_unfinished_requests():
                for o in engine.step():
                    if o.finished:
                        outs[rid] = o.outputs[0].token_ids
    return outs


@pytest.fixture(scope="module")
def runs(tiny_checkpoints):
    """(kv_cache_dtype, async, tier) -> (engine, outputs): each engine runs the workload once."""
    path, _ = tiny_checkpoints("llama")
    made = {}
    for dtype, async_, tier in [("auto", False, None), ("auto", False, 0.01), ("auto", True, 0.01),
                                ("int8", False, None), ("int8", True, 0.01)]:
        engine = _engine(path, kv_cache_dtype=dtype, async_scheduling=async_, kv_offload_gb=tier)
        made[dtype, async_, tier] = engine, _workload(engine)
    return made


@pytest.mark.parametrize("dtype,async_", [("auto", False), ("auto", True), ("int8", True)])
def test_outputs_equal_and_host_hit(runs, dtype, async_):
    base_engine, base = runs[dtype, False, None]
    engine, outs = runs[dtype, async_, 0.01]
    assert outs == base  # greedy, token for token
    s, b = engine.stats(), base_engine.stats()
    assert b["prefix_cache_hit_tokens"] == 0  # the device pool alone keeps none of the docs between rounds
    assert "kv_offload_loaded_blocks" not in b  # off: no tier, no counters
    # rounds 2 and 3 load every doc's 8 blocks back (the request's last block is computed)
    assert s["kv_offload_loaded_blocks"] == (ROUNDS - 1) * DOCS * 8
    assert s["kv_offload_host_hit_tokens"] == (ROUNDS - 1) * DOCS * 8 * BS
    assert s["num_computed_prompt_tokens"] == b["num_computed_prompt_tokens"] - s["kv_offload_host_hit_tokens"]
    assert s["kv_offload_saved_blocks"] >= DOCS * 8 and s["host_kv_blocks_stored"] >= DOCS * 8
    block_bytes = engine.kv_tiers.host.spec.block_bytes
    assert s["kv_offload_bytes_loaded"] == s["kv_offload_loaded_blocks"] * block_bytes
    assert s["kv_offload_copy_seconds"] > 0 and s["host_kv_hits"] == s["kv_offload_loaded_blocks"]


@pytest.mark.parametrize("key", [("auto", False, 0.01), ("auto", True, 0.01), ("int8", True, 0.01)])
def test_no_block_leaked(runs, key):
    engine, _ = runs[key]
    assert not engine.has_unfinished_requests()
    assert engine.pool.num_free == NUM_BLOCKS
    engine.pool.check_invariants()
    engine.kv_tiers.host.check_invariants()
    assert engine.kv_tiers.host.pinned_keys() == []


@pytest.mark.parametrize("dtype", ["auto", "int8"])
def test_loaded_blocks_are_the_saved_bytes(runs, dtype):
    """Every device block cached under a key the host tier holds has the host's bytes in every
    layer (pages and 8-bit scales): the gather and the scatter are exact inverses."""
    engine, _ = runs[dtype, True, 0.01]
    tiers = engine.kv_tiers
    tiers.flush()
    pairs = [(b, key) for b, (key, _) in engine.pool._hash_of.items() if key in tiers.host]
    assert pairs  # the last round's docs were loaded and are still cached
    blocks = np.array([b for b, _ in pairs], np.int32)
    from pagedjax.worker.kv_tiers import pool_leaves

    device = [np.asarray(x) for x in tiers._gather(pool_leaves(engine.runner.kv)[1], blocks)]
    found, host = tiers.host.get_many([key for _, key in pairs])
    assert found.all()
    assert set(tiers.names) == ({"k", "v"} if dtype == "auto" else {"k", "k_scales", "v", "v_scales"})
    for name, arr in zip(tiers.names, device):
        np.testing.assert_array_equal(arr, host[name])


def test_reset_prefix_cache_clears_the_host_tier(tiny_checkpoints):
    path, _ = tiny_checkpoints("llama")
    engine = _engine(path, kv_offload_gb=0.01, async_scheduling=False)
    rng = np.random.default_rng(1)
    for i in range(4):  # 4 docs of 8 blocks through a pool of 24: the first ones go to the host
        engine.add_request(f"r{i}", rng.integers(2, 384, 8 * BS + 3).tolist(), SamplingParams(max_tokens=1))
        while engine.has_unfinished_requests():
            engine.step()
    engine.kv_tiers.flush()
    assert len(engine.kv_tiers.host) > 0
    engine.reset_prefix_cache()
    assert len(engine.kv_tiers.host) == 0 and engine.pool.evicted == []
    engine.kv_tiers.host.check_invariants()


@pytest.mark.parametrize("kw,match", [
    (dict(kv_offload_gb=0), "kv_offload_gb must be a number > 0"),
    (dict(kv_offload_gb=-1.0), "kv_offload_gb must be a number > 0"),
    (dict(kv_offload_gb="4"), "kv_offload_gb must be a number > 0"),
    (dict(kv_offload_gb=True), "kv_offload_gb must be a number > 0"),
    (dict(kv_offload_gb=1.0, kv_cache="dense"), "needs kv_cache='paged'"),
    (dict(kv_offload_gb=1.0, enable_prefix_caching=False), "needs prefix caching"),
    (dict(kv_offload_gb=1.0, speculative_config={"model": "/nonexistent", "num_speculative_tokens": 2}),
     "draft model"),
])
def test_config_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kw)


def test_config_default_off():
    assert EngineConfig().kv_offload_gb is None
    assert EngineConfig(kv_offload_gb=2).kv_offload_gb == 2


def test_metrics_export_the_tier(runs):
    from pagedjax.entrypoints.openai.metrics import ServerMetrics

    engine, _ = runs["auto", True, 0.01]
    text = ServerMetrics(engine.stats).render().decode()
    loaded = engine.stats()["kv_offload_loaded_blocks"]
    assert f"pagedjax:kv_offload_loaded_blocks_total {float(loaded)}" in text
    assert "# TYPE pagedjax:kv_offload_bytes_saved_total counter" in text
    assert "pagedjax:host_kv_blocks_used " in text


def test_tensor_and_data_parallel_on_virtual_devices(tmp_path):
    """tp=2 x dp=2 (kv_offload_tp_case.py, a process of its own): outputs equal to the same
    mesh without the tier, the tier hit, the host holding every KV head."""
    from pathlib import Path

    from virtual_devices import run_cases

    res = run_cases(Path(__file__).with_name("kv_offload_tp_case.py"), tmp_path, timeout=600)
    off, on = res["None"], res["0.01"]
    assert on["kv_sharding"] == "P('model', 'data')"  # heads over 2 devices, the ranks' pools over 2
    assert on["outputs"] == off["outputs"]
    assert on["stats"]["kv_offload_loaded_blocks"] > 0
    assert on["stats"]["num_computed_prompt_tokens"] < off["stats"]["num_computed_prompt_tokens"]
    assert on["free"] == [12, 12]  # no block leaked on either rank
    ranks = on["stats_by_rank"]  # both ranks ran requests
    assert all(r["prefix_cache_query_tokens"] > 0 for r in ranks)
    heads = 2  # the tiny llama's KV heads: all of them on the host
    assert [f[1][0] for f in on["host_spec"]] == [heads] * 4
    # the host + disk engine wrote its blocks through; a restarted disk-only engine reads them back
    again = res["restart"]
    assert again["outputs"] == off["outputs"] and again["free"] == [12, 12]
    assert on["stats"]["disk_kv_blocks_written"] > 0 and again["stats"]["kv_offload_disk_hit_tokens"] > 0
    assert again["stats"]["disk_kv_corrupt"] == 0


def _mixed_workload(engine, seed=0):
    """8 requests at a time over 5 shared docs (preemptions under this pool), one of them n=2
    sampled with a seed, one asking for prompt logprobs (no cache hits for it)."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(2, 384, 5 * BS).tolist() for _ in range(5)]
    outs = {}
    for rnd in range(3):
        for i in range(8):
            kw = dict(max_tokens=int(rng.integers(3, 12)), ignore_eos=True)
            kw.update({3: dict(n=2, temperature=0.8, seed=5), 5: dict(prompt_logprobs=1)}.get(i, {}))
            prompt = docs[(i * 3 + rnd) % 5] + rng.integers(2, 384, int(rng.integers(1, 20))).tolist()
            engine.add_request(f"{rnd}-{i}", prompt, SamplingParams(**kw))
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    outs[o.request_id] = [list(c.token_ids) for c in o.outputs]
    return outs


def test_concurrent_requests_preemption_forks_and_prompt_logprobs(tiny_checkpoints):
    path, _ = tiny_checkpoints("llama")
    made = {tier: _engine(path, kv_offload_gb=tier, async_scheduling=True) for tier in (None, 0.01)}
    outs = {tier: _mixed_workload(engine) for tier, engine in made.items()}
    assert outs[0.01] == outs[None]
    s = made[0.01].stats()
    assert s["num_preemptions"] > 0 and s["kv_offload_loaded_blocks"] > 0
    assert s["num_computed_prompt_tokens"] < made[None].stats()["num_computed_prompt_tokens"]
    engine = made[0.01]
    assert engine.pool.num_free == NUM_BLOCKS
    engine.pool.check_invariants()
    engine.kv_tiers.host.check_invariants()


def test_warmup_compiles_the_tier_copies(tiny_checkpoints):
    """After the warm-up, a run with evictions, saves and loads compiles nothing: the gathers and
    scatters of every padded batch size were compiled ahead (their scatter moved no real block)."""
    path, _ = tiny_checkpoints("llama")
    engine = _engine(path, kv_offload_gb=0.01, async_scheduling=True)
    engine.warmup(progress=False)
    assert {("gather", 1), ("scatter", 1), ("scatter", 32), ("gather", 128)} <= engine.kv_tiers._shapes
    before = engine.stats()["num_compilations"]
    outs = _workload(engine, seed=2)
    s = engine.stats()
    assert s["kv_offload_loaded_blocks"] > 0 and s["kv_offload_saved_blocks"] > 0
    assert s["num_compilations"] == before
    engine.pool.check_invariants()
    assert engine.pool.num_free == NUM_BLOCKS
    base = _engine(path, async_scheduling=True)
    assert _workload(base, seed=2) == outs  # the warm-up's scatters changed no block
