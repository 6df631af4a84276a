"""Tool (function) calls on /v1/chat/completions, with OpenAI's semantics.

- The tools go to the model's own chat template (`apply_chat_template(..., tools=[...])`),
  whatever `tool_choice` is (as vLLM does). History messages go in the shape Hugging Face
  templates expect: an assistant's tool calls with their arguments as a dict, a tool result
  with its `tool_call_id` (and the called function's `name` where an earlier call gives it).
  A template that never reads them (SmolLM2's): earlier calls are written into the
  assistant's content as `<tool_call>` blocks, and for "required" / a named function the
  tools are described in the system message (see template_messages).
- `tool_choice: "none"`: plain generation, nothing parsed.
- A named function: the output is constrained (structured outputs) to that function's
  `parameters` schema and becomes the arguments of one call; finish_reason is the engine's
  ("stop": OpenAI's and vLLM's answer for a named tool_choice).
- `"required"`: the output is constrained to a JSON array of {"name", "parameters"} objects
  (one of the tools each), at least one and at most MAX_PARALLEL_CALLS (exactly one when
  `parallel_tool_calls` is false), parsed into the calls; finish_reason "tool_calls" (vLLM's
  rule).
- The grammar of required and named calls is bounded so that a request without max_tokens
  ends: compact JSON (TOOL_JSON_FORMAT: `", "` and `": "` separators, no other whitespace), the
  array closes by MAX_PARALLEL_CALLS, and arguments objects follow OpenAI's strict semantics
  (an object that lists `properties` takes no other key unless its schema says so; the
  listed keys come at most once each, in the schema's order: structured_output/grammar.py's
  closed_objects). Once the JSON is complete only EOS is allowed, so the model stops there.
- `"auto"` (the default when tools are given): free generation, then the model's own call
  format is parsed, detected from its chat template: Hermes / Qwen2.5 / Qwen3 style
  `<tool_call>{"name", "arguments"}</tool_call>` blocks, or Llama 3.x JSON
  (`{"name", "parameters"}`, `;`-separated). Text before the first block is the content
  (null when blank); a block that is not valid JSON leaves the whole text as plain content.
  A template with no known format: the output is plain content (use "required" or a named
  function to get calls from any model). finish_reason "tool_calls" when calls were found.
  With `parallel_tool_calls: false` only the first call is kept.
- An output cut by max_tokens keeps the engine's finish_reason ("length") and is never
  presented as content: the calls completed before the cut are whole, and the call being
  written is the last one, with its name and its arguments text as far as it got (as a rule
  not valid JSON: what OpenAI sends for a cut call; one cut before its name is complete is
  dropped). So a client checks finish_reason: "length" means the last call's arguments may
  be cut short; "tool_calls" (required) or "stop" (named) means every call is whole and its
  arguments parse and validate against the tool's schema.

Streaming and non-streaming run the same per-choice parser (non-streaming feeds it the whole
text at once and merges its deltas), so the openai SDK's stream accumulation gives exactly
the non-streaming message. Deltas: a named call's header first, then its argument text as it
is generated; a required call whole as soon as its array element closes (a cut one when the
output ends); for auto, content until a call may be starting (a prefix of the opening tag, or
trailing blanks, is held back), then the calls when the output ends.

The parsers and the models' call formats: tool_parsers.py.
"""
from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from typing import Any

from pagedjax.sampling_params import StructuredOutputsParams
from pagedjax.entrypoints.openai.errors import bad_request
from pagedjax.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from pagedjax.entrypoints.openai.response_bodies import ToolCall
from pagedjax.entrypoints.openai.tool_parsers import (Delta, _AutoParser, _CallFormat, _NamedParser, _Parser,
                                                      _RequiredParser, chat_template, detect_format)


# ---- the request ------------------------------------------------------------------------

# How required / named calls are written (llguidance's "x-guidance" options): json.dumps' own
# style, `{"name": "f", "parameters": {"a": 1}}`, and no other whitespace anywhere, so a model
# can neither pad its calls with blank runs nor spend tokens on layout.
TOOL_JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Calls in one "required" answer with parallel calls. A bound, not a target: the grammar lets
# the model close the array after any call, and capable models do. It is not the number of
# tools, since parallel calls of one tool are the usual case (OpenAI's example: the weather in
# three cities); 8 compact calls of typical arguments are a few hundred tokens at most.
MAX_PARALLEL_CALLS = 8


