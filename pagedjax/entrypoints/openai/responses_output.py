"""/v1/responses answers: the Response object, its output items and its stream of events.

A response's output is built from the chat path's parts of the output (chat_output.py): the
reasoning (with `--reasoning-parser`) becomes a `reasoning` item, the content a `message`
item with one `output_text` part, each tool call a `function_call` item, in that order; an
output with none of these is one empty message. The status: "completed" (the model stopped,
or called tools), "incomplete" with `incomplete_details.reason` "max_output_tokens" (cut
by the token limit or the context; its last item is "incomplete" too) or "failed" (the
engine aborted it). Streaming emits the same items through the events of OpenAI's API, each
with a `sequence_number`, and ends with `response.completed` (or `response.incomplete` /
`response.failed`) carrying the whole response, equal to the non-streamed one.
"""
from __future__ import annotations

import copy
import time
import uuid
from typing import Any

from pagedjax.entrypoints.openai.responses_protocol import ResponsesRequest
from pagedjax.entrypoints.openai.response_bodies import ToolCall
from pagedjax.entrypoints.openai.streaming import json_dumps

FAILED = {"code": "server_error", "message": "the request was aborted before it finished (is the server shutting down?)"}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def status_of(reason: str) -> tuple[str, dict | None]:
    """(status, incomplete_details) of an output that ended with finish reason `reason`."""
    if reason in ("stop", "tool_calls"):
        return "completed", None
    if reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "failed", None


