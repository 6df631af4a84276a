"""Hostile input, slow clients, overload and faults: each test pins one defect class.

All over real uvicorn and the FakeEngine (hand-computable outputs, see fake_engine.py).
"""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time

import httpx
import pytest
from pydantic import ValidationError

from pagedjax.sampling_params import MAX_STOP_STRINGS, SamplingParams
from pagedjax.engine.async_engine import AsyncEngine, EngineDeadError
from pagedjax.entrypoints.openai.protocol import CompletionRequest

from .conftest import MODEL, metric, running_server, wait_for
from .fake_engine import W0, FakeEngine

C, CHAT = "/v1/completions", "/v1/chat/completions"
P = {"model": MODEL, "prompt": "w1", "max_tokens": 2}


def _post(url: str, body, **kw) -> httpx.Response:
    return httpx.post(url + C, json=body, timeout=20, **kw)


# ---- 1. validation blow-up and body caps ------------------------------------------------


def test_huge_malformed_array_costs_one_error_per_union_member():
    body = json.dumps({"prompt": [1.5] * 300_000, "model": MODEL}).encode()
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate_json(body)
    assert info.value.error_count() <= 4  # str | list[str] | list[int] | list[list[int]], first error each


def test_malformed_array_is_a_short_400(server):
    r = httpx.post(server.url + C, content=json.dumps({**P, "prompt": [1.5] * 300_000}),
                   headers={"content-type": "application/json"}, timeout=20)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and len(r.text) < 1000


