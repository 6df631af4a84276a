"""Gemma and mixture-of-experts models under tensor, expert and data parallelism on virtual
CPU devices (family_cases.py runs them in a subprocess): the tokens of one device and of
transformers."""
from __future__ import annotations

from pathlib import Path

import pytest

from virtual_devices import run_cases

CASES = Path(__file__).with_name("family_cases.py")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_cases(CASES, tmp_path_factory.mktemp("families"))


def _cases(results):
    return [(family, name) for family, fam in results.items() for name in fam if name != "transformers"]


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen2_moe", "gemma2", "gemma3_text"])
def test_every_split_generates_transformers_tokens(results, family):
    fam = results[family]
    for name, case in fam.items():
        if name != "transformers":
            assert case["tokens"] == fam["transformers"], f"{family} {name}"
            assert case["blocks_leaked"] == 0


def test_expert_parallel_splits_whole_experts(results):
    mix = results["mixtral"]
    assert mix["1"]["experts_per_device"] == [8]
    assert mix["tp2"]["experts_per_device"] == [8]  # tensor parallel: every expert, half of each
    assert mix["ep2"]["experts_per_device"] == mix["ep2_dp2"]["experts_per_device"] == [4]
    assert mix["ep4_ragged"]["experts_per_device"] == [2]
    assert results["qwen3_moe"]["ep2"]["experts_per_device"] == [4]
