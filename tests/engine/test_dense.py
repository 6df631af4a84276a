"""The dense KV cache backend, the KV memory accounting of both backends, and the
dense-vs-paged comparison run end to end on a tiny model."""
import json

import numpy as np
import pytest

from pagedjax import SamplingParams
from pagedjax.engine.llm_engine import LLMEngine
from tiny_models import hf_greedy

MAX_LEN = 96  # not a power of two: the dense slot length is max_model_len
BUDGET = 336  # tokens: 3.5 dense slots, 42 paged blocks of 8
BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 kv heads, head_dim 16, float32 (tiny llama)


@pytest.fixture(scope="module")
def engines(tiny_checkpoints):
    path, hf_model = tiny_checkpoints("llama")
    made = {kind: LLMEngine(str(path), stream_text=False, kv_cache=kind, block_size=8, max_num_seqs=8,
                            max_model_len=MAX_LEN, kv_cache_memory_gb=BUDGET * BYTES_PER_TOKEN / 2**30,
                            async_scheduling=False)  # the identities hold between whole steps (none in flight)
            for kind in ("dense", "paged")}
    return made, hf_model


def _prompts(seed, n, prefix_len=0):
    rng = np.random.default_rng(seed)
    prefix = rng.integers(2, 384, prefix_len).tolist()
    return [prefix + rng.integers(2, 384, int(k)).tolist() for k in rng.integers(1, 40, n)]


def _drain(engine, prompts, max_tokens, check=None):
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        if check:
            check(engine)
    return [done[f"r{i}"] for i in range(len(prompts))]


def test_layouts_from_one_budget(engines):
    made, _ = engines
    dense, paged = made["dense"], made["paged"]
    assert (dense.pool.num_blocks, dense.pool.block_size) == (3, MAX_LEN)  # 3 whole slots fit 336 tokens
    assert not dense.pool.enable_prefix_caching and dense.runner.max_blocks_per_seq == 1
    assert dense.buckets.max_num_seqs == 3  # the batch never exceeds the slots
    layers = dense.model_config.num_layers
    assert dense.runner.kv[0].shape == (2, layers * 3, MAX_LEN, 16)  # [Hkv, L * slots, max_model_len, D]
    assert (paged.pool.num_blocks, paged.pool.block_size) == (42, 8)
    assert paged.kv_bytes_per_token == dense.kv_bytes_per_token == BYTES_PER_TOKEN
    d, p = dense.stats(), paged.stats()
    assert d["kv_cache"] == "dense" and p["kv_cache"] == "paged"
    assert d["kv_tokens_budget"] == p["kv_tokens_budget"] == BUDGET
    assert d["kv_tokens_external_waste"] == BUDGET - 3 * MAX_LEN  # the tail too small for a 4th slot
    assert p["kv_tokens_external_waste"] == 0
    assert d["kv_tokens_reserved"] == p["kv_tokens_reserved"] == 0


def test_greedy_identical_across_backends(engines):
    """Six requests on three dense slots (they queue for slots) vs the paged pool; both equal
    transformers' greedy output."""
    made, hf_model = engines
    prompts = _prompts(0, 6)
    dense = _drain(made["dense"], prompts, 12)
    paged = _drain(made["paged"], prompts, 12)
    assert dense == paged
    assert dense[:2] == [hf_greedy(hf_model, p, 12) for p in prompts[:2]]
    assert made["dense"].stats()["num_preemptions"] == 0