def test_body_cap_with_and_without_content_length():
    with running_server(FakeEngine(), max_request_bytes=1000) as s:
        big = json.dumps({**P, "prompt": "w1 " * 1000}).encode()
        r = httpx.post(s.url + C, content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413 and "1000 bytes" in r.json()["error"]["message"]

        def chunked():  # no Content-Length: the cap is counted while reading
            for i in range(0, len(big), 100):
                yield big[i:i + 100]

        r = httpx.post(s.url + C, content=chunked(), headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert _post(s.url, P).status_code == 200


# ---- 2. bounded numbers; one request's data fails only that request ----------------------


@pytest.mark.parametrize("field,value", [("top_k", 2**31), ("max_tokens", 2**31), ("seed", 2**63),
                                         ("stop_token_ids", [2**31]), ("prompt", [2**31]), ("n", 65),
                                         ("logprobs", 21), ("temperature", 2.5)])
def test_out_of_range_numbers_are_400(server, field, value):
    r = _post(server.url, {**P, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith(field), r.text


def test_python_api_bounds():
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=2**31)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=float("nan"))
    assert SamplingParams(temperature=1e-30).temperature == 1e-2  # near zero: clamped, not overflowed


def test_tiny_temperature_is_served(server):
    r = _post(server.url, {**P, "temperature": 1e-30})
    assert r.status_code == 200 and r.json()["choices"][0]["text"]


def test_bad_request_does_not_disturb_a_running_stream(slow_server):
    s = slow_server
    body = {**P, "max_tokens": 30, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", s.url + C, json=body, timeout=20) as r:
        lines = r.iter_lines()
        next(line for line in lines if line)
        assert _post(s.url, {**P, "top_k": 2**31}).status_code == 400
        text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines
                       if line.startswith("data: {") and json.loads(line[6:])["choices"])
    assert text.split()[-1] == "w31"


# ---- 3. slow readers: one pending update per stream, send timeout ------------------------


def test_unread_stream_holds_one_merged_update():
    async def run():
        engine = FakeEngine(step_delay=0.0005)
        ae = AsyncEngine(engine)
        ae.start()
        stream = await ae.add_request("a", [W0], SamplingParams(max_tokens=200, n=4, logprobs=5, ignore_eos=True))
        while stream.finish_time is None:  # the consumer takes nothing while the engine runs
            await asyncio.sleep(0.01)
        outs = [o async for o in stream]
        await ae.shutdown()
        return outs

    outs = asyncio.run(run())
    assert len(outs) == 1 and outs[0].finished  # everything merged into one pending update
    assert [len(c.token_ids) for c in outs[0].outputs] == [200] * 4
    assert [len(c.logprobs) for c in outs[0].outputs] == [200] * 4


def test_unread_multi_prompt_streams_stay_merged():
    from pagedjax.entrypoints.openai.streaming import merge_streams

    async def run():
        ae = AsyncEngine(FakeEngine(step_delay=0.0005))
        ae.start()
        streams = [await ae.add_request(f"p{i}", [W0], SamplingParams(max_tokens=100, ignore_eos=True))
                   for i in range(3)]
        merged = merge_streams(streams)
        first = await merged.__anext__()  # the consumer takes one item, then stalls
        while any(s.finish_time is None for s in streams):
            await asyncio.sleep(0.01)
        rest = [item async for item in merged]
        await ae.shutdown()
        return first, rest

    first, rest = asyncio.run(run())
    assert len(rest) <= 2 * 3  # per stream: the item read ahead and one merged update, not one per step
    tokens = {0: 0, 1: 0, 2: 0}
    for i, out in [first, *rest]:
        tokens[i] += len(out.outputs[0].token_ids)
    assert tokens == {0: 100, 1: 100, 2: 100}


def test_stalled_reader_is_aborted_after_send_timeout():
    engine = FakeEngine(step_delay=0.01, max_model_len=4096, num_blocks=100_000)
    with running_server(engine, send_timeout=0.5) as s:
        body = json.dumps({**P, "max_tokens": 3000, "n": 64, "logprobs": 20, "ignore_eos": True,
                           "stream": True}).encode()
        port = int(s.url.rsplit(":", 1)[1])
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)  # ... and never read
        try:
            assert wait_for(lambda: len(engine.aborted) == 1, timeout=30)
            assert wait_for(lambda: metric(s.url, "pagedjax:kv_blocks_free") == engine.num_blocks)
            assert engine.num_steps < 3000  # aborted while it still ran, not finished
            assert httpx.get(s.url + "/health").status_code == 200
        finally:
            sock.close()


# ---- 4. stop lists are capped ------------------------------------------------------------


def test_stop_list_caps(server):
    r = _post(server.url, {**P, "stop": ["x"] * (MAX_STOP_STRINGS + 1)})
    assert r.status_code == 400 and str(MAX_STOP_STRINGS) in r.json()["error"]["message"]
    r = _post(server.url, {**P, "stop": "x" * 1000})
    assert r.status_code == 400 and "256" in r.json()["error"]["message"]


# ---- 5. aborts are O(1) on the engine thread ---------------------------------------------


def test_abort_posts_no_copy_of_the_output():
    async def run():
        ae = AsyncEngine(FakeEngine(step_delay=0.05))  # at most a step or two between the first item and the abort
        ae.start()
        stream = await ae.add_request("a", [W0], SamplingParams(max_tokens=200, n=8, logprobs=20, ignore_eos=True))
        first = await stream.__anext__()
        ae.abort("a")
        rest = [o async for o in stream]
        await ae.shutdown()
        return first, rest

    first, rest = asyncio.run(run())
    assert [len(c.token_ids) for c in first.outputs] == [1] * 8 and rest[-1].finished
    # what follows the first item is at most two steps' deltas: the abort itself adds nothing
    # (a copy of the output so far would carry every token again)
    assert sum(len(c.token_ids) for o in rest for c in o.outputs) <= 2 * 8
    assert all(c.finish_reason is None for o in rest for c in o.outputs)


# ---- 6. admission counts sequences; Retry-After -------------------------------------------


def test_pending_limit_counts_sequences():
    with running_server(FakeEngine(max_num_seqs=0, step_delay=0.01), max_pending_requests=4) as s:
        r = _post(s.url, {**P, "n": 5})
        assert r.status_code == 400 and "5 sequences" in r.json()["error"]["message"]
        with httpx.stream("POST", s.url + C, json={**P, "n": 3, "stream": True}, timeout=10):
            assert wait_for(lambda: s.async_engine.num_pending == 3)
            assert _post(s.url, {**P, "n": 2}).status_code == 429  # 3 + 2 sequences > 4
            with httpx.stream("POST", s.url + C, json={**P, "n": 1, "stream": True}, timeout=10) as r:
                assert r.status_code == 200 and wait_for(lambda: s.async_engine.num_pending == 4)
        assert wait_for(lambda: s.async_engine.num_pending == 0)


def test_429_has_retry_after():
    with running_server(FakeEngine(max_num_seqs=0, step_delay=0.01), max_pending_requests=2) as s:
        with httpx.stream("POST", s.url + C, json={**P, "n": 2, "stream": True}, timeout=10):
            assert wait_for(lambda: s.async_engine.num_pending == 2)
            r = _post(s.url, P)
            assert r.status_code == 429 and r.headers["retry-after"] == "1"


# ---- 7. CPU-heavy work stays off the event loop ------------------------------------------


def test_slow_templating_does_not_stall_health(server, monkeypatch):
    from transformers import PreTrainedTokenizerFast

    original = PreTrainedTokenizerFast.apply_chat_template

    def slow(self, *args, **kwargs):
        time.sleep(1.5)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerFast, "apply_chat_template", slow)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "w1"}], "max_tokens": 2}
    t = threading.Thread(target=lambda: httpx.post(server.url + CHAT, json=body, timeout=20))
    t.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    waited = time.monotonic() - t0
    t.join()
    assert waited < 1.0  # on the loop, /health would wait for the template (1.5 s)


# ---- 8. engine faults --------------------------------------------------------------------


def test_failed_step_is_fatal_and_health_turns_503():
    with running_server(FakeEngine(step_delay=0.001)) as s:
        s.engine.fail_next_step = True
        r = _post(s.url, {**P, "max_tokens": 3})
        assert r.status_code == 503 and "injected" not in r.text  # no exception text leaks
        health = httpx.get(s.url + "/health")
        assert health.status_code == 503 and "injected" not in health.text
        assert _post(s.url, P).status_code == 503  # refused at once, nothing hangs


