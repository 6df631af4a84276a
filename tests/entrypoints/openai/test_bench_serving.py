"""scripts/bench_serving.py against the fake server, with a handful of requests."""
from __future__ import annotations

import json

from script_module import load_script

from .fake_engine import W0


def _load():
    return load_script("bench_serving")


def test_bench_serving(server, tmp_path):
    bench = _load()
    out = tmp_path / "bench.json"
    result = bench.main(["--base-url", server.url, "--num-requests", "12", "--concurrency", "4",
                         "--request-rate", "200", "--input-len", "10", "--input-len-range", "0.5",
                         "--output-len", "6", "--shared-prefix-len", "3", "--token-id-range", str(W0), str(W0 + 100),
                         "--output", str(out), "--no-progress"])
    saved = json.loads(out.read_text())
    assert saved["completed"] == 12 and saved["failed"] == 0 and saved["config"]["model"] == "fake-model"
    assert saved["total_output_tokens"] == 12 * 6
    for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
        assert set(saved[key]) == {"mean", "p50", "p90", "p99"} and saved[key]["p50"] > 0
    assert saved["e2e_ms"]["p99"] >= saved["ttft_ms"]["p50"] > 0
    assert result["request_throughput"] > 0