def reasoning_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {"id": item_id or _id("rs"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {"id": item_id or _id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [text_part(text)]}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {"id": item_id or _id("fc"), "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


class ResponseBuilder:
    """The Response objects of one request: its echo of the request's settings, and the
    output, status and usage once known."""

    def __init__(self, req: ResponsesRequest, response_id: str, model: str) -> None:
        self.id, self.model, self.created_at = response_id, model, int(time.time())
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        choice = req.tool_choice or "auto"
        self.settings = {
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": req.parallel_tool_calls is not False, "temperature": req.temperature,
            "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
            "tools": [t.model_dump() for t in req.tools or ()], "top_p": req.top_p,
            "text": {"format": fmt.model_dump(by_alias=True) if fmt is not None else {"type": "text"}},
            "metadata": dict(req.metadata or {}), "user": req.user, "store": False, "background": False,
            "previous_response_id": None, "reasoning": None, "truncation": "disabled",
        }

    def response(self, status: str = "in_progress", output: list[dict] | None = None, usage: dict | None = None,
                 incomplete: dict | None = None) -> dict:
        body: dict[str, Any] = {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                                "error": FAILED if status == "failed" else None, "incomplete_details": incomplete,
                                "model": self.model, "output": output or [], "usage": usage, **self.settings}
        if status == "completed":
            body["completed_at"] = int(time.time())
        return body

    @staticmethod
    def usage(input_tokens: int, output_tokens: int, cached_tokens: int, reasoning_tokens: int) -> dict:
        return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
                "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                "total_tokens": input_tokens + output_tokens}

    def final(self, reasoning: str | None, content: str | None, calls: list[ToolCall] | None, reason: str,
               usage: dict) -> dict:
        """The whole response of a finished output (its parts as chat_output gives them)."""
        status, incomplete = status_of(reason)
        output = []
        if reasoning:
            output.append(reasoning_item(reasoning))
        if content or not (reasoning or calls):
            output.append(message_item(content or ""))
        for call in calls or ():
            output.append(call_item(call.id, call.function.name, call.function.arguments))
        if status != "completed" and output:
            output[-1]["status"] = "incomplete"
        return self.response(status, output, usage, incomplete)


class EventWriter:
    """The events of a streamed response: feed it the chat path's deltas (`delta`), then
    `finish`; each returns the server-sent events to send."""

    def __init__(self, builder: ResponseBuilder) -> None:
        self.builder = builder
        self.seq = 0
        self.output: list[dict] = []  # the items, as they stand
        self.open: dict | None = None  # the item being written
        self.reasoning = ""  # all the reasoning text (for the usage)

    def event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, **fields, "sequence_number": self.seq}
        self.seq += 1
        return f"event: {kind}\ndata: {json_dumps(body)}\n\n"

    def start(self) -> str:
        response = self.builder.response()
        return self.event("response.created", response=response) + self.event("response.in_progress",
                                                                              response=response)

    def delta(self, fields: dict) -> str:
        """The events of one chat delta ({"reasoning_content"?, "content"?, "tool_calls"?})."""
        out = ""
        if fields.get("reasoning_content"):
            text = fields["reasoning_content"]
            self.reasoning += text
            out += self._open("reasoning")
            out += self._text_delta("response.reasoning_text.delta", text)
        if fields.get("content"):
            out += self._open("message")
            out += self._text_delta("response.output_text.delta", fields["content"], logprobs=[])
        for tc in fields.get("tool_calls") or ():
            if "id" in tc:  # a new call
                out += self._open("function_call", tc)
            args = tc.get("function", {}).get("arguments", "")
            if args and self.open is not None and self.open["type"] == "function_call":
                self.open["arguments"] += args
                out += self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                  output_index=len(self.output) - 1, delta=args)
        return out

    def finish(self, reason: str, usage: dict) -> str:
        """The closing events: the open item done, then the terminal event with the whole response."""
        status, incomplete = status_of(reason)
        out = ""
        if not self.output:  # nothing came out: one empty message
            out += self._open("message")
        out += self._close("completed" if status == "completed" else "incomplete")
        response = self.builder.response(status, self.output, usage, incomplete)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(status, "response.failed")
        return out + self.event(kind, response=response)

    def error(self, message: str) -> str:
        """An `error` event (the engine died or the server is shutting down), then response.failed."""
        out = self.event("error", code="server_error", message=message, param=None)
        return out + self.event("response.failed", response=self.builder.response("failed", self.output))

    # ---- the items ----------------------------------------------------------------------

    def _open(self, kind: str, call: dict | None = None) -> str:
        """Open an item of `kind` (closing the one before), unless it is the open one."""
        if self.open is not None and self.open["type"] == kind and kind != "function_call":
            return ""
        out = self._close("completed")
        if kind == "reasoning":
            item = reasoning_item("", "in_progress")
            item["content"] = []
        elif kind == "message":
            item = message_item("", "in_progress")
            item["content"] = []
        else:
            fn = call.get("function", {})
            item = call_item(call["id"], fn.get("name", ""), "", "in_progress")
        self.open = item
        self.output.append(item)
        index = len(self.output) - 1
        out += self.event("response.output_item.added", output_index=index, item=copy.deepcopy(item))
        if kind != "function_call":
            part = text_part("") if kind == "message" else {"type": "reasoning_text", "text": ""}
            item["content"].append(part)
            out += self.event("response.content_part.added", item_id=item["id"], output_index=index,
                              content_index=0, part=copy.deepcopy(part))
        return out

    def _text_delta(self, kind: str, text: str, **extra: Any) -> str:
        item = self.open
        item["content"][0]["text"] += text
        return self.event(kind, item_id=item["id"], output_index=len(self.output) - 1, content_index=0, delta=text,
                          **extra)

    def _close(self, status: str) -> str:
        """The done events of the open item (none open: nothing)."""
        item, self.open = self.open, None
        if item is None:
            return ""
        index, out = len(self.output) - 1, ""
        item["status"] = status
        if item["type"] == "function_call":
            out += self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                              name=item["name"], arguments=item["arguments"])
        else:
            part = item["content"][0]
            kind = "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done"
            extra = {"logprobs": []} if item["type"] == "message" else {}
            out += self.event(kind, item_id=item["id"], output_index=index, content_index=0, text=part["text"],
                              **extra)
            out += self.event("response.content_part.done", item_id=item["id"], output_index=index,
                              content_index=0, part=copy.deepcopy(part))
        return out + self.event("response.output_item.done", output_index=index, item=copy.deepcopy(item))
