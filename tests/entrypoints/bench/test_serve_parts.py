"""The parts of `bench serve` without a server: datasets, arrival times, metrics, and the
stream parser over canned server answers (no usage, role-only chunks, errors)."""
from __future__ import annotations

import asyncio
import json
from collections import Counter

import httpx
import numpy as np
import pytest

from pagedjax.entrypoints.bench.datasets import prefix_requests, random_requests, record_request
from pagedjax.entrypoints.bench.metrics import RequestResult, meets, serve_metrics, summarize
from pagedjax.entrypoints.bench.serve import arrival_times
from pagedjax.entrypoints.bench.serve_client import base_url, request_body, send


def test_random_lengths_stay_in_their_ranges():
    reqs = random_requests(200, 100, 0.2, 10, 0.5, "completions", seed=1, id_range=(5, 9))
    assert {len(r.prompt) == r.prompt_len for r in reqs} == {True}
    assert min(r.prompt_len for r in reqs) >= 80 and max(r.prompt_len for r in reqs) <= 120
    assert {t for r in reqs for t in r.prompt} == {5, 6, 7, 8}
    assert min(r.max_tokens for r in reqs) >= 5 and max(r.max_tokens for r in reqs) <= 15
    assert len({r.max_tokens for r in reqs}) > 5
    chat = random_requests(3, 7, 0.0, 4, 0.0, "chat", seed=1)
    assert all(len(r.messages[0]["content"].split()) == 7 and r.prompt_len is None for r in chat)
    assert random_requests(3, 7, 0.0, 4, 0.0, "chat", seed=1) == chat  # seeded


def test_prefix_requests_share_each_prefix_equally():
    reqs = prefix_requests(12, 3, 16, 5, 0.0, 4, 0.0, "completions", seed=0)
    prefixes = Counter(tuple(r.prompt[:16]) for r in reqs)
    assert len(prefixes) == 3 and set(prefixes.values()) == {4}
    assert len({tuple(r.prompt[16:]) for r in reqs}) == 12 and all(r.prompt_len == 21 for r in reqs)
    chat = prefix_requests(8, 2, 6, 3, 0.0, 4, 0.0, "chat", seed=0)
    assert Counter(r.messages[0]["content"] for r in chat).most_common()[0][1] == 4
    assert {r.messages[0]["role"] for r in chat} == {"system"} and {r.messages[1]["role"] for r in chat} == {"user"}


def test_file_record_shapes():
    rec = {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"},
                             {"from": "human", "value": "c"}, {"from": "gpt", "value": "reference"}]}
    req = record_request(rec, 0, "chat", 9)
    assert req.messages == [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                            {"role": "user", "content": "c"}] and req.max_tokens == 9
    assert record_request({"prompt": "hi", "max_tokens": 3}, 0, "completions", 9).prompt == "hi"
    with pytest.raises(ValueError, match="record 4: max_tokens must be a positive integer"):
        record_request({"prompt": "hi", "max_tokens": 0}, 4, "chat", 9)
    with pytest.raises(ValueError, match="needs 'conversations' or 'messages'"):
        record_request({"text": "hi"}, 0, "chat", 9)


def test_arrival_times_poisson_and_burstiness():
    assert arrival_times(4, float("inf"), 1.0, 0) == [0.0] * 4
    for burstiness in (0.25, 1.0, 4.0):
        t = np.asarray(arrival_times(20000, 50.0, burstiness, seed=7))
        gaps = np.diff(t)
        assert t[0] == 0 and gaps.mean() == pytest.approx(1 / 50, rel=0.05)
        # gamma gaps: squared coefficient of variation 1 / shape (1: Poisson)
        assert (gaps.std() / gaps.mean()) ** 2 == pytest.approx(1 / burstiness, rel=0.1)
    assert arrival_times(5, 3.0, 1.0, 1) == arrival_times(5, 3.0, 1.0, 1)


