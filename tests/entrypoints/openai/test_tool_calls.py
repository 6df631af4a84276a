"""Tool calls on /v1/chat/completions through the official openai client: tools rendered by the
model's template, "auto" parsing of Hermes/Qwen `<tool_call>` blocks, "required" and named
functions constrained by structured outputs (checked against a real llguidance compiler),
streaming equal to non-streaming, history with tool calls and results, and the 400s."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from pagedjax.sampling_params import StructuredOutputsParams
from pagedjax.entrypoints.openai.tool_calls import MAX_PARALLEL_CALLS, TOOL_JSON_FORMAT, ToolPlan, required_schema
from pagedjax.entrypoints.openai.tool_parsers import HermesFormat, Llama3JsonFormat

from .conftest import MODEL, openai_client, running_server
from .fake_engine import CHAT_TEMPLATE, EOS, SPECIALS, FakeEngine

# Qwen2.5's chat template, without its default system prompt (the same tool prompt, call and response markup)
QWEN_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided "
    "with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) "
    "or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def make_byte_tokenizer(chat_template: str):
    """A byte-level tokenizer (every text round-trips: one token per byte) with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(SPECIALS + alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|endoftext|>",
                                   chat_template=chat_template)


class ScriptedEngine(FakeEngine):
    """A FakeEngine that "generates" `script` (set before a request; a list: one per choice),
    `piece` tokens a step, then EOS; it records each request's prompt ids. Its grammar
    compiler is llguidance's, over the byte tokenizer."""

    def __init__(self, chat_template: str = QWEN_TEMPLATE, piece: int = 3) -> None:
        from pagedjax.structured_output.grammar import GrammarCompiler

        tokenizer = make_byte_tokenizer(chat_template)
        super().__init__(max_model_len=8192, block_size=16, num_blocks=8192, step_delay=0.001,
                         grammar_compiler=GrammarCompiler(tokenizer, len(tokenizer), (EOS,)))
        self.tokenizer, self.piece = tokenizer, piece
        self.script: str | list[str] = ""
        self.scripts: dict[str, list[int] | list[list[int]]] = {}
        self.prompts: dict[str, list[int]] = {}

    def add_request(self, request_id, prompt, params, cache_salt=None) -> None:
        super().add_request(request_id, prompt, params, cache_salt)
        self.prompts[request_id] = list(prompt)
        scripts = self.script if isinstance(self.script, list) else [self.script] * params.n
        self.scripts[request_id] = [self.tokenizer.encode(s, add_special_tokens=False) for s in scripts]

    def _advance(self, req, seq) -> None:
        p, script = req.params, self.scripts[req.request_id][seq.index]
        k = len(seq.token_ids)
        new = script[k:k + self.piece] or [EOS]
        seq.token_ids.extend(new)
        seq.text = self.tokenizer.decode(seq.token_ids, skip_special_tokens=True)
        if p.logprobs is not None:
            seq.logprobs.extend({t: -0.5} for t in new)
        if new == [EOS]:
            seq.finish_reason = "stop"
        elif len(seq.token_ids) >= p.max_tokens:
            del seq.token_ids[p.max_tokens:]
            seq.text = self.tokenizer.decode(seq.token_ids)
            seq.finish_reason = "length"

    def last_prompt(self) -> str:
        return self.tokenizer.decode(self.prompts[self.added[-1]])

    def last_constraint(self) -> StructuredOutputsParams | None:
        return self.params[self.added[-1]].structured_outputs


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}]
ASK = [{"role": "user", "content": "Weather in Paris, and the time?"}]
CALL_PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_TIME = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tserver():
    with running_server(ScriptedEngine()) as s:
        yield s


@pytest.fixture
def tclient(tserver) -> openai.OpenAI:
    return openai_client(tserver.url)


def ask(tserver, tclient, script, **kw):
    """The non-streaming answer, and the streamed one as the SDK accumulates it, with its chunks."""
    tserver.engine.script = script
    kw = {"model": MODEL, "messages": ASK, "tools": TOOLS, **kw}
    r = tclient.chat.completions.create(**kw)
    state, chunks = ChatCompletionStreamState(), []
    for chunk in tclient.chat.completions.create(stream=True, **kw):
        state.handle_chunk(chunk)
        chunks.append(chunk)
    return r, state.current_completion_snapshot, chunks


