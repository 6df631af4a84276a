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
  (one of the tools each; at most one when `parallel_tool_calls` is false), parsed into the
  calls; finish_reason "tool_calls" (vLLM's rule).
- `"auto"` (the default when tools are given): free generation, then the model's own call
  format is parsed, detected from its chat template: Hermes / Qwen2.5 / Qwen3 style
  `<tool_call>{"name", "arguments"}</tool_call>` blocks, or Llama 3.x JSON
  (`{"name", "parameters"}`, `;`-separated). Text before the first block is the content
  (null when blank); a block that is not valid JSON leaves the whole text as plain content.
  A template with no known format: the output is plain content (use "required" or a named
  function to get calls from any model). finish_reason "tool_calls" when calls were found.
  With `parallel_tool_calls: false` only the first call is kept.
- A call truncated by max_tokens keeps the engine's finish_reason ("length").

Streaming and non-streaming run the same per-choice parser (non-streaming feeds it the whole
text at once and merges its deltas), so the openai SDK's stream accumulation gives exactly
the non-streaming message. Deltas: a named call's header first, then its argument text as it
is generated; a required call whole as soon as its array element closes; for auto, content
until a call may be starting (a prefix of the opening tag, or trailing blanks, is held back),
then the calls when the output ends.
"""
from __future__ import annotations

import copy
import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from pagedjax.sampling_params import StructuredOutputsParams
from pagedjax.entrypoints.openai.errors import bad_request
from pagedjax.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, ToolCall

Delta = dict[str, Any]  # {"content": str} and/or {"tool_calls": [ {index, id?, type?, function: {...}} ]}


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


# ---- the request ------------------------------------------------------------------------


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
    return ToolPlan("named", rendered, name=name, parallel=parallel, schema=_object_schema(params))


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


def required_schema(tools: list[dict], parallel: bool) -> dict:
    """vLLM's schema for tool_choice "required": [{"name": <a tool>, "parameters": <its
    arguments>}, ...], at least one (exactly one without parallel calls). The tools' `$defs`
    move to the root, where their `#/$defs/...` references point."""
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
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def chat_template(tokenizer: Any, tools: list[dict] | None = None) -> str | None:
    """The text of the chat template `apply_chat_template` uses (None: not known)."""
    try:
        template = tokenizer.get_chat_template(tools=tools)
    except Exception:  # no template, or a tokenizer without get_chat_template
        template = getattr(tokenizer, "chat_template", None)
    return template if isinstance(template, str) else None


def detect_format(tokenizer: Any, tools: list[dict] | None = None) -> type[_CallFormat] | None:
    """The tool-call format the model's chat template teaches, if a known one."""
    template = chat_template(tokenizer, tools)
    return None if template is None else next((f for f in _FORMATS if f.matches(template)), None)


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


class _Parser:
    """Turns a completion's text, fed piece by piece, into content and tool-call deltas."""

    reason: str = "stop"

    def feed(self, text: str) -> Delta:
        raise NotImplementedError

    def finish(self, reason: str) -> Delta:
        raise NotImplementedError


def _call_delta(index: int, name: str, arguments: str) -> dict:
    return {"index": index, "id": new_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


class _NamedParser(_Parser):
    """The whole output is the arguments of one call of `name`."""

    def __init__(self, name: str) -> None:
        self.name, self.started = name, False

    def feed(self, text: str) -> Delta:
        if not self.started:
            self.started = True
            return {"tool_calls": [_call_delta(0, self.name, text)]}
        return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}

    def finish(self, reason: str) -> Delta:
        self.reason = reason
        return {} if self.started else self.feed("")


class _RequiredParser(_Parser):
    """The output is a JSON array of {"name", "parameters"}; each element becomes a call as
    soon as it closes. Anything else (an engine that did not constrain the output, a
    truncated array) ends as plain content when no call came out of it."""

    def __init__(self, names: set[str], parallel: bool) -> None:
        self.names, self.parallel = names, parallel
        self.buf, self.pos, self.state, self.calls, self.failed = "", 0, "start", 0, False
        self.tried = 0  # an element is tried again only once a "}" came after the last failed try
        self.decoder = json.JSONDecoder()

    def feed(self, text: str) -> Delta:
        self.buf += text
        calls = []
        while not self.failed and self.state != "end":
            while self.pos < len(self.buf) and self.buf[self.pos] in " \t\r\n":
                self.pos += 1
            if self.pos >= len(self.buf):
                break
            ch = self.buf[self.pos]
            if self.state == "start":
                self.failed = ch != "["
                self.pos, self.state = self.pos + 1, "first"
            elif ch == "]" and self.state in ("first", "next"):
                self.pos, self.state = self.pos + 1, "end"
            elif ch == "," and self.state == "next":
                self.pos, self.state = self.pos + 1, "item"
            elif self.state in ("first", "item"):
                if self.buf.find("}", max(self.tried, self.pos)) < 0:
                    break
                try:
                    item, end = self.decoder.raw_decode(self.buf, self.pos)
                except (ValueError, RecursionError):  # incomplete (or invalid: stays so until the end)
                    self.tried = len(self.buf)
                    break
                call = self._call(item)
                if call is None:
                    self.failed = True
                    break
                calls.append(call)
                self.pos, self.state = end, "next"
            else:
                self.failed = True
        return {"tool_calls": calls} if calls else {}

    def _call(self, item: Any) -> dict | None:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or item["name"] not in self.names:
            return None
        params = item.get("parameters", {})
        if not isinstance(params, dict) or (self.calls and not self.parallel):
            return None
        self.calls += 1
        return _call_delta(self.calls - 1, item["name"], json.dumps(params, ensure_ascii=False))

    def finish(self, reason: str) -> Delta:
        ok = self.state == "end" and not self.failed and not self.buf[self.pos:].strip()
        self.reason = "tool_calls" if ok and reason == "stop" else reason
        return {"content": self.buf} if self.calls == 0 and self.buf else {}


