"""scripts/bench_feature_cost.py against the fake server: the same load without and with a
feature, alternating, and a clear stop when one side's requests fail."""
from __future__ import annotations

import json

import pytest

from script_module import load_script

from entrypoints.openai.conftest import running_server
from entrypoints.openai.fake_engine import W0, FakeEngine, FakeGrammarCompiler

LOAD = ["--num-requests", "6", "--max-concurrency", "3", "--input-len", "8", "--output-len", "4",
        "--token-id-range", str(W0), str(W0 + 100), "--no-progress"]


def test_structured_output_cost(tmp_path, capsys):
    bench = load_script("bench_feature_cost")
    compiler = FakeGrammarCompiler()
    with running_server(FakeEngine(grammar_compiler=compiler)) as s:
        out = tmp_path / "cost.json"
        result = bench.main(["--base-url", s.url, *LOAD, "--structured", "json", "--repeats", "2",
                             "--output", str(out)])
    assert len(compiler.compiled) == 2 * 6  # only the "with" runs asked for a schema
    assert [len(result["runs"][m]) for m in ("without", "with")] == [2, 2]
    assert all(r["completed"] == 6 and r["total_output_tokens"] == 24 for m in result["runs"].values() for r in m)
    saved = json.loads(out.read_text())
    assert "response_format" in saved["feature_fields"] and saved["throughput_cost"] == result["throughput_cost"]
    assert "cost of structured json" in capsys.readouterr().out


def test_failed_requests_stop_the_comparison(tmp_path):
    bench = load_script("bench_feature_cost")
    with running_server(FakeEngine()) as s:  # no grammar compiler: structured requests are refused
        with pytest.raises(SystemExit, match="6 of 6 requests failed with the features: HTTP 400"):
            bench.main(["--base-url", s.url, *LOAD, "--structured", "json", "--repeats", "1",
                        "--output", str(tmp_path / "x.json")])
