"""--reasoning-parser: the split of `<think>` text (streamed = whole, for every cut of the text),
and on /v1/chat/completions (scripted byte-level outputs, so tags split across tokens and
deltas): reasoning_content and content, each parser's table, cut outputs, tool calls after
and inside the reasoning, constrained outputs, and no change when off."""
from __future__ import annotations

import argparse
import json

import httpx
import pytest

from pagedjax.entrypoints.openai.api_server import add_serve_arguments
from pagedjax.entrypoints.openai.reasoning import REASONING_PARSERS, ReasoningParser

from .conftest import MODEL, openai_client, running_server
from .test_tool_calls import CALL_PARIS, QWEN_TEMPLATE, TOOLS, ScriptedEngine

# DeepSeek-R1 style: the generation prompt opens the thinking
OPENING_TEMPLATE = QWEN_TEMPLATE.replace("'<|im_start|>assistant\\n' }}{%- endif %}",
                                         "'<|im_start|>assistant\\n<think>\\n' }}{%- endif %}")
assert OPENING_TEMPLATE != QWEN_TEMPLATE

TEXTS = ["<think>\nI should greet.\n</think>\n\nHello!", "  <think>a</think>b", "Plain <think> answer.",
         "Cut <thi", "<think>still thinking", "</think>only an end", "<think>x</think>", "<thin", "", "\n\n",
         "<think></think>\n\nJust content.", "<think>a\n\n</th></think>  b </think> c"]


@pytest.mark.parametrize("name", REASONING_PARSERS)
@pytest.mark.parametrize("in_reasoning", [False, True])
def test_stream_equals_whole_at_every_cut(name, in_reasoning):
    parser = ReasoningParser(name)
    for text in TEXTS:
        whole = parser.split(text, in_reasoning)
        for cut in range(len(text) + 1):
            for cut2 in (cut, min(cut + 3, len(text))):
                s = parser.stream(in_reasoning)
                parts = [s.feed(text[:cut]), s.feed(text[cut:cut2]), s.feed(text[cut2:], final=True)]
                reasoning = "".join(p[0] for p in parts)
                content = "".join(p[1] for p in parts)
                assert (reasoning or None, content) == whole, (text, cut, cut2)


def test_split_table():
    qwen, r1 = ReasoningParser("qwen3"), ReasoningParser("deepseek_r1")
    assert qwen.split("<think>\nR\n</think>\n\nC", False) == ("R", "C")
    assert qwen.split("R</think>C", False) == (None, "R</think>C")  # the prompt opened nothing
    assert qwen.split("R</think>C", True) == ("R", "C")  # it did
    assert qwen.split("<think>R, cut", False) == ("R, cut", "")
    assert qwen.split(" plain <think>x</think>", False) == (None, " plain <think>x</think>")  # only a leading tag opens
    assert r1.split("R</think>C", False) == ("R", "C")
    assert r1.split("<think>R</think>C", False) == ("R", "C")
    assert r1.split("all reasoning", False) == ("all reasoning", "")  # never closed: all of it is reasoning
    assert r1.split("R</think>C</think>D", False) == ("R", "C</think>D")
    assert qwen.starts_in_reasoning("<|im_start|>assistant\n<think>\n")
    assert not qwen.starts_in_reasoning("<think>\n\n</think>\n\n") and not qwen.starts_in_reasoning("assistant\n")
    assert r1.starts_in_reasoning("assistant\n")
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        ReasoningParser("r2")


def test_flag_choices(capsys):
    parser = add_serve_arguments(argparse.ArgumentParser(prog="serve"))
    assert parser.parse_args([]).reasoning_parser is None
    assert parser.parse_args(["--reasoning-parser", "qwen3"]).reasoning_parser == "qwen3"
    with pytest.raises(SystemExit):
        parser.parse_args(["--reasoning-parser", "gpt"])
    assert "'deepseek_r1', 'qwen3'" in capsys.readouterr().err


# ---- on the server ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def servers():
    """qwen3 (Qwen's template, and one that opens <think>), deepseek_r1 (a template that opens
    <think>), and off."""
    with running_server(ScriptedEngine(piece=1), reasoning_parser="qwen3") as qwen, \
            running_server(ScriptedEngine(OPENING_TEMPLATE, piece=2), reasoning_parser="qwen3") as qwen_open, \
            running_server(ScriptedEngine(OPENING_TEMPLATE, piece=2), reasoning_parser="deepseek_r1") as r1, \
            running_server(ScriptedEngine(piece=1)) as off:
        yield {"qwen3": qwen, "qwen3_open": qwen_open, "deepseek_r1": r1, "off": off}


ASK = [{"role": "user", "content": "Hi"}]


def chat(server, script, stream=False, **kw):
    """The message (non-streamed) or (reasoning, content, tool-call deltas, finish_reason, raw deltas)."""
    server.engine.script = script
    client = openai_client(server.url)
    kw = {"model": MODEL, "messages": ASK, **kw}
    if not stream:
        return client.chat.completions.create(**kw).choices[0]
    reasoning, content, calls, reason, deltas = "", "", [], None, []
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            d = ch.delta.model_dump(exclude_none=True)
            deltas.append(d)
            reasoning += d.get("reasoning_content", "")
            content += d.get("content", "")
            calls += d.get("tool_calls", [])
            reason = ch.finish_reason or reason
    return reasoning, content, calls, reason, deltas


THINK = "<think>\nThe user says hi.\n</think>\n\nHello there!"