class _AutoParser(_Parser):
    """Free text in which the model may write calls in its own format: content is streamed
    up to where a call may start; the rest is parsed when the output ends."""

    def __init__(self, call_format: type[_CallFormat], parallel: bool) -> None:
        self.format, self.parallel = call_format, parallel
        self.buf, self.sent = "", 0

    def feed(self, text: str) -> Delta:
        self.buf += text
        safe = self.format.safe_prefix(self.buf, self.sent)
        if safe <= self.sent:
            return {}
        piece, self.sent = self.buf[self.sent:safe], safe
        return {"content": piece}

    def finish(self, reason: str) -> Delta:
        parsed = self.format.parse(self.buf)
        if parsed is None:  # plain text: the rest of it
            self.reason = reason
            rest = self.buf[self.sent:]
            return {"content": rest} if rest else {}
        content, calls = parsed
        if not self.parallel:
            calls = calls[:1]
        self.reason = "tool_calls" if reason == "stop" else reason
        d: Delta = {"tool_calls": [_call_delta(i, name, args) for i, (name, args) in enumerate(calls)]}
        if len(content) > self.sent:  # what was streamed is always a prefix of the content
            d["content"] = content[self.sent:]
        return d


# ---- the models' own call formats (auto) ------------------------------------------------


class _CallFormat:
    """A tool-call format a chat template teaches its model."""

    @staticmethod
    def matches(template: str) -> bool:
        raise NotImplementedError

    @staticmethod
    def safe_prefix(text: str, start: int) -> int:
        """How much of `text` is content whatever follows; `text[:start]` is known to be (it
        was the answer for a shorter text: the answer never shrinks as text grows)."""
        raise NotImplementedError

    @staticmethod
    def parse(text: str) -> tuple[str, list[tuple[str, str]]] | None:
        """(content, [(name, arguments JSON text)]) of a whole output; None: plain content."""
        raise NotImplementedError


def _arguments_text(args: Any) -> str | None:
    """A parsed call's arguments as JSON text (None when they are not an object)."""
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError):
            return None
    return json.dumps(args, ensure_ascii=False) if isinstance(args, dict) else None


def _named_call(obj: Any, *keys: str) -> tuple[str, str] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in keys if k in obj), {})
    text = _arguments_text(args)
    return None if text is None else (obj["name"], text)


class HermesFormat(_CallFormat):
    """Hermes / Qwen2.5 / Qwen3: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
    one block per call; a last block may lack its closing tag (a stop string took it)."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    @staticmethod
    def matches(template: str) -> bool:
        return HermesFormat.OPEN in template

    @staticmethod
    def safe_prefix(text: str, start: int = 0) -> int:
        cut = text.find(HermesFormat.OPEN, start)
        if cut < 0:  # hold back an end that may be the tag's beginning
            cut = len(text) - next((k for k in range(min(len(text), len(HermesFormat.OPEN) - 1), 0, -1)
                                    if text.endswith(HermesFormat.OPEN[:k])), 0)
        while cut > start and text[cut - 1].isspace():  # and the blanks before it (content is right-stripped)
            cut -= 1
        return cut

    @staticmethod
    def parse(text: str) -> tuple[str, list[tuple[str, str]]] | None:
        start = text.find(HermesFormat.OPEN)
        if start < 0:
            return None
        calls = []
        for m in HermesFormat.BLOCK.finditer(text, start):
            try:
                call = _named_call(json.loads(m.group(1)), "arguments", "parameters")
            except (ValueError, RecursionError):
                return None
            if call is None:
                return None
            calls.append(call)
        return text[:start].rstrip(), calls


class Llama3JsonFormat(_CallFormat):
    """Llama 3.1-3.3: the whole output is `{"name": ..., "parameters": {...}}` (several
    separated by `;`), maybe after `<|python_tag|>`."""

    TAG = "<|python_tag|>"

    @staticmethod
    def matches(template: str) -> bool:
        return '"parameters": dictionary of argument name' in template

    @staticmethod
    def safe_prefix(text: str, start: int = 0) -> int:
        if start:  # some of it went out as content: all of it is
            return len(text)
        s = text[re.match(r"\s*", text).end():][:len(Llama3JsonFormat.TAG)]
        if not s or s.startswith("{") or Llama3JsonFormat.TAG.startswith(s):
            return 0  # may be a call: held back until the end
        return len(text)

    @staticmethod
    def parse(text: str) -> tuple[str, list[tuple[str, str]]] | None:
        s = text.strip()
        s = s[len(Llama3JsonFormat.TAG):].lstrip() if s.startswith(Llama3JsonFormat.TAG) else s
        if not s.startswith("{"):
            return None
        decoder, pos, calls = json.JSONDecoder(), 0, []
        while pos < len(s):
            try:
                obj, pos = decoder.raw_decode(s, pos)
            except (ValueError, RecursionError):
                return None
            call = _named_call(obj, "parameters", "arguments")
            if call is None:
                return None
            calls.append(call)
            while pos < len(s) and s[pos] in " \t\r\n;":
                pos += 1
        return "", calls


_FORMATS: list[type[_CallFormat]] = [HermesFormat, Llama3JsonFormat]