@pytest.mark.parametrize("kind", ["dense", "paged"])
def test_accounting_identities(engines, kind):
    """Every step: reserved = written + internal waste; reserved and free agree with the block
    pool's own counts; written is what the live requests computed, shared blocks counted once."""
    made, _ = engines
    engine = made[kind]
    seen = {"steps": 0, "saved": 0, "dense_waste": 0.0}

    def check(e):
        m, pool = e.kv_memory(), e.pool
        running = e.scheduler.running
        bs = pool.block_size
        assert m.reserved == m.written + m.internal_waste
        assert m.reserved == (pool.num_blocks - pool.num_free) * bs
        assert m.capacity == m.reserved + m.free == pool.num_blocks * bs
        assert m.utilization == pytest.approx(m.written / BUDGET)
        assert m.num_requests == len(running)
        # logical tokens (each request's own view) = physical rows written + rows sharing saved
        assert sum(r.num_computed_tokens for r in running) == m.written + m.sharing_saved
        assert 0 <= m.reserved_future <= m.internal_waste
        if kind == "paged":
            assert m.internal_waste < bs * max(1, len(running))  # only partly filled last blocks
        else:
            assert m.reserved == len(running) * MAX_LEN and m.shared == m.sharing_saved == 0
            if running:
                seen["dense_waste"] = max(seen["dense_waste"], m.waste_fraction)
        seen["steps"] += 1
        seen["saved"] = max(seen["saved"], m.sharing_saved)

    _drain(engine, _prompts(1, 8, prefix_len=24), 16, check)
    assert seen["steps"] > 0
    if kind == "paged":
        assert seen["saved"] >= 16  # the 24-token prefix's full blocks were stored once
    else:
        assert seen["dense_waste"] > 0.5
    s = engine.stats()
    assert s["kv_tokens_reserved"] == s["kv_tokens_written"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"]


def test_compare_end_to_end_through_the_cli(tmp_path, capsys):
    """`pagedjax bench compare --tiny ...`: both backends on a random tiny Llama, files written."""
    from pagedjax.entrypoints.cli import main

    argv = ["bench", "compare", "--tiny", "--num-requests", "10", "--prompt-len", "4", "30", "--output-len", "6", "20",
            "--max-model-len", str(MAX_LEN), "--shared-prefix-len", "16", "--kv-budget-tokens", str(BUDGET),
            "--block-size", "8", "--max-num-seqs", "8", "--out", str(tmp_path), "--quiet"]
    assert main(argv) == 0
    assert "| identical greedy outputs | 10/10 |" in capsys.readouterr().out
    report = json.loads((tmp_path / "compare.json").read_text())
    assert report["all_outputs_identical"] and report["kv_budget_tokens"] == BUDGET
    dense, paged = report["dense"], report["paged"]
    assert (dense["num_blocks"], dense["block_size"], paged["num_blocks"]) == (3, MAX_LEN, 42)
    assert dense["peak_concurrent_requests"] <= 3 < paged["peak_concurrent_requests"]
    assert paged["waste_fraction"] < dense["waste_fraction"]
    assert paged["sharing_saved_tokens_peak"] > 0 and dense["sharing_saved_tokens_peak"] == 0
    assert dense["compilations_during_run"] == paged["compilations_during_run"] == 0  # shapes planned ahead
    for run in (dense, paged):
        assert run["output_tokens"] == sum(len(o[0]) for o in run["outputs"])
        assert run["decode_tokens_per_s_full"] > 0
        for s in run["timeline"]:
            assert s["reserved"] == s["written"] + s["internal_waste"]
    int8 = report["paged_int8kv"]  # the third run: paged, int8 KV in the same bytes
    assert int8["num_blocks"] > 2 * paged["num_blocks"] and int8["compilations_during_run"] == 0
    assert int8["peak_concurrent_requests"] >= paged["peak_concurrent_requests"]
    assert "| peak concurrent requests |" in (tmp_path / "compare.md").read_text()
    assert "paged + int8 KV" in (tmp_path / "compare.md").read_text()
    for name in ("kv_utilization.png", "kv_block_map.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # no KV tier asked for: no tier keys, no tier rows (the report as before the tiers)
    assert not any(k.startswith("kv_tiers") for run in (dense, paged, int8) for k in run)
    assert not report["kv_tier_options"] and "host tier" not in (tmp_path / "compare.md").read_text()


def _png_height(path) -> int:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(data[20:24], "big")  # the IHDR chunk: width, height


def test_compare_with_kv_tiers_records_their_counters_and_draws_them(tmp_path, capsys):
    """`--kv-offload-gb` / `--kv-offload-dir` on the paged run: the report has the tiers'
    counters next to the device pool's, the table their rows, the block map two tier rows."""
    from pagedjax.compare.plots import plot_block_map
    from pagedjax.entrypoints.cli import main

    disk = tmp_path / "kv_disk"
    argv = ["bench", "compare", "--tiny", "--num-requests", "8", "--prompt-len", "4", "30", "--output-len", "6", "16",
            "--max-model-len", str(MAX_LEN), "--shared-prefix-len", "16", "--kv-budget-tokens", str(BUDGET),
            "--block-size", "8", "--max-num-seqs", "8", "--out", str(tmp_path), "--quiet", "--no-int8-kv",
            "--kv-offload-gb", "0.001", "--kv-offload-dir", str(disk), "--kv-offload-disk-gb", "0.01"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| identical greedy outputs | 8/8 |" in out  # the tiers change no token
    assert "| host tier: blocks used / total (end) | - |" in out and "| disk-tier hit tokens | - |" in out
    report = json.loads((tmp_path / "compare.json").read_text())
    assert report["kv_tier_options"] == {"kv_offload_gb": 0.001, "kv_offload_dir": str(disk),
                                         "kv_offload_disk_gb": 0.01}
    dense, paged = report["dense"], report["paged"]
    assert "kv_tiers" not in dense and "kv_tiers_at_peak" not in dense  # the tiers are the paged run's
    tiers, at_peak = paged["kv_tiers"], paged["kv_tiers_at_peak"]
    for key in ("device_kv_blocks_total", "device_kv_blocks_cached", "device_prefix_cache_hit_tokens",
                "host_kv_blocks_used", "host_kv_blocks_total", "disk_kv_blocks", "kv_offload_saved_blocks",
                "kv_offload_loaded_blocks", "kv_offload_host_hit_tokens", "kv_offload_disk_hit_tokens"):
        assert key in tiers, key
    assert tiers["device_kv_blocks_total"] == paged["num_blocks"] == 42
    assert tiers["host_kv_blocks_total"] == at_peak["host_blocks_total"] > 0
    assert 0 <= tiers["host_kv_blocks_used"] <= tiers["host_kv_blocks_total"]
    # every full block computed is written through to disk; the pending writes landed before the counters
    assert tiers["disk_kv_blocks"] == tiers["kv_offload_written_blocks"] > 0 and tiers["disk_kv_pending_writes"] == 0
    assert len(list(disk.rglob("*"))) >= tiers["disk_kv_blocks"]
    assert at_peak["disk"] and at_peak["host"] and at_peak["disk_max_bytes"] == int(0.01 * 2**30)
    assert tiers["device_prefix_cache_hit_tokens"] == paged["prefix_cache_hit_tokens"]
    # the picture: the same report without its tiers draws no tier rows (a shorter figure)
    with_tiers = _png_height(tmp_path / "kv_block_map.png")
    plain = {**report, "paged": {k: v for k, v in paged.items() if not k.startswith("kv_tiers")}}
    assert _png_height(plot_block_map(plain, tmp_path / "plain.png")) < with_tiers


def test_compare_rejects_a_disk_bound_without_a_folder(capsys):
    from pagedjax.compare.cli import main

    assert main(["--tiny", "--num-requests", "1", "--kv-offload-disk-gb", "1", "--quiet"]) == 2
    assert "kv_offload_disk_gb bounds the disk tier" in capsys.readouterr().err
