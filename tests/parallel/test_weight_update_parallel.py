"""update_weights on tensor-parallel engines: new weights land on each device's shards
(fused q/k/v regrouped per shard, KV heads repeated, int8 re-quantized), and the engine then
generates what an engine loaded from those weights does (weight_update_cases.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from virtual_devices import run_cases

CASES = Path(__file__).with_name("weight_update_cases.py")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_cases(CASES, tmp_path_factory.mktemp("weight-update"))


@pytest.mark.parametrize("case", ["tp4", "tp2_int8"])
def test_update_weights_under_tensor_parallelism(results, case):
    r = results[case]
    assert r["after"] == r["want"] and r["after"] != r["before"]
    if case == "tp4":
        assert r["want"] == results["reference"]  # float32: the same tokens as one device
    shards = [b for b in r["bytes_per_device"].values() if b]
    assert len(shards) == int(case[2]) and max(shards) < 1.5 * min(shards)  # split, not copied whole
