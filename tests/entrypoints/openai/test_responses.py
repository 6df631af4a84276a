"""/v1/responses through the official openai client, on scripted byte-level outputs (a server
with --reasoning-parser qwen3): text and message-item inputs, instructions, a function-call
round trip, the streaming events (and that they add up to the non-streamed response),
structured output, max_output_tokens -> incomplete, reasoning items, and the 400s."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from .conftest import MODEL, openai_client, running_server
from .test_tool_calls import CALL_PARIS, CALL_TIME, WEATHER, ScriptedEngine

TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather of a city", "parameters": WEATHER,
          "strict": False},
         {"type": "function", "name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}, "strict": None}]


@pytest.fixture(scope="module")
def server():
    with running_server(ScriptedEngine(), reasoning_parser="qwen3") as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai_client(server.url)


def shape(output) -> list[tuple]:
    """The output items without their generated ids."""
    out = []
    for item in output:
        if item.type == "message":
            out.append(("message", item.status, [(p.type, p.text) for p in item.content]))
        elif item.type == "reasoning":
            out.append(("reasoning", item.status, [c.text for c in item.content]))
        else:
            out.append((item.type, item.status, item.name, item.arguments))
    return out


def test_text_input(server, client):
    server.engine.script = "Paris."
    r = client.responses.create(model=MODEL, input="Capital of France?", instructions="Answer in one word.",
                                temperature=0.0, top_p=0.5)
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    assert r.output_text == "Paris." and shape(r.output) == [("message", "completed", [("output_text", "Paris.")])]
    assert r.output[0].id.startswith("msg_") and r.output[0].role == "assistant"
    assert (r.model, r.instructions, r.temperature, r.top_p, r.incomplete_details) == \
           (MODEL, "Answer in one word.", 0.0, 0.5, None)
    prompt = server.engine.last_prompt()
    assert "<|im_start|>system\nAnswer in one word.<|im_end|>\n<|im_start|>user\nCapital of France?" in prompt
    params = server.engine.params[server.engine.added[-1]]
    assert (params.temperature, params.top_p) == (0.0, 0.5)
    u = r.usage
    assert (u.input_tokens, u.output_tokens) == (len(server.engine.prompts[server.engine.added[-1]]), len("Paris.") + 1)
    assert u.total_tokens == u.input_tokens + u.output_tokens and u.output_tokens_details.reasoning_tokens == 0


def test_message_items(server, client):
    server.engine.script = "ok"
    items = [{"role": "developer", "content": "Be terse."},
             {"role": "user", "content": [{"type": "input_text", "text": "Say "}, {"type": "input_text", "text": "hi"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hi",
                                                                   "annotations": []}]},
             {"role": "user", "content": "again"}]
    r = client.responses.create(model=MODEL, input=items, store=True)  # store: accepted, nothing stored
    assert r.output_text == "ok"
    prompt = server.engine.last_prompt()
    assert ("system\nBe terse.<|im_end|>\n<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\nhi<|im_end|>"
            "\n<|im_start|>user\nagain<|im_end|>") in prompt


def test_function_call_round_trip(server, client):
    server.engine.script = "Checking.\n" + CALL_PARIS + "\n" + CALL_TIME
    ask = [{"role": "user", "content": "Weather in Paris, and the time?"}]
    r = client.responses.create(model=MODEL, input=ask, tools=TOOLS)
    assert shape(r.output) == [("message", "completed", [("output_text", "Checking.")]),
                               ("function_call", "completed", "get_weather", '{"city": "Paris"}'),
                               ("function_call", "completed", "get_time", '{"tz": "CET"}')]
    calls = r.output[1:]
    assert all(c.call_id.startswith("call_") and c.id.startswith("fc_") for c in calls)
    assert [t.name for t in r.tools] == ["get_weather", "get_time"] and r.tool_choice == "auto"
    # the outputs fed back, with the earlier response's items as they came
    server.engine.script = "Sunny, 21 C, and it is noon."
    follow = ask + [item.model_dump(exclude_none=True) for item in r.output] + [
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"},
        {"type": "function_call_output", "call_id": calls[1].call_id,
         "output": [{"type": "input_text", "text": "12:00"}]}]
    r2 = client.responses.create(model=MODEL, input=follow, tools=TOOLS)
    assert r2.output_text == "Sunny, 21 C, and it is noon."
    prompt = server.engine.last_prompt()
    assert ('<|im_start|>assistant\nChecking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call><|im_end|>\n'
            '<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response>\n<tool_response>\n12:00\n'
            '</tool_response><|im_end|>') in prompt


def test_named_tool_choice(server, client):
    server.engine.script = '{"tz": "UTC"}'
    r = client.responses.create(model=MODEL, input="time?", tools=TOOLS,
                                tool_choice={"type": "function", "name": "get_time"})
    assert shape(r.output) == [("function_call", "completed", "get_time", '{"tz": "UTC"}')]
    assert server.engine.last_constraint().json["properties"] == {"tz": {"type": "string"}}
    assert r.tool_choice.name == "get_time"


EXPECTED_EVENTS = [
    "response.created", "response.in_progress",
    "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
    "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
    "response.output_item.added", "response.content_part.added", "response.output_text.delta",
    "response.output_text.done", "response.content_part.done", "response.output_item.done",
    "response.output_item.added", "response.function_call_arguments.delta",
    "response.function_call_arguments.done", "response.output_item.done", "response.completed"]


def dedup(kinds: list[str]) -> list[str]:
    return [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]


def test_streaming_events_add_up(server, client):
    script = "<think>They want the weather.</think>\n\nLet me look.\n" + CALL_PARIS
    server.engine.script = script
    whole = client.responses.create(model=MODEL, input="Weather?", tools=TOOLS)
    events = list(client.responses.create(model=MODEL, input="Weather?", tools=TOOLS, stream=True))
    assert dedup([e.type for e in events]) == EXPECTED_EVENTS
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert shape(final.output) == shape(whole.output) == [
        ("reasoning", "completed", ["They want the weather."]),
        ("message", "completed", [("output_text", "Let me look.")]),
        ("function_call", "completed", "get_weather", '{"city": "Paris"}')]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "They want the weather."
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Let me look."
    added = [e.item.id for e in events if e.type == "response.output_item.added"]
    assert added == [e.item.id for e in events if e.type == "response.output_item.done"] == [i.id for i in final.output]
    assert final.usage.output_tokens == whole.usage.output_tokens and final.status == "completed"
    # the SDK's stream helper accumulates the same
    with client.responses.stream(model=MODEL, input="Weather?", tools=TOOLS) as stream:
        kinds = [e.type for e in stream]
        helper = stream.get_final_response()
    assert dedup(kinds) == EXPECTED_EVENTS and shape(helper.output) == shape(whole.output)


def test_reasoning_items(server, client):
    server.engine.script = "<think>\nThe user greets me.\n</think>\n\nHello!"
    r = client.responses.create(model=MODEL, input="Hi")
    assert shape(r.output) == [("reasoning", "completed", ["The user greets me."]),
                               ("message", "completed", [("output_text", "Hello!")])]
    assert r.output[0].id.startswith("rs_") and r.output[0].summary == []
    assert r.usage.output_tokens_details.reasoning_tokens == len("The user greets me.")  # one token per byte
    # a reasoning item fed back is accepted (and left out of the prompt)
    server.engine.script = "Bye."
    r2 = client.responses.create(model=MODEL, input=[{"role": "user", "content": "Hi"}] +
                                 [item.model_dump(exclude_none=True) for item in r.output] +
                                 [{"role": "user", "content": "Bye"}])
    assert r2.output_text == "Bye." and "greets" not in server.engine.last_prompt()


class City(BaseModel):
    city: str
    population: int


def test_structured_output(server, client):
    server.engine.script = '{"city": "Paris", "population": 2100000}'
    r = client.responses.parse(model=MODEL, input="The biggest French city?", text_format=City)
    assert r.output_parsed == City(city="Paris", population=2100000)
    schema = server.engine.last_constraint().json
    jsonschema.validate(json.loads(r.output_text), schema)
    assert schema["properties"]["population"] == {"title": "Population", "type": "integer"}
    assert r.text.format.type == "json_schema" and r.text.format.name == "City"
    server.engine.script = '{"a": [1, 2]}'
    r = client.responses.create(model=MODEL, input="JSON please", text={"format": {"type": "json_object"}},
                                tools=TOOLS, tool_choice="none")
    assert json.loads(r.output_text) == {"a": [1, 2]} and server.engine.last_constraint().json_object


def test_max_output_tokens_incomplete(server, client):
    server.engine.script = "A long answer that does not fit."
    r = client.responses.create(model=MODEL, input="Talk", max_output_tokens=6)
    assert (r.status, r.incomplete_details.reason, r.output_text) == ("incomplete", "max_output_tokens", "A long")
    assert r.output[0].status == "incomplete" and r.usage.output_tokens == 6 and r.max_output_tokens == 6
    events = list(client.responses.create(model=MODEL, input="Talk", max_output_tokens=6, stream=True))
    assert events[-1].type == "response.incomplete" and shape(events[-1].response.output) == shape(r.output)
    # cut while thinking: only the reasoning, incomplete
    server.engine.script = "<think>Let me think about it"
    r = client.responses.create(model=MODEL, input="Talk", max_output_tokens=12)
    assert shape(r.output) == [("reasoning", "incomplete", ["Let m"])] and r.status == "incomplete"


@pytest.mark.parametrize("body, param, words", [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "`previous_response_id` is not supported"),
    ({"conversation": "conv_1"}, "conversation", "`conversation` is not supported"),
    ({"background": True}, "background", "background"),
    ({"tools": [{"type": "web_search"}]}, "tools", "built-in tool 'web_search'"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools", "file_search"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", "not supported"),
    ({"tool_choice": "required"}, "tool_choice", "needs `tools`"),
    ({"include": ["file_search_call.results"]}, "include[0]", "not supported"),
    ({"reasoning": {"effort": "high"}}, "reasoning", "not supported"),
    ({"truncation": "auto"}, "truncation", "not supported"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "item_reference"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, "input[0].call_id", "call_x"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, "input[0].arguments",
     "JSON text of an object"),
    ({"max_output_tokens": 100000}, "max_output_tokens", "`max_output_tokens`"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}}}, "text.format",
     "invalid `text.format`"),
    ({"frequency_penalty": 1.0}, "frequency_penalty", "Unsupported field"),
])
def test_unsupported_is_400(server, body, param, words):
    r = httpx.post(server.url + "/v1/responses", json={"model": MODEL, "input": "hi", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_stored_responses_are_a_clear_404(server):
    for method, path in [("GET", "/v1/responses/resp_1"), ("DELETE", "/v1/responses/resp_1"),
                         ("POST", "/v1/responses/resp_1/cancel"), ("GET", "/v1/responses/resp_1/input_items")]:
        r = httpx.request(method, server.url + path)
        assert r.status_code == 404, (method, path, r.text)
        assert "this server stores no responses" in r.json()["error"]["message"]


def test_an_image_input_says_the_server_is_text_only(server):
    item = {"role": "user", "content": [{"type": "input_image", "image_url": "https://example.com/a.png"}]}
    r = httpx.post(server.url + "/v1/responses", json={"model": MODEL, "input": [item]})
    assert r.status_code == 400 and "text-only models: no input_image" in r.json()["error"]["message"], r.text


def test_400_through_the_client(client):
    with pytest.raises(openai.BadRequestError, match="previous_response_id` is not supported"):
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_123")
    with pytest.raises(openai.BadRequestError, match="input"):
        client.responses.create(model=MODEL)


def test_openapi_lists_the_route(server):
    spec = httpx.get(server.url + "/openapi.json").json()
    assert "/v1/responses" in spec["paths"] and "ResponsesRequest" in spec["components"]["schemas"]


def test_engine_failure_mid_stream_ends_with_failed():
    """An engine that dies: a streamed response ends with `error` and `response.failed`
    (the exception's text stays in the server log); a non-streamed one is a 503."""
    with running_server(ScriptedEngine()) as s:
        s.engine.script = "never"
        s.engine.fail_next_step = True
        r = httpx.post(s.url + "/v1/responses", json={"input": "hi", "stream": True})
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
        assert [e["type"] for e in events] == ["response.created", "response.in_progress", "error", "response.failed"]
        assert events[-1]["response"]["status"] == "failed" and "injected" not in r.text
        assert [e["sequence_number"] for e in events] == [0, 1, 2, 3]
        assert httpx.post(s.url + "/v1/responses", json={"input": "hi"}).status_code == 503
