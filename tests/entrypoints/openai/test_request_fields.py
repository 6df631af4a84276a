"""vLLM's request fields through the official openai client (extra_body) over the fake engine:
the model's generation-config defaults for unset fields, include_stop_str_in_output (streamed
and not), truncate_prompt_tokens, continue_final_message, add_generation_prompt,
return_tokens_as_token_ids, chat_template_kwargs, and the server's --chat-template."""
from __future__ import annotations

import httpx
import openai
import pytest

from pagedjax.entrypoints.cli import build_parser
from pagedjax.entrypoints.cli_args import check_arguments

from .conftest import MODEL, openai_client, running_server
from .fake_engine import W0, FakeEngine

G = dict(model=MODEL, temperature=0.0)
USER_W5 = [{"role": "user", "content": "w5"}]  # "<|im_start|>user\nw5<|im_end|>\n<|im_start|>assistant\n": 6 tokens
DEFAULTS = {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "max_tokens": 7}
# a template of the server's own: the contents, then the `start` chat_template_kwargs may give
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if start is defined %}{{ start }}{% endif %}"


@pytest.fixture(scope="module")
def defaults_server():
    """A server whose model's generation_config.json sets sampling defaults."""
    engine = FakeEngine(step_delay=0.001)
    engine.sampling_defaults = dict(DEFAULTS)  # what LLMEngine reads from the model (--generation-config)
    with running_server(engine) as s:
        yield s


@pytest.fixture(scope="module")
def template_server():
    """A server started with a chat template of its own (--chat-template)."""
    with running_server(FakeEngine(step_delay=0.001), chat_template=TEMPLATE) as s:
        yield s


def last_params(server):
    return server.engine.params[server.engine.added[-1]]