@dataclass(slots=True)
class ToolPlan:
    """What a request asks of tools: how to render, constrain and parse its output."""

    mode: str  # "none" | "auto" | "required" | "named"
    tools: list[dict] | None  # for the chat template (None: no tools given)
    name: str | None = None  # the named function
    parallel: bool = True
    call_format: type[_CallFormat] | None = None  # auto: the model's format (None: not known)
    schema: dict | None = None  # required / named: the JSON schema the output must follow

    @property
    def parses(self) -> bool:
        """Whether the output is turned into tool calls (else it is plain content)."""
        return self.mode in ("required", "named") or (self.mode == "auto" and self.call_format is not None)

    def structured_outputs(self) -> StructuredOutputsParams | None:
        return StructuredOutputsParams(json=self.schema) if self.schema is not None else None

    def parser(self) -> _Parser:
        if self.mode == "named":
            return _NamedParser(self.name)
        if self.mode == "required":
            return _RequiredParser({t["function"]["name"] for t in self.tools}, self.parallel)
        return _AutoParser(self.call_format, self.parallel)

    def message(self, text: str, reason: str) -> tuple[str | None, list[ToolCall] | None, str]:
        """(content, tool calls, finish_reason) of one whole completion."""
        p = self.parser()
        deltas = [p.feed(text), p.finish(reason)]
        content = "".join(d.get("content", "") for d in deltas)
        calls: dict[int, dict] = {}
        for d in deltas:
            for tc in d.get("tool_calls", ()):
                call = calls.setdefault(tc["index"], {"id": "", "name": "", "arguments": ""})
                call["id"] = tc.get("id", call["id"])
                call["name"] += tc.get("function", {}).get("name", "")
                call["arguments"] += tc.get("function", {}).get("arguments", "")
        tool_calls = [ToolCall(id=c["id"], function={"name": c["name"], "arguments": c["arguments"]})
                      for _, c in sorted(calls.items())]
        return content or None, tool_calls or None, p.reason


def plan_tools(req: ChatCompletionRequest, tokenizer: Any) -> ToolPlan | None:
    """The request's tool plan (None when it gives no tools and no tool_choice); 400 for a
    tool_choice without tools, an unknown named function or duplicate tool names."""
    tools = req.tools or None
    choice = req.tool_choice
    if tools is None:
        if choice not in (None, "none"):
            raise bad_request("`tool_choice` needs `tools`", "tool_choice")
        return None
    names = [t.function.name for t in tools]
    dup = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if dup is not None:
        raise bad_request(f"`tools` has two functions named `{dup}`", "tools")
    rendered = [{"type": "function", "function": {k: v for k, v in (("name", t.function.name),
                                                                     ("description", t.function.description),
                                                                     ("parameters", t.function.parameters))
                                                  if v is not None}} for t in tools]
    parallel = req.parallel_tool_calls is not False
    if choice is None:
        choice = "auto"
    if choice == "none":
        return ToolPlan("none", rendered, parallel=parallel)
    if choice != "auto" and getattr(req, "use_beam_search", False):
        raise bad_request("a `tool_choice` of \"required\" or a named function is not supported with "
                          "`use_beam_search`", "tool_choice")
    if choice == "auto":
        return ToolPlan("auto", rendered, parallel=parallel, call_format=detect_format(tokenizer, rendered))
    if choice == "required":
        return ToolPlan("required", rendered, parallel=parallel, schema=required_schema(rendered, parallel))
    name = choice.function.name
    if name not in names:
        raise bad_request(f"`tool_choice` names the function `{name}`, which is not in `tools` "
                          f"(it has: {', '.join(names)})", "tool_choice.function.name")
    params = rendered[names.index(name)]["function"].get("parameters")
    return ToolPlan("named", rendered, name=name, parallel=parallel, schema=named_schema(params))


def tool_constraint(plan: ToolPlan | None, spec: StructuredOutputsParams | None,
                    param: str | None) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's output constraint and the field that set it, once tools are counted:
    tool_choice "required" or a named function constrains the output itself, so it cannot
    be combined with response_format or structured_outputs."""
    if plan is None or plan.schema is None:
        return spec, param
    if spec is not None:
        raise bad_request(f"`{param}` cannot be combined with a `tool_choice` of \"required\" or a named "
                          "function (the tool call's schema is the output's constraint)", param)
    return plan.structured_outputs(), "tools"


def _object_schema(parameters: dict | None) -> dict:
    """A function's arguments schema (no parameters: an empty object, as vLLM does)."""
    return copy.deepcopy(parameters) if parameters else {"type": "object", "properties": {}}


def _formatted(schema: dict) -> dict:
    """`schema` with TOOL_JSON_FORMAT as its llguidance options (its own "x-guidance" keys win)."""
    options = schema.get("x-guidance")
    schema["x-guidance"] = {**TOOL_JSON_FORMAT, **(options if isinstance(options, dict) else {})}
    return schema


def named_schema(parameters: dict | None) -> dict:
    """The schema of a named function's output: its arguments object, compact."""
    return _formatted(_object_schema(parameters))


