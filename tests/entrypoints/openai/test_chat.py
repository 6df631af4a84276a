"""/v1/chat/completions through the official openai client (sync and async) and httpx."""
from __future__ import annotations

import asyncio
import json

import httpx

from .conftest import MODEL

G = dict(model=MODEL, temperature=0.0)
USER_W5 = [{"role": "user", "content": "w5"}]  # "<|im_start|>user\nw5<|im_end|>\n<|im_start|>assistant\n": 6 tokens


def test_chat_text_and_usage(client):
    r = client.chat.completions.create(messages=USER_W5, max_tokens=3, **G)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL
    c = r.choices[0]
    assert (c.index, c.message.role, c.message.content, c.finish_reason) == (0, "assistant", "w6 w7 w8", "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (6, 3, 9)


def test_chat_default_max_tokens_runs_to_eos(client):
    r = client.chat.completions.create(messages=[{"role": "user", "content": "w95"}], **G)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("w96 w97 w98 w99", "stop")
    assert r.usage.completion_tokens == 5  # EOS counts


def test_chat_system_parts_and_max_completion_tokens(client):
    msgs = [{"role": "system", "content": "w1"},
            {"role": "user", "content": [{"type": "text", "text": "w2 "}, {"type": "text", "text": "w8"}]}]
    r = client.chat.completions.create(messages=msgs, max_completion_tokens=2, **G)
    assert r.choices[0].message.content == "w9 w10" and r.usage.prompt_tokens == 11


def test_chat_n2_and_stop(client):
    r = client.chat.completions.create(messages=USER_W5, max_tokens=4, n=2, stop="w9", **G)
    assert [(c.index, c.message.content, c.finish_reason) for c in r.choices] == [
        (0, "w6 w7 w8 ", "stop"), (1, "w7 w8 ", "stop")]


def test_chat_logprobs(client):
    r = client.chat.completions.create(messages=USER_W5, max_tokens=2, logprobs=True, top_logprobs=2, **G)
    content = r.choices[0].logprobs.content
    assert [(t.token, t.logprob, t.bytes) for t in content] == [("w6", -0.5, [119, 54]), ("w7", -0.5, [119, 55])]
    assert [(t.token, t.logprob) for t in content[0].top_logprobs] == [("w6", -0.5), ("w7", -1.0)]
    r = client.chat.completions.create(messages=USER_W5, max_tokens=1, logprobs=True, **G)
    assert r.choices[0].logprobs.content[0].top_logprobs == []


def test_chat_stream_openai(client):
    chunks = list(client.chat.completions.create(messages=USER_W5, max_tokens=3, stream=True,
                                                 stream_options={"include_usage": True}, **G))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "w6 w7 w8"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 9
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_stream_async_n2(aclient):
    async def run():
        stream = await aclient.chat.completions.create(messages=USER_W5, max_tokens=2, n=2, stream=True, **G)
        text, reasons = {0: "", 1: ""}, {}
        async for chunk in stream:
            for ch in chunk.choices:
                text[ch.index] += ch.delta.content or ""
                if ch.finish_reason:
                    reasons[ch.index] = ch.finish_reason
        return text, reasons

    assert asyncio.run(run()) == ({0: "w6 w7", 1: "w7 w8"}, {0: "length", 1: "length"})


def test_chat_stream_raw_sse_logprobs(server):
    body = {"model": MODEL, "temperature": 0, "messages": USER_W5, "max_tokens": 2, "stream": True,
            "logprobs": True, "top_logprobs": 1}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=10) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    toks = [t["token"] for c in chunks for ch in c["choices"] if ch["logprobs"] for t in ch["logprobs"]["content"]]
    assert toks == ["w6", "w7"]
