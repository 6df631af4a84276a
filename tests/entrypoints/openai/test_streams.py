"""Many streams at once, disconnects abort and free blocks, queue limits, engine failures."""
from __future__ import annotations

import asyncio
import json

import httpx

from .conftest import MODEL, metric, openai_client, running_server, wait_for
from .fake_engine import FakeEngine

LONG = {"model": MODEL, "temperature": 0, "prompt": "w1", "max_tokens": 250, "ignore_eos": True}


def test_32_concurrent_streams_all_finish(server, aclient):
    async def one(i: int) -> tuple[str, str]:
        stream = await aclient.completions.create(model=MODEL, prompt=f"w{i}", max_tokens=8, temperature=0,
                                                  stream=True, extra_body={"ignore_eos": True})
        text, reason = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def run():
        return await asyncio.gather(*(one(i) for i in range(32)))

    results = asyncio.run(run())
    expected = [(" ".join(f"w{(i + k) % 100}" for k in range(1, 9)), "length") for i in range(32)]
    assert results == expected
    assert len(server.engine.threads) == 1  # only the engine thread ever called the engine
    assert wait_for(lambda: metric(server.url, "pagedjax:kv_blocks_free") == server.engine.num_blocks)


def test_dropped_stream_aborts_and_frees_blocks(slow_server):
    s = slow_server
    total = metric(s.url, "pagedjax:kv_blocks_total")
    with httpx.stream("POST", s.url + "/v1/completions", json={**LONG, "stream": True}, timeout=10) as r:
        lines = r.iter_lines()
        first = json.loads(next(line for line in lines if line)[6:])
        assert wait_for(lambda: metric(s.url, "pagedjax:kv_blocks_free") < total)
    # leaving the block closed the connection mid-stream
    engine_id = first["id"] + "-0"
    assert wait_for(lambda: engine_id in s.engine.aborted)
    assert wait_for(lambda: metric(s.url, "pagedjax:kv_blocks_free") == total)
    assert metric(s.url, "pagedjax:num_requests_running") == 0


def test_dropped_non_streaming_request_aborts(slow_server):
    s = slow_server
    try:
        httpx.post(s.url + "/v1/completions", json=LONG, timeout=0.3)
    except httpx.TimeoutException:
        pass
    assert wait_for(lambda: len(s.engine.aborted) == 1)
    assert wait_for(lambda: metric(s.url, "pagedjax:kv_blocks_free") == s.engine.num_blocks)
    assert httpx.get(s.url + "/health").status_code == 200


def test_queue_full_is_429():
    # max_num_seqs=0: nothing ever runs, so every request stays pending
    with running_server(FakeEngine(max_num_seqs=0, step_delay=0.01), max_pending_requests=1) as s:
        with httpx.stream("POST", s.url + "/v1/completions", json={**LONG, "stream": True}, timeout=10):
            assert wait_for(lambda: s.async_engine.num_pending == 1)
            r = httpx.post(s.url + "/v1/completions", json=LONG, timeout=10)
            assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
            assert "pending" in r.json()["error"]["message"]
        assert wait_for(lambda: s.async_engine.num_pending == 0 and len(s.engine.aborted) == 1)
        assert metric(s.url, "pagedjax:num_requests_waiting") == 0


def test_metrics(server, client):
    client.completions.create(model=MODEL, prompt="w1 w2", max_tokens=3, temperature=0)
    httpx.post(server.url + "/v1/completions", json={"model": "nope", "prompt": "w1"})
    text = httpx.get(server.url + "/metrics").text
    for name in ["pagedjax:kv_blocks_free", "pagedjax:kv_blocks_total", "pagedjax:num_requests_running",
                 "pagedjax:num_requests_waiting", "pagedjax:prefix_cache_hit_tokens_total",
                 "pagedjax:prefix_cache_query_tokens_total", "pagedjax:num_preemptions_total",
                 "pagedjax:kv_cache_usage_ratio", "pagedjax:time_to_first_token_seconds_bucket",
                 "pagedjax:time_per_output_token_seconds_count", "pagedjax:e2e_request_latency_seconds_sum",
                 'pagedjax:request_success_total{finished_reason="length"}', "pagedjax:prompt_tokens_total",
                 "pagedjax:generation_tokens_total", 'pagedjax:request_errors_total{status="404"}']:
        assert name in text, name
    assert metric(server.url, "pagedjax:e2e_request_latency_seconds_count") >= 1
    assert metric(server.url, "pagedjax:generation_tokens_total") >= 3
