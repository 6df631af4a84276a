"""Tool calls (tool_calls.py): the per-choice parsers that turn a completion's text into content
and tool-call deltas, and the call formats models are taught by their chat templates (auto).
"""
from __future__ import annotations

import json
import re
import secrets
from typing import Any

Delta = dict[str, Any]  # {"content": str} and/or {"tool_calls": [ {index, id?, type?, function: {...}} ]}


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


# ---- the parsers: one per choice --------------------------------------------------------


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
    soon as it closes. An output cut inside an element (max_tokens) ends with that call as far
    as it got: its name and its arguments text so far, as a rule not valid JSON (what OpenAI
    sends for a cut call, and what a named call streams); cut before its name is complete, it
    is dropped. Anything else (an engine that did not constrain the output) ends as plain
    content when no call came out of it."""

    HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"parameters"\s*:\s*')

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
        rest = self.buf[self.pos:].strip()
        ok = self.state == "end" and not self.failed and not rest
        self.reason = "tool_calls" if ok and reason == "stop" else reason
        if self.state in ("first", "item") and not self.failed and (not rest or rest[0] == "{"):  # cut short
            cut = self._cut_call()
            return {"tool_calls": [cut]} if cut is not None else {}
        return {"content": self.buf} if self.calls == 0 and self.buf else {}

    def _cut_call(self) -> dict | None:
        """The call an output cut inside an array element was writing (None: its name is not
        complete yet)."""
        m = self.HEAD.match(self.buf, self.pos)
        if m is None or (self.calls and not self.parallel):
            return None
        try:
            name = json.loads(m.group(1))
        except ValueError:
            return None
        if name not in self.names:
            return None
        self.calls += 1
        return _call_delta(self.calls - 1, name, self.buf[m.end():].rstrip())


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
