"""The API-parity features over real uvicorn and the real engine, driven by the openai client:
a tiny random Llama with a byte-level BPE tokenizer and a Qwen2.5-style chat template, where
the numbers come from transformers and the outputs are checked by jsonschema."""
import json
import shutil

import jsonschema
import numpy as np
import pytest
import torch

from tiny_models import make_tokenizer

from .conftest import metric, openai_client, running_server
from .test_tool_calls import QWEN_TEMPLATE

NUM_BLOCKS = 96
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"utc": {"type": "boolean"}},
                                       "required": ["utc"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def model(tiny_checkpoints, tmp_path_factory):
    src, hf_model = tiny_checkpoints("llama")
    path = tmp_path_factory.mktemp("tiny-llama-chat")
    shutil.copytree(src, path, dirs_exist_ok=True)
    tok = make_tokenizer(384)
    tok.chat_template = QWEN_TEMPLATE
    tok.save_pretrained(str(path))
    return path, hf_model


@pytest.fixture(scope="module")
def server(model):
    from pagedjax.engine.llm_engine import LLMEngine

    engine = LLMEngine(str(model[0]), max_model_len=512, max_num_seqs=4, num_blocks=NUM_BLOCKS, block_size=8,
                       max_num_batched_tokens=128)
    with running_server(engine) as s:
        s.client = openai_client(s.url).with_options(timeout=300)
        yield s


def _hf_logprobs(hf_model, ids):
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].double(), -1).numpy()


def test_echo_and_logprobs_score_a_prompt_like_transformers(server, model):
    ids = np.random.default_rng(0).integers(2, 384, 40).tolist()
    r = server.client.completions.create(model="fake-model", prompt=ids, max_tokens=0, echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    ref = _hf_logprobs(model[1], ids)
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids)
    assert lp.token_logprobs[1:] == pytest.approx([ref[i - 1, t] for i, t in enumerate(ids) if i], abs=2e-4)
    assert r.usage.completion_tokens == 0 and r.choices[0].finish_reason == "length"
    # echo with generation: the prompt's logprobs, then the generated tokens' logprobs
    r = server.client.completions.create(model="fake-model", prompt=ids, max_tokens=3, echo=True, logprobs=1,
                                         temperature=0)
    assert len(r.choices[0].logprobs.token_logprobs) == len(ids) + 3
    assert r.choices[0].logprobs.token_logprobs[1:len(ids)] == pytest.approx(
        [ref[i - 1, t] for i, t in enumerate(ids) if i], abs=2e-4)
    assert metric(server.url, "pagedjax:kv_blocks_free") == NUM_BLOCKS