def test_commands_queued_when_the_engine_dies_resolve():
    from pagedjax.engine.async_engine import RequestStream

    async def run():
        engine = FakeEngine(step_delay=0.001)
        ae = AsyncEngine(engine)
        ae.start()
        engine.fail_next_step = True
        first = await ae.add_request("a", [W0], SamplingParams(max_tokens=5))
        with pytest.raises(EngineDeadError):
            [o async for o in first]
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(ae.add_request("b", [W0], SamplingParams()), 5)
        # an add that passed the liveness check just before the engine died
        loop = asyncio.get_running_loop()
        admitted = loop.create_future()
        ae._submit(("add", RequestStream("c", 1, ae.abort, loop), [W0], SamplingParams(), None, admitted))
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(admitted, 5)
        await ae.shutdown()

    asyncio.run(run())


# ---- 9. cache_salt reaches the engine ----------------------------------------------------


def test_cache_salt_is_passed_to_the_engine(server):
    assert _post(server.url, {**P, "cache_salt": "tenant-a"}).status_code == 200
    assert "tenant-a" in server.engine.cache_salts.values()
    assert _post(server.url, {**P, "cache_salt": ""}).status_code == 400


# ---- 10. browser and leak hardening ------------------------------------------------------


def test_non_json_content_type_is_415(server):
    r = httpx.post(server.url + C, content=json.dumps(P), headers={"content-type": "text/plain"})
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
    r = httpx.post(server.url + C, data={"prompt": "w1"})  # an HTML form
    assert r.status_code == 415


def test_500_carries_no_exception_text_and_logs_the_path_safely(monkeypatch, caplog):
    from pagedjax.entrypoints.openai.serving_completion import CompletionServing

    def boom(self, *args, **kwargs):
        raise RuntimeError("secret internals")

    monkeypatch.setattr(CompletionServing, "create", boom)
    with running_server(FakeEngine()) as s, caplog.at_level(logging.ERROR, logger="pagedjax.entrypoints.openai.app"):
        r = _post(s.url, P)
        assert r.status_code == 500 and "secret" not in r.text
    assert any("'/v1/completions'" in rec.getMessage() for rec in caplog.records)


def test_client_leaving_mid_upload_is_not_a_500(server):
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"prompt\":")
    time.sleep(0.3)
    assert 'status="500"' not in httpx.get(server.url + "/metrics").text
    assert httpx.get(server.url + "/health").status_code == 200


def test_api_key_from_environment_and_exposed_bind_warning(monkeypatch, caplog):
    from pagedjax.entrypoints.openai.api_server import add_serve_arguments, api_key_of, warn_if_exposed
    import argparse

    args = add_serve_arguments(argparse.ArgumentParser()).parse_args([])
    monkeypatch.setenv("PAGEDJAX_API_KEY", "from-env")
    assert api_key_of(args) == "from-env"
    with caplog.at_level(logging.WARNING, logger="pagedjax.entrypoints.openai"):
        assert not warn_if_exposed("127.0.0.1", None) and not warn_if_exposed("::1", None)
        assert not warn_if_exposed("0.0.0.0", "key")
        assert warn_if_exposed("0.0.0.0", None)
    assert "without an API key" in caplog.text


# ---- 12. an idle server does no work -----------------------------------------------------


def test_request_that_cannot_progress_does_not_spin():
    async def run():
        engine = FakeEngine(max_num_seqs=0)  # nothing is ever admitted
        ae = AsyncEngine(engine)
        ae.start()
        stream = await ae.add_request("a", [W0], SamplingParams())
        await asyncio.sleep(0.5)
        steps = engine.num_steps
        await asyncio.sleep(0.5)
        idle_steps = engine.num_steps - steps
        stats = ae.stats()
        stream.abort()
        await ae.shutdown()
        return idle_steps, stats

    idle_steps, stats = asyncio.run(run())
    assert idle_steps == 0  # waits for the next command instead of polling the engine
    assert stats["num_requests_in_flight"] == 1 and stats["oldest_request_age_seconds"] >= 0.9


# ---- 13. metrics agree with what clients see ---------------------------------------------


def test_metrics_count_a_stream_in_progress():
    # slow stats: a snapshot taken after the tokens went out would leave a window where the
    # client has tokens and /metrics still shows the request as not running
    with running_server(FakeEngine(step_delay=0.01, stats_delay=0.2)) as s:
        _check_stream_counted(s)


def _check_stream_counted(s) -> None:
    body = {**P, "max_tokens": 100, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", s.url + C, json=body, timeout=20) as r:
        lines = r.iter_lines()  # keep it referenced: a collected iterator closes the connection
        next(line for line in lines if line)
        assert metric(s.url, "pagedjax:num_requests_running") == 1
        assert metric(s.url, "pagedjax:num_requests_in_flight") == 1
        assert metric(s.url, "pagedjax:kv_blocks_free") < metric(s.url, "pagedjax:kv_blocks_total")