@pytest.mark.parametrize("kind", ["qwen3", "off"])
def test_chat_reasoning_and_off(servers, kind):
    c = chat(servers[kind], THINK)
    body = c.message.model_dump()
    if kind == "off":  # no change: the text is the content, and no reasoning_content key at all
        assert c.message.content == THINK and "reasoning_content" not in body
        return
    assert (body["reasoning_content"], c.message.content, c.finish_reason) == ("The user says hi.", "Hello there!", "stop")
    reasoning, content, _, reason, deltas = chat(servers[kind], THINK, stream=True)
    assert (reasoning, content, reason) == ("The user says hi.", "Hello there!", "stop")
    # one token per byte: the tags were cut across deltas, and none of them leaked
    assert all("<" not in d.get("content", "") + d.get("reasoning_content", "") for d in deltas)
    first = next(i for i, d in enumerate(deltas) if "content" in d and d["content"])
    assert all("content" not in d or not d["content"] for d in deltas[:first] if "reasoning_content" in d)
    assert not any("reasoning_content" in d for d in deltas[first:])


def test_chat_without_tags_and_cut(servers):
    s = servers["qwen3"]
    c = chat(s, "  Just an answer.")
    assert c.message.content == "  Just an answer." and "reasoning_content" not in c.message.model_dump()
    c = chat(s, "<think>I am still thinking about it", max_tokens=20)
    assert (c.message.model_dump()["reasoning_content"], c.message.content, c.finish_reason) == \
           ("I am still th", None, "length")
    assert chat(s, "<think>I am still thinking about it", stream=True, max_tokens=20)[:2] == ("I am still th", "")


def test_deepseek_r1(servers):
    s = servers["deepseek_r1"]
    c = chat(s, "Hmm, a greeting.\n</think>\n\nHi!")
    assert s.engine.last_prompt().endswith("assistant\n<think>\n")
    assert (c.message.model_dump()["reasoning_content"], c.message.content) == ("Hmm, a greeting.", "Hi!")
    assert chat(s, "Hmm, a greeting.\n</think>\n\nHi!", stream=True)[:2] == ("Hmm, a greeting.", "Hi!")
    c = chat(s, "No end tag at all")  # never closed: all reasoning
    assert (c.message.model_dump()["reasoning_content"], c.message.content) == ("No end tag at all", None)
    assert chat(s, "No end tag at all", stream=True)[:2] == ("No end tag at all", "")


def test_qwen3_after_a_prompt_that_opens_think(servers):
    """Qwen3 "thinking" templates open <think> in the prompt: the output starts in the reasoning."""
    s = servers["qwen3_open"]
    c = chat(s, "Hmm.</think>Hi!")
    assert (c.message.model_dump()["reasoning_content"], c.message.content) == ("Hmm.", "Hi!")
    assert chat(s, "Hmm.</think>Hi!", stream=True)[:2] == ("Hmm.", "Hi!")
    c = chat(servers["qwen3"], "Hmm.</think>Hi!")  # a prompt that opens nothing: all content
    assert c.message.content == "Hmm.</think>Hi!" and "reasoning_content" not in c.message.model_dump()


@pytest.mark.parametrize("kind", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_after_reasoning(servers, stream, kind):
    script = "I need the weather: get_weather.</think>\n" + CALL_PARIS
    got = chat(servers[kind], script if kind == "deepseek_r1" else "<think>" + script, stream, tools=TOOLS)
    if stream:
        reasoning, content, calls, reason, _ = got
        names = [tc["function"]["name"] for tc in calls if tc.get("function", {}).get("name")]
        args = "".join(tc["function"].get("arguments", "") for tc in calls)
    else:
        reasoning, content, reason = got.message.model_dump()["reasoning_content"], got.message.content, got.finish_reason
        names = [tc.function.name for tc in got.message.tool_calls]
        args = "".join(tc.function.arguments for tc in got.message.tool_calls)
    assert reasoning == "I need the weather: get_weather." and not content
    assert (names, json.loads(args), reason) == (["get_weather"], {"city": "Paris"}, "tool_calls")


@pytest.mark.parametrize("kind", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_inside_reasoning_is_not_a_call(servers, stream, kind):
    script = "<think>I could write " + CALL_PARIS + " but no.</think>The weather is fine."
    got = chat(servers[kind], script, stream, tools=TOOLS)
    if stream:
        reasoning, content, calls, reason, _ = got
    else:
        reasoning, content, reason = got.message.model_dump()["reasoning_content"], got.message.content, got.finish_reason
        calls = got.message.tool_calls
    assert reasoning == "I could write " + CALL_PARIS + " but no."
    assert (content, calls or None, reason) == ("The weather is fine.", None, "stop")


def test_constrained_output_is_not_split(servers):
    """With a constraint the output follows its grammar from the first token: no reasoning,
    even where the template opened <think> (deepseek_r1)."""
    c = chat(servers["deepseek_r1"], '{"a": 1}', response_format={"type": "json_object"})
    assert c.message.content == '{"a": 1}' and "reasoning_content" not in c.message.model_dump()


def test_raw_body_shapes(servers):
    """reasoning_content sits in the message; without reasoning it is left out (not null)."""
    s = servers["qwen3"]
    s.engine.script = THINK
    msg = httpx.post(s.url + "/v1/chat/completions", json={"messages": ASK}).json()["choices"][0]["message"]
    assert msg == {"role": "assistant", "reasoning_content": "The user says hi.", "content": "Hello there!"}
    s.engine.script = "No thoughts."
    msg = httpx.post(s.url + "/v1/chat/completions", json={"messages": ASK}).json()["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": "No thoughts."}
