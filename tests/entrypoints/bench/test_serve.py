"""`pagedjax bench serve` against the fake OpenAI server: completions and chat, arrival rate
and concurrency cap, goodput, the JSON and the plot, a dataset file, and clear errors."""
from __future__ import annotations

import json
import socket

import pytest

from pagedjax.entrypoints.bench.datasets import random_requests
from pagedjax.entrypoints.cli import main

from ..openai.conftest import running_server
from ..openai.fake_engine import W0, FakeEngine, make_tokenizer

IDS = ["--token-id-range", str(W0), str(W0 + 100)]  # the fake vocabulary's words


@pytest.fixture(scope="module")
def server():
    with running_server(FakeEngine(step_delay=0.002)) as s:
        yield s


def bench(server, tmp_path, *argv: str, name: str = "result.json") -> tuple[int, dict]:
    out = tmp_path / name
    rc = main(["bench", "serve", "--base-url", server.url, "--no-progress", "--result-file", str(out), *argv])
    return rc, json.loads(out.read_text())


def chat_tokens(tok, messages: list[dict]) -> int:
    """The prompt tokens of a chat with the fake model's template."""
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tok.encode(text, add_special_tokens=False))


def test_completions_at_a_rate_with_goodput_json_and_plot(server, tmp_path, capsys):
    n, spread = 16, ["--input-len", "12", "--input-len-range", "0.5", "--output-len", "6"]
    rc, res = bench(server, tmp_path, "--num-requests", str(n), "--request-rate", "80", "--burstiness", "0.5",
                    *spread, *IDS, "--seed", "3", "--goodput", "ttft:60000", "tpot:60000", "e2e:60000")
    assert rc == 0
    expected = random_requests(n, 12, 0.5, 6, 0.0, "completions", seed=3, id_range=(W0, W0 + 100))
    assert res["completed"] == n and res["failed"] == 0 and res["model"] == "fake-model"
    assert res["endpoint"] == "/v1/completions" and res["requests_without_usage"] == 0
    assert res["total_input_tokens"] == sum(len(r.prompt) for r in expected) != 12 * n  # exact, and spread
    assert res["total_output_tokens"] == 6 * n  # ignore_eos: exact lengths
    d = res["duration_s"]
    assert res["request_throughput"] == pytest.approx(n / d)
    assert res["output_throughput"] == pytest.approx(6 * n / d)
    assert res["total_token_throughput"] == pytest.approx((res["total_input_tokens"] + 6 * n) / d)
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = res[key]
        assert set(s) == {"mean", "std", "p50", "p90", "p99"}
        assert 0 < s["p50"] <= s["p90"] <= s["p99"], key
    assert res["e2e_ms"]["p50"] > res["ttft_ms"]["p50"]
    # every request met the generous SLOs: goodput is the request throughput
    assert res["goodput"]["requests_meeting_slos"] == n
    assert res["goodput"]["request_throughput"] == pytest.approx(res["request_throughput"])
    assert res["config"]["goodput"] == {"ttft": 60000.0, "tpot": 60000.0, "e2e": 60000.0}
    png = (tmp_path / "result.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    table = capsys.readouterr().out
    for label in ("TTFT", "TPOT", "ITL", "E2E", "Goodput", "Output token throughput"):
        assert label in table


def test_chat_under_a_concurrency_cap_with_a_tight_slo(server, tmp_path):
    n = 12
    rc, res = bench(server, tmp_path, "--endpoint-type", "chat", "--num-requests", str(n), "--max-concurrency", "3",
                    "--input-len", "9", "--output-len", "5", "--goodput", "ttft:0.001", "--save-detailed")
    assert rc == 0 and res["completed"] == n and res["endpoint"] == "/v1/chat/completions"
    assert res["max_concurrent_requests_seen"] == 3
    assert res["total_output_tokens"] == 5 * n
    # chat prompts are text: the server's usage counts them, chat template included
    tok = make_tokenizer()
    expected = random_requests(n, 9, 0.0, 5, 0.0, "chat", seed=0)
    assert res["total_input_tokens"] == sum(chat_tokens(tok, r.messages) for r in expected)
    assert res["goodput"]["requests_meeting_slos"] == 0 and res["goodput"]["request_throughput"] == 0
    per = res["requests"]
    assert len(per) == n and all(r["ok"] and r["output_tokens"] == 5 and len(r["itl_s"]) >= 1 for r in per)
    # TPOT = (E2E - TTFT) / (output tokens - 1), per request
    tpots = sorted((r["e2e_s"] - r["ttft_s"]) / 4 * 1000 for r in per)
    assert res["tpot_ms"]["p50"] == pytest.approx((tpots[5] + tpots[6]) / 2)


def test_prefix_dataset_and_no_stream(server, tmp_path):
    rc, res = bench(server, tmp_path, "--dataset", "prefix", "--num-prefixes", "2", "--prefix-len", "20",
                    "--input-len", "4", "--output-len", "3", "--num-requests", "6", *IDS)
    assert rc == 0 and res["completed"] == 6 and res["total_input_tokens"] == 6 * 24
    rc, res = bench(server, tmp_path, "--no-stream", "--num-requests", "4", "--input-len", "5", "--output-len", "3",
                    *IDS, "--goodput", "e2e:60000", name="plain.json")
    assert rc == 0 and res["completed"] == 4 and res["total_output_tokens"] == 12
    assert res["ttft_ms"]["p50"] is None and res["e2e_ms"]["p50"] > 0 and res["goodput"]["requests_meeting_slos"] == 4


def test_dataset_file(server, tmp_path):
    """ShareGPT's from/value, role/content and OpenAI messages; the reference reply after the
    last user turn is dropped; a record's max_tokens wins over --output-len."""
    records = [
        {"conversations": [{"from": "system", "value": "w1 w2"}, {"from": "human", "value": "w3 w4 w5"},
                           {"from": "gpt", "value": "w6 w7 w8 w9 w10"}]},
        {"conversations": [{"role": "user", "content": "w20"}], "max_tokens": 2},
        {"messages": [{"role": "user", "content": "w30"}, {"role": "assistant", "content": "w31"},
                      {"role": "user", "content": "w32 w33"}]},
        {"prompt": "w40 w41 w42"},
        {"conversations": [{"from": "gpt", "value": "no user turn: skipped"}]},
    ]
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    rc, res = bench(server, tmp_path, "--endpoint-type", "chat", "--dataset-path", str(path), "--num-requests", "4",
                    "--output-len", "5")
    assert rc == 0 and res["completed"] == 4 and res["config"]["dataset"] == "file"
    assert res["total_output_tokens"] == 5 + 2 + 5 + 5
    tok = make_tokenizer()
    prompts = [[{"role": "system", "content": "w1 w2"}, {"role": "user", "content": "w3 w4 w5"}],
               [{"role": "user", "content": "w20"}],
               [{"role": "user", "content": "w30"}, {"role": "assistant", "content": "w31"},
                {"role": "user", "content": "w32 w33"}],
               [{"role": "user", "content": "w40 w41 w42"}]]
    assert res["total_input_tokens"] == sum(chat_tokens(tok, m) for m in prompts)
    path.write_text(json.dumps(records))  # the same as a .json list
    json_path = path.rename(tmp_path / "chats.json")
    rc, again = bench(server, tmp_path, "--endpoint-type", "chat", "--dataset-path", str(json_path),
                      "--num-requests", "4", "--output-len", "5", name="again.json")
    assert rc == 0 and again["total_input_tokens"] == res["total_input_tokens"]


@pytest.mark.parametrize("argv, message", [
    (["--goodput", "ttft"], "METRIC:MS"),
    (["--goodput", "latency:5"], "METRIC:MS"),
    (["--goodput", "ttft:-3"], "positive"),
    (["--request-rate", "0"], "--request-rate must be positive"),
    (["--input-len-range", "1.5"], "--input-len-range must be in [0, 1)"),
    (["--max-concurrency", "0"], "--max-concurrency must be a positive integer"),
    (["--extra-body", "[1]"], "JSON object"),
    (["--dataset", "file"], "--dataset file and --dataset-path go together"),
    (["--no-stream", "--goodput", "ttft:100"], "need streamed requests"),
    (["--base-url", "127.0.0.1:8000"], "--base-url must start with http:// or https://"),
])
def test_bad_arguments_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "serve", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_bad_dataset_files_name_the_record(tmp_path, capsys):
    cases = [("bad.jsonl", "{not json", "not valid JSON"),
             ("role.jsonl", json.dumps({"messages": [{"role": "wizard", "content": "x"}]}), "record 0 turn 0: unknown "
                                                                                             "role 'wizard'"),
             ("conv.jsonl", json.dumps({"messages": [{"role": "user", "content": "x"}]}), "--endpoint-type chat")]
    for name, text, message in cases:
        (tmp_path / name).write_text(text)
        with pytest.raises(SystemExit) as e:
            main(["bench", "serve", "--dataset-path", str(tmp_path / name)])  # completions: conversations refused
        assert e.value.code == 2
        assert message in capsys.readouterr().err, name
    with pytest.raises(SystemExit):
        main(["bench", "serve", "--dataset-path", str(tmp_path / "missing.json")])
    assert "no such file" in capsys.readouterr().err


def test_unreachable_server_is_one_clear_line(tmp_path, capsys):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc = main(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--num-requests", "3", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 1 and "cannot reach http://127.0.0.1" in err and "is the server running" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_api_key(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with running_server(FakeEngine(), api_key="sesame") as s:
        argv = ["bench", "serve", "--base-url", s.url, "--num-requests", "2", "--output-len", "2", *IDS,
                "--no-progress"]
        assert main(argv) == 1
        assert "--api-key" in capsys.readouterr().err
        assert main([*argv, "--api-key", "sesame"]) == 0
        monkeypatch.setenv("OPENAI_API_KEY", "sesame")
        assert main(argv) == 0
        assert "Completed / failed requests      2 / 0" in capsys.readouterr().out


def test_failed_requests_are_counted_and_named(server, tmp_path, capsys):
    """top_p 7: every request fails with the server's 400; the run
    says why and exits 1."""
    rc, res = bench(server, tmp_path, "--num-requests", "3", *IDS, "--output-len", "2", "--extra-body", '{"top_p": 7}')
    assert rc == 1 and res["completed"] == 0 and res["failed"] == 3
    assert res["errors"][0]["count"] == 3 and res["errors"][0]["error"].startswith("HTTP 400")
    captured = capsys.readouterr()
    assert "failed x3: HTTP 400" in captured.out and "every request failed" in captured.err
