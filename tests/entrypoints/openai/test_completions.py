"""/v1/completions through the official openai client and raw httpx SSE."""
from __future__ import annotations

import json

import httpx

from .conftest import MODEL
from .fake_engine import W0

G = dict(model=MODEL, temperature=0.0)  # greedy: the fake engine's counting output


def test_text_and_usage(client):
    r = client.completions.create(**G, prompt="w1 w2", max_tokens=3)
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    assert [(c.index, c.text, c.finish_reason) for c in r.choices] == [(0, "w3 w4 w5", "length")]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (2, 3, 5)


def test_default_max_tokens_is_16(client):
    r = client.completions.create(**G, prompt="w1", extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"


def test_prompt_lists_and_token_ids(client):
    r = client.completions.create(**G, prompt=["w1", "w10"], max_tokens=2)
    assert [(c.index, c.text) for c in r.choices] == [(0, "w2 w3"), (1, "w11 w12")]
    assert r.usage.prompt_tokens == 2 and r.usage.completion_tokens == 4
    r = client.completions.create(**G, prompt=[W0 + 5, W0 + 6], max_tokens=2)
    assert r.choices[0].text == "w7 w8" and r.usage.prompt_tokens == 2
    r = client.completions.create(**G, prompt=[[W0 + 1], [W0 + 2, W0 + 3]], max_tokens=1)
    assert [c.text for c in r.choices] == ["w2", "w4"] and r.usage.prompt_tokens == 3


def test_n2(client):
    r = client.completions.create(**G, prompt="w1", max_tokens=2, n=2)
    assert [(c.index, c.text) for c in r.choices] == [(0, "w2 w3"), (1, "w3 w4")]
    assert r.usage.completion_tokens == 4


def test_stop_strings_and_stop_token_ids(client):
    r = client.completions.create(**G, prompt="w1", max_tokens=10, stop=["w4", "nothing"])
    assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == ("w2 w3 ", "stop", 3)
    r = client.completions.create(**G, prompt="w1", max_tokens=10, extra_body={"stop_token_ids": [W0 + 3]})
    assert (r.choices[0].text, r.choices[0].finish_reason) == ("w2 w3", "stop")


def test_eos_and_ignore_eos(client):
    r = client.completions.create(**G, prompt="w97", max_tokens=5)
    assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == ("w98 w99", "stop", 3)
    r = client.completions.create(**G, prompt="w97", max_tokens=5, extra_body={"ignore_eos": True})
    assert (r.choices[0].text, r.choices[0].finish_reason) == ("w98 w99 w0 w1", "length")


def test_seed_reproducible_and_passed_through(client, server):
    kw = dict(model=MODEL, prompt="w1", max_tokens=8, temperature=1.0)
    a = client.completions.create(seed=7, **kw).choices[0].text
    b = client.completions.create(seed=7, **kw).choices[0].text
    c = client.completions.create(seed=8, **kw).choices[0].text
    assert a == b and a != c
    client.completions.create(seed=11, top_p=0.5, extra_body={"top_k": 3, "min_p": 0.1}, **kw)
    p = server.engine.params[server.engine.added[-1]]
    assert (p.seed, p.temperature, p.top_p, p.top_k, p.min_p) == (11, 1.0, 0.5, 3, 0.1)


def test_logprobs(client):
    r = client.completions.create(**G, prompt="w1", max_tokens=2, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.tokens == ["w2", "w3"] and lp.token_logprobs == [-0.5, -0.5]
    assert lp.top_logprobs == [{"w2": -0.5, "w3": -1.0}, {"w3": -0.5, "w4": -1.0}]
    assert lp.text_offset == [0, 2]
    assert client.completions.create(**G, prompt="w1", max_tokens=1).choices[0].logprobs is None


def test_stream_openai(client):
    chunks = list(client.completions.create(**G, prompt="w1", max_tokens=3, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "w2 w3 w4"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    assert chunks[-1].usage.prompt_tokens == 1


def test_stream_raw_sse_with_logprobs(server):
    body = {"model": MODEL, "temperature": 0, "prompt": ["w1", "w5"], "max_tokens": 2, "stream": True, "logprobs": 1}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=10) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert all("usage" not in c for c in chunks)
    text = {0: "", 1: ""}
    tokens = {0: [], 1: []}
    for c in chunks:
        for ch in c["choices"]:
            text[ch["index"]] += ch["text"]
            tokens[ch["index"]] += ch["logprobs"]["tokens"]
    assert text == {0: "w2 w3", 1: "w6 w7"} and tokens == {0: ["w2", "w3"], 1: ["w6", "w7"]}