def calls(message) -> list[tuple[str, dict | str]]:
    """(name, arguments parsed; as text when they are not JSON) of each tool call."""
    out = []
    for tc in message.tool_calls or []:
        try:
            out.append((tc.function.name, json.loads(tc.function.arguments)))
        except ValueError:
            out.append((tc.function.name, tc.function.arguments))
    return out


def same(r, s) -> None:
    """The streamed answer accumulates to the non-streaming one (ids aside)."""
    for a, b in zip(r.choices, s.choices, strict=True):
        assert (a.message.content, calls(a.message), a.finish_reason) == \
               (b.message.content, calls(b.message), b.finish_reason)
        assert [(t.type, t.function.arguments) for t in a.message.tool_calls or []] == \
               [(t.type, t.function.arguments) for t in b.message.tool_calls or []]


# ---- auto -------------------------------------------------------------------------------


def test_auto_parses_calls_and_content(tserver, tclient):
    r, s, chunks = ask(tserver, tclient, "Let me check.\n" + CALL_PARIS + "\n" + CALL_TIME)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Let me check."
    assert calls(c.message) == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    ids = [tc.id for tc in c.message.tool_calls] + [tc.id for tc in s.choices[0].message.tool_calls]
    assert all(i.startswith("call_") and len(i) > 10 for i in ids) and len(set(ids)) == 4
    assert c.message.tool_calls[0].type == "function"
    assert c.message.tool_calls[0].function.arguments == '{"city": "Paris"}'
    same(r, s)
    assert tserver.engine.last_constraint() is None  # auto: free generation
    # no markup leaked into streamed content; every tool-call delta has its index
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == "Let me check."
    assert all(tc.index is not None for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or [])
    # the tools went through the template
    prompt = tserver.engine.last_prompt()
    assert "<tools>\n" + json.dumps(TOOLS[0]) in prompt and prompt.endswith("<|im_start|>assistant\n")
    assert r.usage.completion_tokens == len(tserver.engine.tokenizer.encode(
        "Let me check.\n" + CALL_PARIS + "\n" + CALL_TIME)) + 1  # + EOS: usage unchanged by parsing


def test_stream_helper(tserver, tclient):
    """The SDK's `chat.completions.stream` helper gives the same calls as a plain request."""
    tserver.engine.script = "On it.\n" + CALL_PARIS + "\n" + CALL_TIME
    with tclient.chat.completions.stream(model=MODEL, messages=ASK, tools=TOOLS) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    done = [(e.name, json.loads(e.arguments)) for e in events if e.type == "tool_calls.function.arguments.done"]
    assert done == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    assert calls(final.choices[0].message) == done and final.choices[0].message.content == "On it."
    assert final.choices[0].finish_reason == "tool_calls"


def test_auto_call_only_content_null(tserver, tclient):
    r, s, _ = ask(tserver, tclient, "\n" + CALL_PARIS)
    assert r.choices[0].message.content is None and s.choices[0].message.content is None
    assert calls(r.choices[0].message) == [("get_weather", {"city": "Paris"})]
    same(r, s)


def test_auto_unclosed_last_block_and_parameters_key(tserver, tclient):
    r, s, _ = ask(tserver, tclient, '<tool_call>\n{"name": "get_time", "parameters": {"tz": "UTC"}}\n')
    assert calls(r.choices[0].message) == [("get_time", {"tz": "UTC"})] and r.choices[0].finish_reason == "tool_calls"
    same(r, s)


@pytest.mark.parametrize("text", [
    "Plain answer, no tools.",
    "Ends like a tag <tool_call",
    "A <tool> that is not one, and <tool_c again.  ",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',  # malformed JSON
    "Hi\n" + CALL_PARIS + '\n<tool_call>\n["not", "an", "object"]\n</tool_call>',  # one bad block: all content
    '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
])
def test_auto_plain_content(tserver, tclient, text):
    r, s, _ = ask(tserver, tclient, text)
    c = r.choices[0]
    assert (c.message.content, c.message.tool_calls, c.finish_reason) == (text, None, "stop")
    same(r, s)


