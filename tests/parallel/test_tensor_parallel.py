"""Tensor and data parallelism on 8 virtual CPU devices (tp_cases.py runs them in a subprocess)."""
from __future__ import annotations

from pathlib import Path

import pytest

from virtual_devices import run_cases

CASES = Path(__file__).with_name("tp_cases.py")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_cases(CASES, tmp_path_factory.mktemp("tp"))


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_greedy_identical_for_every_tp_and_to_transformers(results, family):
    fam = results["families"][family]
    assert fam["1"]["tokens"] == fam["transformers"]
    sizes = [k for k in fam if k not in ("1", "transformers")]
    assert sizes
    for tp in sizes:
        assert fam[tp]["tokens"] == fam["1"]["tokens"], f"{family} tp={tp}"


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_weights_and_kv_pool_are_split(results, family):
    """Read from the arrays' shards: each device holds about 1/tp of the weights (norms are
    replicated, and so are the k/v projections of KV heads when tp exceeds them), and 1/tp
    of the KV pool, or one KV head when tp exceeds the KV heads."""
    fam = results["families"][family]
    for tp in (k for k in fam if k not in ("1", "transformers")):
        mem, n = fam[tp]["memory"], int(tp)
        assert len(mem["weights_per_device"]) == n and len(mem["kv_per_device"]) == n
        one_device_weights = fam["1"]["memory"]["weights_total"]
        slack = 1.1 if n <= _kv_heads(family) else 1.3
        for b in mem["weights_per_device"].values():
            assert b <= one_device_weights / n * slack, (tp, b, one_device_weights)
        kv_one = fam["1"]["memory"]["kv_total"]
        for b in mem["kv_per_device"].values():
            assert b == mem["kv_total"] // n
            assert b <= max(kv_one / n, kv_one / _kv_heads(family))


def _kv_heads(family):
    from tiny_models import FAMILIES

    return FAMILIES[family][2]["num_key_value_heads"]


def test_sampling_logprobs_and_beam_search_identical_under_tp2(results):
    one, two = results["llama_tp1"], results["llama_tp2"]
    assert two["n3"] == one["n3"]
    assert len({tuple(s) for s in one["n3"][0]}) > 1  # the three samples really differ
    assert two["beam"] == one["beam"]
    assert two["greedy_scan"] == one["greedy_scan"]
    assert two["dense"] == one["dense"]
    for a, b in zip(_flat(one["logprobs"]), _flat(two["logprobs"])):
        assert a[0] == b[0] and a[1] == pytest.approx(b[1], abs=1e-4)
    _same_processors(one, two)


def test_bfloat16_under_tp2(results):
    one, two = results["bf16_tp1"], results["bf16_tp2"]
    assert one["kv_dtype"] == two["kv_dtype"] == "bfloat16"
    assert all(len(t) == 10 for t in one["tokens"] + two["tokens"])
    # the same bf16 products summed in another order (f32): identical but for a near-tie
    assert sum(a == b for a, b in zip(one["tokens"], two["tokens"])) >= 2


def _same_processors(one, other):
    """Penalties, bias, token masks and prompt logprobs give what one device gives."""
    assert other["processors"]["tokens"] == one["processors"]["tokens"]
    assert other["processors"]["prompt_logprobs"][1:] == pytest.approx(one["processors"]["prompt_logprobs"][1:],
                                                                       abs=1e-4)


def _flat(lp):
    return [pair for req in lp for seq in req for step in seq for pair in step]


def test_no_compilation_after_warmup_under_tp2(results):
    assert results["llama_tp2"]["compilations_after_warmup"] == 0
    assert results["llama_tp1"]["compilations_after_warmup"] == 0


def test_impossible_layouts_are_refused_with_what_works(results):
    assert "sizes that work: [1, 2, 4]" in results["errors"]["tp3"]
    assert "needs 16 devices" in results["errors"]["tp16"]


@pytest.mark.parametrize("tp", [1, 2])
def test_data_parallel_outputs_identical_to_one_device(results, tp):
    one, dp = results["llama_tp1"], results[f"llama_dp2_tp{tp}"]
    assert dp["n3"] == one["n3"]
    assert dp["beam"] == one["beam"]
    assert dp["greedy_scan"] == one["greedy_scan"]
    _same_processors(one, dp)
    assert dp["compilations_after_warmup"] == 0