def required_schema(tools: list[dict], parallel: bool) -> dict:
    """vLLM's schema for tool_choice "required": [{"name": <a tool>, "parameters": <its
    arguments>}, ...], compact (TOOL_JSON_FORMAT), at least one call and at most
    MAX_PARALLEL_CALLS (exactly one without parallel calls). The tools' `$defs` move to the
    root, where their `#/$defs/...` references point."""
    defs: dict[str, Any] = {}
    items = []
    for i, t in enumerate(tools):
        params = _object_schema(t["function"].get("parameters"))
        for key in ("$defs", "definitions"):
            found = params.pop(key, None) or {}
            if not isinstance(found, dict):
                raise bad_request(f"`{key}` must be an object", f"tools[{i}].function.parameters")
            for name, sub in found.items():
                if defs.setdefault(name, sub) != sub:
                    raise bad_request(f"tools define `{name}` in `{key}` twice, differently; give the "
                                      "definitions distinct names", f"tools[{i}].function.parameters")
        items.append({"type": "object",
                      "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                     "parameters": params},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "maxItems": MAX_PARALLEL_CALLS if parallel else 1,
                              "items": {"anyOf": items}}
    if defs:
        schema["$defs"] = defs
    return _formatted(schema)


def template_messages(messages: list[ChatMessage], tokenizer: Any = None, plan: ToolPlan | None = None) -> list[dict]:
    """The messages as chat templates take them; 400 for fields a role does not allow.

    For a template without tool support (it never reads `tools` / `tool_calls`, as
    SmolLM2's): an assistant's earlier calls are written into its content as `<tool_call>`
    blocks (else the template drops them), and for tool_choice "required" or a named function
    the tools are described in the system message (else the model fills in arguments for
    functions it never saw)."""
    out = _messages(messages)
    template = chat_template(tokenizer, plan.tools if plan else None) if tokenizer is not None else None
    if template is None:
        return out
    if not re.search(r"\btool_calls\b", template):
        for msg in out:
            for tc in msg.get("tool_calls", ()):
                block = json.dumps({"name": tc["function"]["name"], "arguments": tc["function"]["arguments"]},
                                   ensure_ascii=False)
                msg["content"] += ("\n" if msg["content"] else "") + f"<tool_call>\n{block}\n</tool_call>"
    if plan is not None and plan.mode in ("required", "named") and not re.search(r"\btools\b", template):
        note = _tools_note(plan)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{note}" if out[0]["content"] else note}
        else:
            out.insert(0, {"role": "system", "content": note})
    return out


def _tools_note(plan: ToolPlan) -> str:
    """The tools, in words, for a template that cannot show them."""
    listed = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in plan.tools)
    if plan.mode == "named":
        ask = f"Call the function `{plan.name}`: reply with its arguments as a JSON object."
    else:
        ask = 'Call one or more of them: reply with a JSON array of {"name": ..., "parameters": {...}} objects.'
    return f"You can call these functions (name, description, JSON schema of the arguments):\n{listed}\n{ask}"


def _messages(messages: list[ChatMessage]) -> list[dict]:
    out: list[dict] = []
    names: dict[str, str] = {}  # tool call id -> function name
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if m.tool_calls and m.role != "assistant":
            raise bad_request(f"only assistant messages may have `tool_calls` (this one is {m.role!r})",
                              f"{where}.tool_calls")
        if m.role == "tool" and m.tool_call_id is None:
            raise bad_request("a message with role \"tool\" needs `tool_call_id`", f"{where}.tool_call_id")
        if m.role != "tool" and m.tool_call_id is not None:
            raise bad_request("only messages with role \"tool\" may have `tool_call_id`", f"{where}.tool_call_id")
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            raise bad_request(f"Missing required field `{where}.content`", f"{where}.content")
        content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or ())
        msg: dict[str, Any] = {"role": m.role, "content": content}
        if m.name:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = []
            for j, tc in enumerate(m.tool_calls):
                names[tc.id] = tc.function.name
                arguments = _arguments_dict(tc.function.arguments, f"{where}.tool_calls[{j}].function.arguments")
                msg["tool_calls"].append({"id": tc.id, "type": "function",
                                          "function": {"name": tc.function.name, "arguments": arguments}})
        if m.role == "tool":
            msg["tool_call_id"] = m.tool_call_id
            if not m.name and m.tool_call_id in names:
                msg["name"] = names[m.tool_call_id]
        out.append(msg)
    return out


def _arguments_dict(arguments: str, param: str) -> dict:
    """A call's JSON arguments text as a dict (templates print them with tojson)."""
    if not arguments.strip():
        return {}
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        value = None
    if not isinstance(value, dict):
        raise bad_request("tool call arguments must be the JSON text of an object", param)
    return value


# ---- streaming: one parser per choice ---------------------------------------------------


class ToolStreams:
    """The parsers of a streamed request's choices."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.parsers: dict[int, _Parser] = {}

    def deltas(self, index: int, text: str, reason: str | None) -> list[tuple[Delta, str | None]]:
        """The (delta, finish_reason) chunks of choice `index` for its new text `text` (and its
        end, when `reason` is set). An end that brings tool calls gets a chunk of its own after
        them, as OpenAI sends it: the SDK's stream helper closes a call only on a later chunk."""
        p = self.parsers.get(index)
        if p is None:
            p = self.parsers[index] = self.plan.parser()
        d = p.feed(text)
        if reason is None:
            return [(d, None)]
        end = p.finish(reason)
        if "content" in end:
            d["content"] = d.get("content", "") + end["content"]
        if "tool_calls" in end:
            d["tool_calls"] = d.get("tool_calls", []) + end["tool_calls"]
        return [(d, None), ({}, p.reason)] if "tool_calls" in d else [(d, p.reason)]
