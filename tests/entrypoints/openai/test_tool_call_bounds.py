"""Issue 34: tool_choice "required" / a named function must end on its own. The grammar of the
calls is bounded (compact JSON, the array closes by MAX_PARALLEL_CALLS, one call without
parallel calls, no invented or repeated keys, only EOS after the JSON), and a call cut by
max_tokens is reported as a cut call (finish_reason "length"), never as raw JSON content."""
from __future__ import annotations

import json

import numpy as np
import pytest

from pagedjax.entrypoints.openai.tool_calls import MAX_PARALLEL_CALLS, named_schema, required_schema
from pagedjax.sampling_params import StructuredOutputsParams
from pagedjax.structured_output.grammar import bitmask_words

from .conftest import openai_client, running_server
from .fake_engine import EOS
from .test_tool_calls import TOOLS, WEATHER, ScriptedEngine, accepts, ask, calls, same


@pytest.fixture(scope="module")
def tserver():
    with running_server(ScriptedEngine()) as s:
        yield s


@pytest.fixture
def tclient(tserver):
    return openai_client(tserver.url)


def call(name: str, args: dict) -> dict:
    return {"name": name, "parameters": args}


PARIS = call("get_weather", {"city": "Paris"})
UTC = call("get_time", {"tz": "UTC"})


def only_eos_after(engine: ScriptedEngine, spec: StructuredOutputsParams, text: str) -> bool:
    """Whether, once `text` is in, the grammar allows nothing but EOS."""
    m = engine.grammar_compiler.matcher(spec)
    assert all(m.accept(t) for t in engine.tokenizer.encode(text, add_special_tokens=False)), m.error
    mask = np.zeros(bitmask_words(len(engine.tokenizer)), np.int32)
    m.fill_bitmask(mask)
    return np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")).tolist() == [EOS]


def test_required_array_is_bounded(tserver):
    engine = tserver.engine
    many = StructuredOutputsParams(json=required_schema(TOOLS, True))
    assert accepts(engine, many, json.dumps([PARIS, UTC]))
    assert accepts(engine, many, json.dumps([PARIS] * MAX_PARALLEL_CALLS))
    assert not accepts(engine, many, json.dumps([PARIS] * (MAX_PARALLEL_CALLS + 1)))  # the array must close
    one = StructuredOutputsParams(json=required_schema(TOOLS, False))
    assert accepts(engine, one, json.dumps([UTC]))
    assert not accepts(engine, one, json.dumps([UTC, PARIS]))  # parallel_tool_calls false: exactly one call
    assert not accepts(engine, one, json.dumps([UTC, UTC]))
    assert not accepts(engine, one, "[]")
    for spec, text in ((many, json.dumps([PARIS, UTC])), (one, json.dumps([UTC]))):
        assert only_eos_after(engine, spec, text)  # the model can end, and nothing but end, after "]"


@pytest.mark.parametrize("text", [
    '[{"name": "get_time",  "parameters": {"tz": "UTC"}}]',  # two blanks
    '[\n  {"name": "get_time", "parameters": {"tz": "UTC"}}\n]',  # layout
    '[{"name": "get_time", "parameters": {"tz": "UTC"}} ]',
    '[{"name":"get_time","parameters":{"tz":"UTC"}}]',  # one style only: json.dumps'
    '[{"name": "get_time", "parameters": {"tz": "UTC", "city": "Paris"}}]',  # a key get_time lacks
    '[{"name": "get_time", "parameters": {"tz": "UTC", "tz": "CET"}}]',  # a key twice
    '[{"name": "get_time", "parameters": {"tz": "UTC", "x": 1, "x": 2}}]',  # an invented key, twice
    '[{"name": "get_weather", "parameters": {"city": "Paris", "type": "string"}}]',  # what SmolLM2 wrote
])
def test_required_calls_are_compact_and_closed(tserver, text):
    assert not accepts(tserver.engine, StructuredOutputsParams(json=required_schema(TOOLS, True)), text)


def test_named_arguments_are_compact_and_closed(tserver):
    engine = tserver.engine
    spec = StructuredOutputsParams(json=named_schema(WEATHER))
    assert accepts(engine, spec, '{"city": "Paris", "unit": "c"}')
    assert only_eos_after(engine, spec, '{"city": "Paris"}')
    for text in ('{"city": "Paris", "type": "string"}', '{"city": "Paris", "city": "Rome"}',
                 '{"city": "Paris", "x": 1, "x": 2}', '{"city":  "Paris"}', '{\n"city": "Paris"}'):
        assert not accepts(engine, spec, text), text
    # a schema's own layout options win; no parameters: exactly {}
    own = StructuredOutputsParams(json=named_schema({**WEATHER, "x-guidance": {"whitespace_flexible": True}}))
    assert accepts(engine, own, '{\n  "city": "Paris"\n}')
    empty = StructuredOutputsParams(json=named_schema(None))
    assert accepts(engine, empty, "{}") and not accepts(engine, empty, '{"a": 1}')


def test_required_cut_in_a_call_reports_the_cut_call(tserver, tclient):
    text = json.dumps([PARIS, call("get_time", {"tz": "Europe/Paris"})])
    cut = text.index("Europe/") + len("Europe/")
    r, s, _ = ask(tserver, tclient, text, tool_choice="required", max_tokens=cut)  # one token a byte
    c = r.choices[0]
    assert (c.message.content, c.finish_reason) == (None, "length")  # no raw JSON as content
    assert [(t.function.name, t.function.arguments) for t in c.message.tool_calls] == [
        ("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "Europe/')]
    same(r, s)
    # cut in the first call's arguments: that call, as far as it got
    r, s, _ = ask(tserver, tclient, text, tool_choice="required", max_tokens=len('[{"name": "get_weather", "param'
                                                                                  'eters": {"ci'))
    c = r.choices[0]
    assert (c.message.content, c.finish_reason) == (None, "length")
    assert [(t.function.name, t.function.arguments) for t in c.message.tool_calls] == [("get_weather", '{"ci')]
    same(r, s)


@pytest.mark.parametrize("cut", [1, len('[{"name": "get_wea'), len('[{"name": "get_weather", "par')])
def test_required_cut_before_a_name_is_complete_is_empty(tserver, tclient, cut):
    r, s, _ = ask(tserver, tclient, json.dumps([PARIS]), tool_choice="required", max_tokens=cut)
    c = r.choices[0]
    assert (c.message.content, c.message.tool_calls, c.finish_reason) == (None, None, "length")
    same(r, s)


def test_required_parallel_false_cut_keeps_one_call(tserver, tclient):
    # an engine that wrote past the one call allowed and was cut: the first call only, no content
    text = json.dumps([PARIS, UTC])
    r, s, _ = ask(tserver, tclient, text, tool_choice="required", parallel_tool_calls=False,
                  max_tokens=len(text) - 6)
    c = r.choices[0]
    assert (calls(c.message), c.message.content, c.finish_reason) == ([("get_weather", {"city": "Paris"})], None,
                                                                      "length")
    same(r, s)
