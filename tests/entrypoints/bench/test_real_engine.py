"""`pagedjax bench` on a real engine over a tiny random Llama: `bench serve` against a real
`pagedjax serve` subprocess, `bench throughput` and `bench latency` in-process."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import httpx
import pytest

from tiny_models import make_tokenizer

from pagedjax.entrypoints.bench.datasets import random_requests
from pagedjax.entrypoints.cli import main

from ..openai.conftest import wait_for

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")
ENGINE = ["--dtype", "float32", "--max-model-len", "96", "--max-num-seqs", "4", "--num-blocks", "64",
          "--block-size", "8", "--max-num-batched-tokens", "32"]


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoints, tmp_path_factory):
    """The tiny llama with a byte-level tokenizer and a chat template."""
    path = tmp_path_factory.mktemp("bench-model") / "tiny"
    shutil.copytree(tiny_checkpoints("llama")[0], path)
    tok = make_tokenizer(384)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "pagedjax.entrypoints.cli", "serve", str(model_dir), "--port",
                             str(port), "--log-level", "warning", *ENGINE], env=dict(os.environ),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    try:
        if not wait_for(lambda: up() or proc.poll() is not None, timeout=180) or proc.poll() is not None:
            proc.kill()
            pytest.fail(f"pagedjax serve did not start: {proc.communicate()[0].decode()[-3000:]}")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_bench_serve_against_pagedjax_serve(server, tmp_path):
    out = tmp_path / "completions.json"
    argv = ["bench", "serve", "--base-url", server, "--no-progress", "--num-warmups", "2"]
    assert main([*argv, "--num-requests", "8", "--max-concurrency", "4", "--input-len", "16", "--output-len", "8",
                 "--token-id-range", "3", "300", "--goodput", "e2e:600000", "--result-file", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["completed"] == 8 and res["failed"] == 0 and res["requests_without_usage"] == 0
    assert (res["total_input_tokens"], res["total_output_tokens"]) == (8 * 16, 8 * 8)
    assert res["goodput"]["requests_meeting_slos"] == 8 and res["max_concurrent_requests_seen"] == 4
    assert 0 < res["ttft_ms"]["p50"] < res["e2e_ms"]["p50"] and res["tpot_ms"]["p50"] > 0 and res["itl_ms"]["p50"] > 0
    assert (tmp_path / "completions.png").is_file()

    out = tmp_path / "chat.json"
    assert main([*argv, "--endpoint-type", "chat", "--num-requests", "6", "--request-rate", "30", "--input-len", "10",
                 "--output-len", "5", "--result-file", str(out), "--no-plot"]) == 0
    res = json.loads(out.read_text())
    assert res["completed"] == 6 and res["total_output_tokens"] == 30 and not (tmp_path / "chat.png").exists()
    # the prompt tokens are the server's own count of each templated chat
    counts = [httpx.post(server + "/tokenize", json={"messages": r.messages}).json()["count"]
              for r in random_requests(6, 10, 0.0, 5, 0.0, "chat", seed=0)]
    assert res["total_input_tokens"] == sum(counts)


def test_bench_throughput(model_dir, tmp_path, capsys):
    out = tmp_path / "throughput.json"
    assert main(["bench", "throughput", "--model", str(model_dir), "--num-prompts", "6", "--input-len", "12",
                 "--output-len", "5", "--output-json", str(out), "--no-progress", *ENGINE]) == 0
    res = json.loads(out.read_text())
    assert (res["num_requests"], res["total_input_tokens"], res["total_output_tokens"]) == (6, 72, 30)
    assert res["requests_per_second"] == pytest.approx(6 / res["elapsed_s"])
    assert res["output_tokens_per_second"] == pytest.approx(30 / res["elapsed_s"])
    assert res["total_tokens_per_second"] == pytest.approx(102 / res["elapsed_s"])
    assert res["compilations_during_run"] == 0  # the warm-up compiled every step shape first
    assert "requests/s" in capsys.readouterr().out


def test_bench_latency(model_dir, tmp_path, capsys):
    out = tmp_path / "latency.json"
    assert main(["bench", "latency", "--model", str(model_dir), "--batch-size", "3", "--input-len", "8",
                 "--output-len", "4", "--num-iters-warmup", "1", "--num-iters", "4", "--output-json", str(out),
                 "--no-progress", *ENGINE]) == 0
    res = json.loads(out.read_text())
    lat = res["latencies_s"]
    assert len(lat) == 4 and res["output_tokens_per_iter"] == 12
    assert res["min_s"] == min(lat) <= res["percentiles_s"]["p10"] <= res["percentiles_s"]["p50"] \
        <= res["percentiles_s"]["p90"] <= res["percentiles_s"]["p99"] <= res["max_s"] == max(lat)
    assert res["mean_s"] == pytest.approx(sum(lat) / 4)
    text = capsys.readouterr().out
    assert "p99" in text and "std" in text


@pytest.mark.parametrize("argv, message", [
    (["latency", "--num-iters", "0"], "--num-iters must be a positive integer"),
    (["throughput", "--input-len", "90", "--output-len", "10", "--max-model-len", "96"], "more than --max-model-len"),
    (["throughput", "--block-size", "3"], "--block-size"),
])
def test_offline_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err