def test_metrics_tpot_and_goodput():
    a = RequestResult(ok=True, ttft=0.1, e2e=0.5, itl=[0.1, 0.1, 0.2], prompt_tokens=10, output_tokens=5,
                      usage_reported=True)
    one = RequestResult(ok=True, ttft=0.3, e2e=0.3, prompt_tokens=4, output_tokens=1, usage_reported=True)
    failed = RequestResult(error="HTTP 500: boom")
    assert a.tpot == pytest.approx(0.1) and one.tpot is None
    assert meets(a, {"tpot": 100.0, "ttft": 100.0}) and not meets(a, {"tpot": 99.0})
    assert meets(one, {"tpot": 1.0})  # one token: no TPOT, it cannot miss
    assert not meets(RequestResult(ok=True, e2e=0.1, output_tokens=3), {"ttft": 1e9})  # not streamed: no TTFT
    m = serve_metrics([a, one, failed], 2.0, {"e2e": 400.0})
    assert (m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"]) == (2, 1, 14, 6)
    assert m["request_throughput"] == 1.0 and m["output_throughput"] == 3.0 and m["total_token_throughput"] == 10.0
    assert m["goodput"] == {"slos_ms": {"e2e": 400.0}, "requests_meeting_slos": 1, "request_throughput": 0.5}
    assert m["errors"] == [{"error": "HTTP 500: boom", "count": 1}]
    assert m["itl_ms"]["mean"] == pytest.approx(400 / 3)
    s = summarize([0.001 * i for i in range(1, 101)])
    assert s["mean"] == pytest.approx(50.5) and s["p50"] == pytest.approx(50.5) and s["p99"] == pytest.approx(99.01)
    assert summarize([]) == {"mean": None, "std": None, "p50": None, "p90": None, "p99": None}


def _run(lines: list[str], status: int = 200, stream: bool = True) -> RequestResult:
    """`send` against a canned answer of SSE `lines` (or one JSON body when not streamed)."""
    def handler(request: httpx.Request) -> httpx.Response:
        if not stream:
            return httpx.Response(status, json=json.loads(lines[0]))
        return httpx.Response(status, content="".join(f"{line}\n\n" for line in lines).encode(),
                              headers={"content-type": "text/event-stream"})

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://x") as client:
            return await send(client, "/v1/chat/completions", {"stream": stream}, 7, 0.0)

    return asyncio.run(go())


def _chunk(delta: dict | None = None, usage: dict | None = None) -> str:
    body = {"choices": [] if delta is None else [{"index": 0, "delta": delta}]}
    if usage:
        body["usage"] = usage
    return "data: " + json.dumps(body)


def test_stream_parsing():
    # the role-only chunk is no output; without usage each output chunk counts as a token
    r = _run([_chunk({"role": "assistant", "content": ""}), _chunk({"content": "a"}), _chunk({"content": "b"}),
              _chunk({"reasoning_content": "c"}), "data: [DONE]"])
    assert r.ok and r.output_tokens == 3 and not r.usage_reported and r.prompt_tokens == 7 and len(r.itl) == 2
    assert 0 < r.ttft <= r.e2e
    r = _run([_chunk({"content": "a"}), _chunk(usage={"prompt_tokens": 11, "completion_tokens": 4}), "data: [DONE]"])
    assert r.ok and (r.prompt_tokens, r.output_tokens, r.usage_reported) == (11, 4, True)
    r = _run([_chunk({"content": "a"}), 'data: {"error": {"message": "engine died", "code": 503}}'])
    assert not r.ok and r.error == "stream error: engine died"
    r = _run(["data: {not json"])
    assert not r.ok and r.error.startswith("bad response")
    r = _run(['{"error": {"message": "max_tokens is too large"}}'], status=400, stream=False)
    assert not r.ok and r.error == "HTTP 400: max_tokens is too large"
    r = _run(['{"usage": {"prompt_tokens": 3, "completion_tokens": 2}}'], stream=False)
    assert r.ok and r.ttft is None and r.output_tokens == 2 and r.e2e > 0


def test_request_bodies():
    req = random_requests(1, 3, 0.0, 5, 0.0, "chat")[0]
    body = request_body(req, "chat", "m", True, True, 0.5, {"top_p": 0.9})
    assert body == {"model": "m", "temperature": 0.5, "stream": True, "messages": req.messages,
                    "max_completion_tokens": 5, "stream_options": {"include_usage": True}, "ignore_eos": True,
                    "top_p": 0.9}
    req = random_requests(1, 3, 0.0, 5, 0.0, "completions")[0]
    body = request_body(req, "completions", "m", False, False, 0.0)
    assert body == {"model": "m", "temperature": 0.0, "stream": False, "prompt": req.prompt, "max_tokens": 5}
    assert base_url("http://h:1/v1/") == base_url("http://h:1") == "http://h:1"