def bad_request(call, param: str, message: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        call()
    assert e.value.body["param"] == param and message in e.value.body["message"], e.value.body


# ---- generation-config defaults -------------------------------------------------------------

def test_unset_fields_take_the_models_defaults(defaults_server):
    client = openai_client(defaults_server.url)
    client.chat.completions.create(model=MODEL, messages=USER_W5)
    p = last_params(defaults_server)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == \
        (0.7, 0.9, 5, 0.05, 1.1, 7)
    client.chat.completions.create(model=MODEL, messages=USER_W5, temperature=0.2, top_p=0.5, max_tokens=3,
                                   extra_body={"top_k": 3, "repetition_penalty": 1.0})
    p = last_params(defaults_server)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == \
        (0.2, 0.5, 3, 0.05, 1.0, 3)
    client.completions.create(model=MODEL, prompt="w1")
    assert (last_params(defaults_server).temperature, last_params(defaults_server).max_tokens) == (0.7, 7)


def test_without_a_generation_config_openais_defaults_apply(server, client):
    client.chat.completions.create(model=MODEL, messages=USER_W5, max_tokens=1)
    p = last_params(server)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (1.0, 1.0, 0, 0.0, 1.0)


# ---- include_stop_str_in_output -------------------------------------------------------------

def test_include_stop_str_in_output(client):
    keep = {"include_stop_str_in_output": True}
    r = client.completions.create(**G, prompt="w5", max_tokens=5, stop="w8")
    assert (r.choices[0].text, r.choices[0].finish_reason) == ("w6 w7 ", "stop")
    r = client.completions.create(**G, prompt="w5", max_tokens=5, stop="w8", extra_body=keep)
    assert (r.choices[0].text, r.choices[0].finish_reason) == ("w6 w7 w8", "stop")
    chunks = client.completions.create(**G, prompt="w5", max_tokens=5, stop="w8", stream=True, extra_body=keep)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "w6 w7 w8"
    r = client.chat.completions.create(**G, messages=USER_W5, max_tokens=5, stop=["w8"], extra_body=keep)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("w6 w7 w8", "stop")
    chunks = client.chat.completions.create(**G, messages=USER_W5, max_tokens=5, stop=["w8"], stream=True,
                                            extra_body=keep)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "w6 w7 w8"


# ---- truncate_prompt_tokens -----------------------------------------------------------------

def test_truncate_prompt_tokens_keeps_the_last_tokens(server, client):
    r = client.completions.create(**G, prompt="w1 w2 w3 w4 w9", max_tokens=2, echo=True,
                                  extra_body={"truncate_prompt_tokens": 2})
    assert (r.choices[0].text, r.usage.prompt_tokens) == ("w4 w9" + "w10 w11", 2)  # the echo: the kept tokens
    r = client.completions.create(**G, prompt=[W0 + 1, W0 + 2, W0 + 3], max_tokens=1,
                                  extra_body={"truncate_prompt_tokens": -1})  # the last max_model_len: all
    assert r.usage.prompt_tokens == 3
    # the rendered prompt's last tokens: "w5 <|im_end|> <|im_start|> assistant", then without w5 (the fake says w0)
    for k, text in ((4, "w6"), (3, "w0")):
        r = client.chat.completions.create(**G, messages=USER_W5, max_tokens=1,
                                           extra_body={"truncate_prompt_tokens": k})
        assert (r.usage.prompt_tokens, r.choices[0].message.content) == (k, text)


@pytest.mark.parametrize("k, message", [(0, "must be -1 (keep the last max_model_len tokens) or in [1, 256]"),
                                        (257, "must be -1 (keep the last max_model_len tokens) or in [1, 256]"),
                                        (-2, "greater than or equal to -1")])
def test_a_bad_truncate_prompt_tokens_is_a_400(client, k, message):
    for call in (lambda: client.completions.create(**G, prompt="w1", extra_body={"truncate_prompt_tokens": k}),
                 lambda: client.chat.completions.create(**G, messages=USER_W5,
                                                        extra_body={"truncate_prompt_tokens": k})):
        bad_request(call, "truncate_prompt_tokens", message)


# ---- continue_final_message, add_generation_prompt ------------------------------------------

def test_continue_final_message(client):
    convo = [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w5"}]
    r = client.chat.completions.create(**G, messages=convo, max_tokens=2,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False})
    # "<|im_start|> user w1 <|im_end|> <|im_start|> assistant w5": the assistant's turn stays open
    assert (r.choices[0].message.content, r.usage.prompt_tokens) == ("w6 w7", 7)
    bad_request(lambda: client.chat.completions.create(**G, messages=convo,
                                                       extra_body={"continue_final_message": True}),
                "continue_final_message", "continue_final_message and add_generation_prompt cannot both be true")
    bad_request(lambda: client.chat.completions.create(
        **G, messages=USER_W5, extra_body={"continue_final_message": True, "add_generation_prompt": False}),
        "continue_final_message", "needs the last message to be an assistant message")


def test_add_generation_prompt_false(client):
    r = client.chat.completions.create(**G, messages=USER_W5, max_tokens=1, extra_body={"add_generation_prompt": False})
    assert (r.choices[0].message.content, r.usage.prompt_tokens) == ("w6", 4)  # no "<|im_start|> assistant"


# ---- return_tokens_as_token_ids -------------------------------------------------------------

def test_return_tokens_as_token_ids(client):
    ids = {"return_tokens_as_token_ids": True}
    r = client.completions.create(**G, prompt="w5", max_tokens=2, logprobs=2, extra_body=ids)
    lp = r.choices[0].logprobs
    assert lp.tokens == [f"token_id:{W0 + 6}", f"token_id:{W0 + 7}"] and r.choices[0].text == "w6 w7"
    assert lp.top_logprobs[0] == {f"token_id:{W0 + 6}": -0.5, f"token_id:{W0 + 7}": -1.0}
    assert lp.text_offset == [0, 2]  # offsets into the text, as without the option
    r = client.chat.completions.create(**G, messages=USER_W5, max_tokens=1, logprobs=True, top_logprobs=2,
                                       extra_body=ids)
    token = r.choices[0].logprobs.content[0]
    assert (token.token, token.bytes) == (f"token_id:{W0 + 6}", list(f"token_id:{W0 + 6}".encode()))
    assert [t.token for t in token.top_logprobs] == [f"token_id:{W0 + 6}", f"token_id:{W0 + 7}"]
    chunks = client.chat.completions.create(**G, messages=USER_W5, max_tokens=1, logprobs=True, stream=True,
                                            extra_body=ids)
    assert [c.choices[0].logprobs.content[0].token for c in chunks if c.choices and c.choices[0].logprobs] == \
        [f"token_id:{W0 + 6}"]


# ---- chat_template_kwargs, --chat-template --------------------------------------------------

def test_the_servers_chat_template_and_its_kwargs(template_server):
    client = openai_client(template_server.url)
    r = client.chat.completions.create(**G, messages=USER_W5, max_tokens=2)
    assert (r.choices[0].message.content, r.usage.prompt_tokens) == ("w6 w7", 1)  # "w5 ": the server's template
    r = client.chat.completions.create(**G, messages=USER_W5, max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"start": "w40"}})
    assert (r.choices[0].message.content, r.usage.prompt_tokens) == ("w41 w42", 2)  # "w5 w40"
    tokens = httpx.post(template_server.url + "/tokenize",
                        json={"messages": USER_W5, "chat_template_kwargs": {"start": "w40"}}).json()["tokens"]
    assert tokens == [W0 + 5, W0 + 40]


@pytest.mark.parametrize("kwargs, message", [
    ({"add_generation_prompt": False}, "chat_template_kwargs may not set add_generation_prompt"),
    ({"bad key": 1}, "chat_template_kwargs"),
    ({f"k{i}": i for i in range(65)}, "at most 64 entries are allowed"),
])
def test_bad_chat_template_kwargs_are_a_400(client, kwargs, message):
    bad_request(lambda: client.chat.completions.create(**G, messages=USER_W5,
                                                       extra_body={"chat_template_kwargs": kwargs}),
                "chat_template_kwargs", message)


def test_chat_template_flag(tmp_path, capsys):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    parser = build_parser()
    args = parser.parse_args(["serve", "--chat-template", str(path)])
    check_arguments(args)
    assert args.chat_template == TEMPLATE  # read once at start: the server gets the text
    args = parser.parse_args(["serve", "--chat-template", TEMPLATE])  # inline
    check_arguments(args)
    assert args.chat_template == TEMPLATE
    for bad, message in ((str(tmp_path / "missing.jinja"), "is neither a file nor a Jinja template"),
                         ("{% for %}", "is not a valid Jinja template")):
        with pytest.raises(SystemExit) as e:
            check_arguments(parser.parse_args(["serve", "--chat-template", bad]))
        assert e.value.code == 2 and "error: --chat-template: " in capsys.readouterr().err