def test_auto_parallel_false_keeps_first(tserver, tclient):
    r, s, _ = ask(tserver, tclient, CALL_PARIS + "\n" + CALL_TIME, parallel_tool_calls=False)
    assert calls(r.choices[0].message) == [("get_weather", {"city": "Paris"})]
    same(r, s)


def test_tool_choice_none_is_plain_text(tserver, tclient):
    r, s, _ = ask(tserver, tclient, CALL_PARIS, tool_choice="none")
    assert (r.choices[0].message.content, r.choices[0].message.tool_calls) == (CALL_PARIS, None)
    assert r.choices[0].finish_reason == "stop" and "<tools>" in tserver.engine.last_prompt()  # still rendered
    same(r, s)


def test_auto_n2_and_raw_json(tserver):
    tserver.engine.script = [CALL_PARIS, "no call"]
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "n": 2}
    out = httpx.post(tserver.url + "/v1/chat/completions", json=body, timeout=10).json()
    a, b = out["choices"]
    assert a["message"]["content"] is None and a["finish_reason"] == "tool_calls"
    assert a["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert b["message"] == {"role": "assistant", "content": "no call"} and b["finish_reason"] == "stop"


# ---- required and named -----------------------------------------------------------------


def accepts(engine: ScriptedEngine, spec: StructuredOutputsParams, text: str) -> bool:
    """Whether the llguidance grammar of `spec` accepts `text` then EOS."""
    m = engine.grammar_compiler.matcher(spec)
    return all(m.accept(t) for t in engine.tokenizer.encode(text, add_special_tokens=False)) and m.accept(EOS)


REQUIRED = '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}, ' \
           '{"name": "get_time", "parameters": {"tz": "UTC"}}]'


def test_required(tserver, tclient):
    r, s, chunks = ask(tserver, tclient, REQUIRED, tool_choice="required")
    spec = tserver.engine.last_constraint()
    assert spec.json == {"type": "array", "minItems": 1, "maxItems": MAX_PARALLEL_CALLS, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                          "parameters": t["function"]["parameters"]},
         "required": ["name", "parameters"], "additionalProperties": False} for t in TOOLS]},
        "x-guidance": TOOL_JSON_FORMAT}
    assert accepts(tserver.engine, spec, REQUIRED)
    assert not accepts(tserver.engine, spec, '[{"name": "nope", "parameters": {}}]')
    assert not accepts(tserver.engine, spec, '[{"name": "get_time", "parameters": {}}]')  # tz is required
    c = r.choices[0]
    assert (c.message.content, c.finish_reason) == (None, "tool_calls")
    assert calls(c.message) == [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"tz": "UTC"})]
    same(r, s)
    # the first call streams as soon as its array element closes, before the output ends (with
    # logprobs every token has a chunk, so the tokens between the two calls show as chunks)
    chunks = list(tclient.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                                  logprobs=True, stream=True))
    with_calls = [i for i, ch in enumerate(chunks) if ch.choices and ch.choices[0].delta.tool_calls]
    assert len(with_calls) == 2 and with_calls[0] < with_calls[1] - 3


def test_required_single_and_defs(tserver, tclient):
    r, s, _ = ask(tserver, tclient, '[{"name": "get_time", "parameters": {"tz": "UTC"}}]', tool_choice="required",
                  parallel_tool_calls=False)
    spec = tserver.engine.last_constraint()
    assert spec.json["maxItems"] == 1 and spec.json["minItems"] == 1
    assert not accepts(tserver.engine, spec, REQUIRED)
    assert calls(r.choices[0].message) == [("get_time", {"tz": "UTC"})]
    same(r, s)
    # $defs move to the root, where "#/$defs/..." points; a tool without parameters takes {}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "required": ["p"],
        "$defs": {"P": {"type": "integer"}}}}}, {"type": "function", "function": {"name": "g"}}]
    schema = required_schema(tools, True)
    assert schema["$defs"] == {"P": {"type": "integer"}}
    assert "$defs" in tools[0]["function"]["parameters"]  # the request's own schema is untouched
    spec = StructuredOutputsParams(json=schema)
    assert accepts(tserver.engine, spec, '[{"name": "f", "parameters": {"p": 3}}, {"name": "g", "parameters": {}}]')
    assert not accepts(tserver.engine, spec, '[{"name": "f", "parameters": {"p": "x"}}]')