def test_json_schema_response_format_streaming_and_n2(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    msgs = [{"role": "user", "content": "Describe a person as JSON."}]
    r = server.client.chat.completions.create(model="fake-model", messages=msgs, max_tokens=150, n=2,
                                              temperature=1.0, seed=5, response_format=fmt)
    for c in r.choices:
        jsonschema.validate(json.loads(c.message.content), PERSON)
    stream = server.client.chat.completions.create(model="fake-model", messages=msgs, max_tokens=150, n=2,
                                                   temperature=1.0, seed=5, response_format=fmt, stream=True)
    texts = ["", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in r.choices]  # seeded: streaming gives the same outputs
    r = server.client.completions.create(model="fake-model", prompt="Pick:", max_tokens=20,
                                         extra_body={"structured_outputs": {"choice": ["red", "green"]}})
    assert r.choices[0].text in ("red", "green")
    r = server.client.completions.create(model="fake-model", prompt="Code:", max_tokens=20,
                                         extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{4}"}})
    assert len(r.choices[0].text) == 7 and r.choices[0].text[2] == "-"
    assert metric(server.url, "pagedjax:kv_blocks_free") == NUM_BLOCKS


@pytest.fixture(scope="module")
def default_server(default_model_path):
    """The embedded default model (its template has no tool support: the server describes the
    tools in the system message); the tiny tokenizer makes tool prompts too long for 512 positions."""
    from pagedjax.engine.llm_engine import LLMEngine

    engine = LLMEngine(None, max_model_len=1024, max_num_seqs=2, num_blocks=128)
    with running_server(engine) as s:
        s.client = openai_client(s.url).with_options(timeout=600)
        yield s


def test_required_and_named_tool_calls_parse_and_validate(default_server):
    server = default_server
    msgs = [{"role": "user", "content": "Weather in Paris for 3 days, and the time?"}]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    r = server.client.chat.completions.create(model="fake-model", messages=msgs, tools=[WEATHER, TIME],
                                              tool_choice="required", max_tokens=200, temperature=0)
    calls = r.choices[0].message.tool_calls
    assert calls and r.choices[0].finish_reason == "tool_calls"
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    named = {"type": "function", "function": {"name": "get_time"}}
    r = server.client.chat.completions.create(model="fake-model", messages=msgs, tools=[WEATHER, TIME],
                                              tool_choice=named, max_tokens=60, temperature=0)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), schemas["get_time"])
    # the call and its result go back on the next turn
    follow = msgs + [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
    r2 = server.client.chat.completions.create(model="fake-model", messages=follow, tools=[WEATHER, TIME],
                                               max_tokens=5, temperature=0)
    assert r2.choices[0].finish_reason in ("length", "stop", "tool_calls")
    assert metric(server.url, "pagedjax:kv_blocks_free") == 128


def test_required_and_named_without_max_tokens_end_with_their_calls(default_server):
    """Issue 34: docs/design/server.md's tool example (tool_choice "required", no max_tokens)
    ran to the context limit on the default model; the bounded grammar ends it with its calls,
    whose arguments hold only the schema's keys. The same for a response_format schema."""
    client = default_server.client
    msgs = [{"role": "user", "content": "Give me a JSON object with a name."}]
    params = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for extra, reason in (({"tool_choice": "required"}, "tool_calls"),
                          ({"tool_choice": "required", "parallel_tool_calls": False}, "tool_calls"),
                          ({"tool_choice": named}, "stop")):
        r = client.chat.completions.create(model="fake-model", messages=msgs, tools=tools, temperature=0, **extra)
        c = r.choices[0]
        assert (c.finish_reason, c.message.content) == (reason, None), extra
        assert 0 < r.usage.completion_tokens < 128, extra
        assert c.message.tool_calls and len(c.message.tool_calls) <= (1 if extra != {"tool_choice": "required"} else 8)
        for call in c.message.tool_calls:
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), {**params, "additionalProperties": False})
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}}, "required": ["name"]}
    r = client.chat.completions.create(model="fake-model", messages=msgs, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens < 128
    jsonschema.validate(json.loads(r.choices[0].message.content), {**schema, "additionalProperties": False})
    assert metric(default_server.url, "pagedjax:kv_blocks_free") == 128


def test_penalties_over_http_equal_the_python_api(server, model):
    from pagedjax import LLM, SamplingParams

    ids = np.random.default_rng(1).integers(2, 384, 12).tolist()
    fields = dict(presence_penalty=1.2, frequency_penalty=0.7, logit_bias={"9": 4.0})
    extra = dict(repetition_penalty=1.3, min_tokens=3, ignore_eos=True)
    r = server.client.completions.create(model="fake-model", prompt=ids, max_tokens=10, temperature=0, logprobs=0,
                                         extra_body=extra, **fields)
    llm = LLM(str(model[0]), max_model_len=512, max_num_seqs=4, num_blocks=32, block_size=8, warmup=False)
    want = llm.generate([ids], SamplingParams(max_tokens=10, presence_penalty=1.2, frequency_penalty=0.7,
                                              logit_bias={9: 4.0}, **extra), use_tqdm=False)[0].outputs[0]
    plain = llm.generate([ids], SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert r.choices[0].logprobs.tokens == [llm.tokenizer.decode([t]) for t in want.token_ids]
    assert want.token_ids != plain.token_ids


def test_speculative_decoding_over_http(model):
    """Prompt-lookup speculation behind the server: several tokens arrive in one chunk, the
    text equals plain greedy decoding, and /metrics counts the drafts."""
    from pagedjax import LLM, SamplingParams
    from pagedjax.engine.llm_engine import LLMEngine

    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    kw = dict(max_model_len=512, max_num_seqs=4, num_blocks=64, block_size=8, max_num_batched_tokens=64)
    ids = np.random.default_rng(2).integers(2, 384, 9).tolist() * 4
    with running_server(LLMEngine(str(model[0]), speculative_config=spec, **kw)) as s:
        client = openai_client(s.url).with_options(timeout=300)
        r = client.completions.create(model="fake-model", prompt=ids, max_tokens=30, temperature=0, logprobs=0,
                                      extra_body={"ignore_eos": True})
        stream = client.completions.create(model="fake-model", prompt=ids, max_tokens=30, temperature=0,
                                           stream=True, logprobs=0, extra_body={"ignore_eos": True})
        per_chunk = [len(c.choices[0].logprobs.tokens) for c in stream if c.choices and c.choices[0].logprobs]
        assert sum(per_chunk) == 30 and max(per_chunk) > 1  # accepted drafts arrive together
        assert metric(s.url, "pagedjax:spec_accepted_tokens_total") > 0
        assert metric(s.url, "pagedjax:kv_blocks_free") == 64
    plain = LLM(str(model[0]), warmup=False, **kw)
    want = plain.generate([ids], SamplingParams(max_tokens=30, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert r.choices[0].logprobs.tokens == [plain.tokenizer.decode([t]) for t in want.token_ids]
