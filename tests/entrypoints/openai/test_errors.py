"""Bad requests get their 4xx in OpenAI's error shape, and the server keeps serving."""
from __future__ import annotations

import httpx
import openai
import pytest

from .conftest import MODEL, openai_client, running_server

C, CHAT = "/v1/completions", "/v1/chat/completions"
P = {"model": MODEL, "prompt": "w1", "max_tokens": 2}
M = {"model": MODEL, "messages": [{"role": "user", "content": "w1"}], "max_tokens": 2}
LONG = " ".join(["w1"] * 300)  # max_model_len is 256

# (path, body (dict, or raw bytes), status, param the error must name (None: no check))
BAD = [
    (C, b"{", 400, None),
    (C, b"[1, 2]", 400, None),
    (C, b"", 400, None),
    (C, {"model": MODEL}, 400, "prompt"),
    (C, {**P, "foo": 1}, 400, "foo"),
    (C, {**P, "presence_penalty": 2.5}, 400, "presence_penalty"),
    (C, {**P, "frequency_penalty": -2.5}, 400, "frequency_penalty"),
    (C, {**P, "model": "nope"}, 404, "model"),
    (C, {**P, "max_tokens": 0}, 400, "max_tokens"),
    (C, {**P, "max_tokens": "5"}, 400, "max_tokens"),
    (C, {**P, "max_tokens": 1000}, 400, "max_tokens"),
    (C, {**P, "prompt": LONG}, 400, "prompt"),
    (C, {**P, "temperature": -1}, 400, "temperature"),
    (C, {**P, "top_p": 0}, 400, "top_p"),
    (C, {**P, "n": 0}, 400, "n"),
    (C, {**P, "n": True}, 400, "n"),
    (C, {**P, "seed": -1}, 400, "seed"),
    (C, {**P, "prompt": []}, 400, "prompt"),
    (C, {**P, "prompt": ""}, 400, "prompt"),
    (C, {**P, "prompt": [10**9]}, 400, "prompt"),
    (C, {**P, "prompt": [-1]}, 400, "prompt"),
    (C, {**P, "prompt": [1.5]}, 400, "prompt"),
    (C, {**P, "logprobs": 21}, 400, "logprobs"),
    (C, {**P, "echo": "yes"}, 400, "echo"),
    (C, {**P, "suffix": "x"}, 400, "suffix"),
    (C, {**P, "best_of": 3}, 400, "best_of"),
    (C, {**P, "logit_bias": {"5": 101}}, 400, "logit_bias"),
    (C, {**P, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (C, {**P, "stream": True, "stream_options": {"bogus": 1}}, 400, "stream_options.bogus"),
    (C, {**P, "stop": [""]}, 400, None),
    (C, {**P, "stop": 5}, 400, "stop"),
    (C, {**P, "top_k": -2}, 400, "top_k"),
    (C, {**P, "stop_token_ids": [-3]}, 400, None),
    (CHAT, {"model": MODEL}, 400, "messages"),
    (CHAT, {**M, "messages": []}, 400, "messages"),
    (CHAT, {**M, "messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].tool_call_id"),
    (CHAT, {**M, "messages": [{"role": "function", "content": "x"}]}, 400, "messages[0].role"),
    (CHAT, {**M, "messages": [{"role": "user"}]}, 400, "messages[0].content"),
    (CHAT, {**M, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, 400,
     "messages[0].content"),
    (CHAT, {**M, "messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    (CHAT, {**M, "max_completion_tokens": 1000}, 400, "max_completion_tokens"),
    (CHAT, {**M, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {**M, "logprobs": 3}, 400, "logprobs"),
    (CHAT, {**M, "tools": [{"type": "function", "function": {"name": "f g"}}]}, 400, "tools[0].function.name"),
    (CHAT, {**M, "tool_choice": "auto"}, 400, "tool_choice"),
    (CHAT, {**M, "response_format": {"type": "json_object"}}, 400, "response_format"),
    (CHAT, {**M, "presence_penalty": 3.0}, 400, "presence_penalty"),
    (CHAT, {**M, "model": "gpt-4"}, 404, "model"),
]


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_request(server, path, body, status, param):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    r = httpx.post(server.url + path, timeout=10, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err


def test_server_healthy_after_bad_requests(server, client):
    for path, body, _, _ in BAD:
        httpx.post(server.url + path, json=body if isinstance(body, dict) else None, timeout=10)
    assert httpx.get(server.url + "/health").status_code == 200
    assert client.completions.create(model=MODEL, prompt="w1", max_tokens=1, temperature=0).choices[0].text == "w2"


def test_accepted_no_op_values(server):
    ok = [(C, {**P, "presence_penalty": 0, "frequency_penalty": 0.0, "echo": False, "logit_bias": {}, "user": "u",
               "best_of": 1, "suffix": None}),
          (CHAT, {**M, "response_format": {"type": "text"}, "tools": [], "tool_choice": "none", "logit_bias": None})]
    for path, body in ok:
        assert httpx.post(server.url + path, json=body, timeout=10).status_code == 200


def test_unknown_route_and_method(server):
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert httpx.get(server.url + C).status_code == 405


def test_openai_client_exceptions(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="w1")
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w1"}], presence_penalty=3)


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")


def test_api_key():
    with running_server(api_key="sekret") as s:
        with pytest.raises(openai.AuthenticationError):
            openai_client(s.url, api_key="wrong").models.list()
        r = httpx.post(s.url + C, json=P)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert openai_client(s.url, api_key="sekret").completions.create(**P).choices[0].text
        assert httpx.get(s.url + "/health").status_code == 200  # health and metrics need no key
        assert httpx.get(s.url + "/metrics").status_code == 200


def test_chat_template_without_its_engine_is_a_server_error():
    """A tokenizer that cannot render its chat template (jinja2 missing) is the server's fault:
    500 server_error, not a 400 that blames the messages; a template error stays a 400."""
    from types import SimpleNamespace

    from pagedjax.entrypoints.openai.errors import APIError
    from pagedjax.entrypoints.openai.protocol import ChatMessage
    from pagedjax.entrypoints.openai.serving_chat import ChatServing

    class Tokenizer:
        chat_template = "{{ messages }}"
        error: Exception

        def decode(self, ids):
            return ""

        def apply_chat_template(self, *args, **kwargs):
            raise self.error

    tok = Tokenizer()
    engine = SimpleNamespace(max_model_len=64, engine=SimpleNamespace(vocab_size=10))
    chat = ChatServing(engine, MODEL, tok)
    messages = [ChatMessage(role="user", content="w1")]
    for error, status, type_ in ((ImportError("apply_chat_template requires jinja2"), 500, "server_error"),
                                 (ValueError("roles must alternate"), 400, "invalid_request_error")):
        tok.error = error
        with pytest.raises(APIError) as info:
            chat.render(messages)
        assert (info.value.status, info.value.type) == (status, type_) and str(error) in info.value.message