def test_named(tserver, tclient):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r, s, chunks = ask(tserver, tclient, '{"city": "Paris", "unit": "f"}', tool_choice=choice)
    spec = tserver.engine.last_constraint()
    assert spec.json == {**WEATHER, "x-guidance": TOOL_JSON_FORMAT}
    assert accepts(tserver.engine, spec, '{"city": "Paris", "unit": "f"}')
    c = r.choices[0]
    assert (c.message.content, c.finish_reason) == (None, "stop")  # OpenAI and vLLM: "stop" for a named function
    assert [(t.function.name, t.function.arguments) for t in c.message.tool_calls] == [
        ("get_weather", '{"city": "Paris", "unit": "f"}')]
    same(r, s)
    pieces = [tc.function.arguments for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    assert len(pieces) > 3 and "".join(pieces) == '{"city": "Paris", "unit": "f"}'  # arguments stream as made


def test_named_n2_truncated_and_no_parameters(tserver, tclient):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r, s, _ = ask(tserver, tclient, '{"city": "Paris"}', tool_choice=choice, n=2, max_tokens=6)
    assert [(c.message.tool_calls[0].function.arguments, c.finish_reason) for c in r.choices] == \
           [('{"city', "length")] * 2
    assert r.choices[0].message.tool_calls[0].id != r.choices[1].message.tool_calls[0].id
    same(r, s)
    tools = TOOLS + [{"type": "function", "function": {"name": "ping"}}]
    r, s, _ = ask(tserver, tclient, "{}", tools=tools, tool_choice={"type": "function", "function": {"name": "ping"}})
    assert tserver.engine.last_constraint().json == {"type": "object", "properties": {}, "x-guidance": TOOL_JSON_FORMAT}
    assert calls(r.choices[0].message) == [("ping", {})]


def test_required_truncated_keeps_closed_calls(tserver, tclient):
    n = len(tserver.engine.tokenizer.encode(REQUIRED.split("}}, ")[0] + "}}, {"))
    r, s, _ = ask(tserver, tclient, REQUIRED, tool_choice="required", max_tokens=n)
    c = r.choices[0]
    assert calls(c.message) == [("get_weather", {"city": "Paris", "unit": "c"})] and c.finish_reason == "length"
    same(r, s)


def test_required_unconstrained_engine_output_is_content(tserver, tclient):
    # an engine that ignored the constraint: what it said comes back as content
    r, s, _ = ask(tserver, tclient, "sorry, no", tool_choice="required")
    assert (r.choices[0].message.content, r.choices[0].message.tool_calls) == ("sorry, no", None)
    same(r, s)


# ---- history ----------------------------------------------------------------------------


def test_history_with_tool_calls_and_results(tserver, tclient):
    tserver.engine.script = CALL_PARIS
    first = tclient.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)
    msg = first.choices[0].message
    messages = ASK + [msg, {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": '{"temp": 21}'}]
    tserver.engine.script = "21 degrees."
    r = tclient.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("21 degrees.", "stop")
    prompt = tserver.engine.last_prompt()
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>\n'
            '<|im_start|>assistant\n') in prompt
    # a content string next to the calls, content parts in a tool result, empty arguments
    messages = ASK + [{"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": ""}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "12:00"}]}]
    tclient.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    prompt = tserver.engine.last_prompt()
    assert 'Checking.\n<tool_call>\n{"name": "get_time", "arguments": {}}' in prompt
    assert "<tool_response>\n12:00\n</tool_response>" in prompt