@pytest.mark.parametrize("tp", [1, 2])
def test_data_parallel_routes_by_load_and_by_shared_prefix(results, tp):
    case = results[f"llama_dp2_tp{tp}"]
    assert all(q > 0 for q in case["ranks_before_shared"])  # unrelated prompts spread over both ranks
    by_rank = case["shared_prefix_query_tokens_by_rank"]
    assert sorted(by_rank) == [0, 6 * 49]  # the six requests sharing a prefix all met on one rank
    rank = by_rank.index(6 * 49)
    assert case["ranks_after"][rank]["prefix_cache_hit_tokens"] >= 5 * 32
    for r in case["ranks_after"]:
        assert r["kv_blocks_free"] == r["kv_blocks_total"]  # every block back once all requests ended


@pytest.mark.parametrize("tp", [1, 2])
def test_data_parallel_ranks_hold_their_own_pool(results, tp):
    mem = results[f"llama_dp2_tp{tp}"]["memory"]
    assert len(mem["kv_per_device"]) == 2 * tp
    one_rank = results["families"]["llama"]["1"]["memory"]["kv_total"]
    for b in mem["kv_per_device"].values():
        assert b == one_rank // tp  # a whole pool per rank, split over its tp devices


def test_preemption_under_tp2_gives_the_same_outputs(results):
    one, two = results["preempt_tp1"], results["preempt_tp2"]
    assert one["preemptions"] > 0 and two["preemptions"] == one["preemptions"]
    assert two["tokens"] == one["tokens"]


def test_draft_model_under_data_parallel_takes_every_rank(results):
    case = results["draft_dp2"]
    assert case["draft"] == case["plain"] and case["accepted"] > 0 and case["pools_whole"]


def test_int8_weights_and_kv_under_tp(results):
    """quantization="int8" + kv_cache_dtype="int8" split over tp=2: the fused qkv's scales are
    split with its output rows, the row-parallel down projection's scales replicated; the KV
    pool (pages and scales) halves per device; same log-probs as tp=1 up to the order of the
    partial sums (tp=1 may take the native decode kernel, tp=2 XLA's dot; a K or V value that
    moves by float32 rounding may round to the next int8 step, hence the looser bound)."""
    one, two = results["int8_tp1"], results["int8_tp2"]
    llama_qkv_rows = (4 + 2 * 2) * 16  # (H + 2 Hkv) D
    assert one["scale_shards"]["wqkv"] == [[llama_qkv_rows]]
    assert two["scale_shards"]["wqkv"] == [[llama_qkv_rows // 2]] * 2
    assert two["scale_shards"]["w_down"] == [[64]] * 2  # [E] whole on each device
    for b in two["memory"]["kv_per_device"].values():
        assert b == one["memory"]["kv_total"] // 2
    diff = [abs(a - b) for a, b in zip(one["prompt_logprobs"], two["prompt_logprobs"])]
    assert max(diff) < 0.02, diff
    same = sum(a == b for a, b in zip(one["tokens"], two["tokens"]))
    assert same >= 2, (one["tokens"], two["tokens"])


def test_lora_under_tp_gives_the_same_tokens_with_stacks_split_like_their_weights(results):
    """A batch mixing the base model and two adapters: the same greedy tokens at tp 1, 2 and
    4 (tp 4 repeats the KV heads, and k/v's LoRA rows with them); q's b split on its output
    rows, o's a on its input columns, like wqkv and wo."""
    one = results["lora_tp1"]
    for tp in (2, 4):
        case = results[f"lora_tp{tp}"]
        assert case["tokens"] == one["tokens"], tp
        # layer 0's b [out, S, R] and a [S, R, in]: 2 slots of rank 8 padded to 16 (2 x 16 = 32),
        # 64 q rows / o columns split tp ways
        assert case["q_b_shards"] == [[64 // tp, 2, 16]] * tp
        assert case["o_a_shards"] == [[2, 16, 64 // tp]] * tp
    assert one["tokens"][0] == one["base"][0]  # no adapter: the base model
    assert one["tokens"][1] != one["base"][1] and one["tokens"][2] != one["base"][2]  # the adapters change them