def test_template_without_tool_support(server, client):
    # the fake's plain ChatML template ignores tools: auto answers are plain content
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w5"}], tools=TOOLS,
                                       max_tokens=2, temperature=0)
    assert (r.choices[0].message.content, r.choices[0].message.tool_calls, r.choices[0].finish_reason) == \
           ("w6 w7", None, "length")


def test_template_without_tool_support_named_and_history():
    """A template that never reads tools (the fake's plain ChatML): a named call still comes
    out, the tools are described in a system message, earlier calls stay in the history."""
    with running_server(ScriptedEngine(CHAT_TEMPLATE)) as srv:
        srv.engine.script = '{"tz": "UTC"}'
        messages = [{"role": "system", "content": "Be brief."}, *ASK,
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
        r = openai_client(srv.url).chat.completions.create(
            model=MODEL, messages=messages, tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_time"}})
        assert calls(r.choices[0].message) == [("get_time", {"tz": "UTC"})]
        prompt = srv.engine.last_prompt()
        assert prompt.startswith("<|im_start|>system\nBe brief.\n\nYou can call these functions") and \
            json.dumps(TOOLS[1]["function"]) in prompt and "Call the function `get_time`" in prompt
        assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>\n' \
               '<|im_start|>tool\n12:00<|im_end|>\n' in prompt
        # auto: no call format known, the model was not shown the tools: plain content
        srv.engine.script = CALL_PARIS
        r = openai_client(srv.url).chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)
        assert (r.choices[0].message.content, r.choices[0].message.tool_calls) == (CALL_PARIS, None)
        assert "You can call" not in srv.engine.last_prompt()


# ---- bad requests -----------------------------------------------------------------------

NAMED = {"type": "function", "function": {"name": "get_weather"}}
B = {"model": MODEL, "messages": ASK, "tools": TOOLS}
BAD = [
    ({**B, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name", "nope"),
    ({"model": MODEL, "messages": ASK, "tool_choice": "required"}, "tool_choice", "tools"),
    ({"model": MODEL, "messages": ASK, "tools": [], "tool_choice": NAMED}, "tool_choice", "tools"),
    ({**B, "tool_choice": "sometimes"}, "tool_choice", None),
    ({**B, "tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name", None),
    ({**B, "tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name", None),
    ({**B, "tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type", None),
    ({**B, "tools": [{"type": "function"}]}, "tools[0].function", None),
    ({**B, "tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
     "tools[0].function.parameters", None),
    ({**B, "tools": [{"type": "function", "function": {"name": "f", "foo": 1}}]}, "tools[0].function.foo", None),
    ({**B, "tools": [TOOLS[0], TOOLS[0]]}, "tools", "get_weather"),
    ({**B, "tools": TOOLS * 65}, "tools", None),
    ({**B, "tools": {"type": "function"}}, "tools", None),
    ({**B, "parallel_tool_calls": "yes"}, "parallel_tool_calls", None),
    ({**B, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format", None),
    ({**B, "tool_choice": NAMED, "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}]}, "tools", None),
    ({**B, "messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", None),
    ({**B, "messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages[0].tool_call_id", None),
    ({**B, "messages": [{"role": "assistant", "content": None}]}, "messages[0].content", None),
    ({**B, "messages": [{"role": "user", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages[0].tool_calls", None),
    ({**B, "messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages[0].tool_calls[0].function.arguments", None),
    ({**B, "messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f"}}]}]}, "messages[0].tool_calls[0].function.arguments",
     None),
]


@pytest.mark.parametrize("body,param,word", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_requests(tserver, body, param, word):
    r = httpx.post(tserver.url + "/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    if word is not None:
        assert word in err["message"]


def test_bad_request_through_sdk(tclient):
    with pytest.raises(openai.BadRequestError, match="nope"):
        tclient.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                        tool_choice={"type": "function", "function": {"name": "nope"}})


# ---- the formats, without a server ------------------------------------------------------


def test_hermes_safe_prefix_never_shrinks_and_parse():
    text = "Sure <to" + "ol> ok \n\n" + CALL_PARIS
    sent = 0
    for i in range(len(text) + 1):
        cut = HermesFormat.safe_prefix(text[:i], sent)
        assert cut >= sent and "<tool_" not in text[:cut] and cut == HermesFormat.safe_prefix(text[:i])
        sent = cut
    assert text[:sent] == "Sure <tool> ok"
    assert HermesFormat.parse(text) == ("Sure <tool> ok", [("get_weather", '{"city": "Paris"}')])
    assert HermesFormat.parse("no calls") is None
    assert HermesFormat.parse('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>') == \
        ("", [("f", '{"a": 1}')])  # arguments given as JSON text


def test_llama3_json_format():
    assert Llama3JsonFormat.parse('{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}') == \
        ("", [("f", '{"a": 1}'), ("g", "{}")])
    assert Llama3JsonFormat.parse('<|python_tag|>{"name": "f", "parameters": {"a": 1}}') == ("", [("f", '{"a": 1}')])
    assert Llama3JsonFormat.parse('{"a": 1}') is None and Llama3JsonFormat.parse("Hello {") is None
    assert Llama3JsonFormat.safe_prefix('  {"name"') == 0 and Llama3JsonFormat.safe_prefix("Hello") == 5
    assert Llama3JsonFormat.safe_prefix("<|pyth") == 0
    plan = ToolPlan("auto", [], call_format=Llama3JsonFormat)
    content, tool_calls, reason = plan.message('{"name": "f", "parameters": {"a": 1}}', "stop")
    assert (content, [(t.function.name, t.function.arguments) for t in tool_calls], reason) == \
        (None, [("f", '{"a": 1}')], "tool_calls")


@pytest.mark.parametrize("plan,text", [
    (ToolPlan("auto", [], call_format=HermesFormat), "Hi  \n" + CALL_PARIS + "\n" + CALL_TIME),
    (ToolPlan("auto", [], call_format=HermesFormat), "Hi <tool_cal> <tool_call>{bad</tool_call>"),
    (ToolPlan("auto", [], call_format=HermesFormat), "  \n  "),
    (ToolPlan("auto", [], call_format=Llama3JsonFormat), ' {"name": "f", "parameters": {"a": "}"}};{"name": "g"}'),
    (ToolPlan("auto", [], call_format=Llama3JsonFormat), "<|python_tag|>not json"),
    (ToolPlan("auto", [], call_format=Llama3JsonFormat), "plain {text}"),
    (ToolPlan("required", TOOLS), REQUIRED),
    (ToolPlan("required", TOOLS), '[{"name": "get_time", "parameters": {"tz": "}]"}}, {"name": "get_weather", "par'),
    (ToolPlan("required", TOOLS, parallel=False), REQUIRED),
    (ToolPlan("named", TOOLS, name="get_time"), '{"tz": "UTC"}'),
])
@pytest.mark.parametrize("reason", ["stop", "length"])
def test_streamed_pieces_accumulate_to_the_whole(plan, text, reason):
    """Any split of the text streams to what the whole text gives, with any finish reason."""
    import random

    from pagedjax.entrypoints.openai.tool_calls import ToolStreams

    want = plan.message(text, reason)
    for seed in range(20):
        rng, pos, deltas = random.Random(seed), 0, []
        streams = ToolStreams(plan)
        while pos < len(text):
            step = rng.randint(0, 6)
            piece, pos = text[pos:pos + step], pos + step
            deltas += streams.deltas(0, piece, reason if pos >= len(text) else None)
        if not text:
            deltas += streams.deltas(0, "", reason)
        content = "".join(d.get("content", "") for d, _ in deltas) or None
        args: dict[int, list[str]] = {}
        for d, _ in deltas:
            for tc in d.get("tool_calls", ()):
                entry = args.setdefault(tc["index"], ["", ""])
                entry[0] += tc.get("function", {}).get("name", "")
                entry[1] += tc["function"].get("arguments", "")
        got = (content, [tuple(v) for _, v in sorted(args.items())] or None, deltas[-1][1])
        assert [r for _, r in deltas[:-1]] == [None] * (len(deltas) - 1)
        assert got == (want[0], [(t.function.name, t.function.arguments) for t in want[1]] if want[1] else None,
                       want[2])
