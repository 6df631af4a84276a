"""/v1/responses requests as chat requests: the Responses API runs on the chat path
(serving_chat.py), so templates, tools, structured outputs and sampling behave the same.

- `instructions` -> a leading system message; message items -> messages (their text parts
  joined; role "developer" as "system", the role chat templates know); function_call items -> the tool calls of an assistant message (merged into the
  assistant message just before them); function_call_output items -> tool messages;
  reasoning items are dropped (chat templates drop earlier turns' thinking).
- function tools -> chat tools; `tool_choice` {"type": "function", "name"} -> a named choice;
  `text.format` -> `response_format`; `max_output_tokens` -> `max_completion_tokens`.
"""
from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from pagedjax.entrypoints.openai.errors import APIError, bad_request
from pagedjax.entrypoints.openai.protocol import ChatCompletionRequest
from pagedjax.entrypoints.openai.responses_protocol import (FunctionCallItem, FunctionCallOutputItem, MessageItem,
                                                            ReasoningItem, ResponsesRequest, TextFormatJSONObject,
                                                            TextFormatJSONSchema)

# a sampling request's unsupported fields: only their null (or the default) is accepted
UNSUPPORTED = {
    "previous_response_id": "`previous_response_id` is not supported: this server stores no responses (`store` "
                            "is accepted and nothing is kept); send the whole conversation in `input`",
    "conversation": "`conversation` is not supported: this server stores no conversations; send the whole "
                    "conversation in `input`",
    "background": "background responses are not supported (they need stored responses): leave `background` false",
    "prompt": "stored prompt templates are not supported: send the prompt in `input` / `instructions`",
    "max_tool_calls": "`max_tool_calls` is not supported",
    "top_logprobs": "logprobs are not supported on /v1/responses (use /v1/chat/completions)",
}
INCLUDABLE = ("reasoning.encrypted_content",)  # asked for by stateless clients: reasoning items carry their text


def check_supported(req: ResponsesRequest) -> None:
    """400 for the parts of the Responses API this server does not implement."""
    for name, why in UNSUPPORTED.items():
        value = getattr(req, name)
        if value is not None and value is not False and not (name == "top_logprobs" and value == 0):
            raise bad_request(why, name)
    if req.truncation == "auto":
        raise bad_request("`truncation: \"auto\"` is not supported: a prompt longer than the model's context "
                          "is a 400", "truncation")
    bad = next((i for i, v in enumerate(req.include or ()) if v not in INCLUDABLE), None)
    if bad is not None:
        raise bad_request(f"`include` value {req.include[bad][:64]!r} is not supported (supported: "
                          f"{', '.join(INCLUDABLE)})", f"include[{bad}]")
    r = req.reasoning
    if r is not None and (r.effort, r.summary, r.generate_summary) != (None, None, None):
        raise bad_request("`reasoning` options are not supported: the model thinks as its chat template says, and "
                          "a server started with --reasoning-parser returns the thinking as reasoning items",
                          "reasoning")
    if req.text is not None and req.text.verbosity is not None:
        raise bad_request("`text.verbosity` is not supported", "text.verbosity")


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that `req` runs as."""
    body: dict[str, Any] = {"messages": messages(req), "stream": bool(req.stream)}
    for name, value in (("model", req.model), ("temperature", req.temperature), ("top_p", req.top_p),
                        ("max_completion_tokens", req.max_output_tokens),
                        ("parallel_tool_calls", req.parallel_tool_calls)):
        if value is not None:
            body[name] = value
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        body["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                       "function": {"name": choice.name}}
    fmt = req.text.format if req.text is not None else None
    if isinstance(fmt, TextFormatJSONObject):
        body["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, TextFormatJSONSchema):
        schema = {"name": fmt.name, "schema": fmt.schema_, "description": fmt.description, "strict": fmt.strict}
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {k: v for k, v in schema.items() if v is not None}}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:  # a bound the chat request has and the Responses one lacks
        first = exc.errors(include_url=False, include_input=False)[0]
        raise bad_request(f"invalid request: {first['msg']}") from None


def messages(req: ResponsesRequest) -> list[dict]:
    """The chat messages of `instructions` and `input`."""
    out: list[dict] = []
    if req.instructions:
        out.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        out.append({"role": "user", "content": req.input})
        return out
    calls: set[str] = set()  # the call ids seen so far
    merge = False  # whether the last message is an assistant turn that later calls join
    for i, item in enumerate(req.input):
        if isinstance(item, MessageItem):
            # open models' templates know "system", rarely "developer" (OpenAI's newer name for it)
            out.append({"role": "system" if item.role == "developer" else item.role, "content": _text(item.content)})
            merge = item.role == "assistant"
        elif isinstance(item, FunctionCallItem):
            _check_arguments(item.arguments, f"input[{i}].arguments")
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if not merge:
                out.append({"role": "assistant", "content": None})
            out[-1].setdefault("tool_calls", []).append(call)
            calls.add(item.call_id)
            merge = True
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in calls:
                raise bad_request(f"no function_call item before this output has the call_id {item.call_id!r}",
                                  f"input[{i}].call_id")
            output = item.output if isinstance(item.output, str) else "".join(p.text for p in item.output)
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
            merge = False
        else:
            assert isinstance(item, ReasoningItem)
    if not out:
        raise bad_request("`input` has no message", "input")
    return out


def _text(content) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.refusal if p.type == "refusal" else p.text for p in content)


def _check_arguments(arguments: str, param: str) -> None:
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except (ValueError, RecursionError):
        value = None
    if not isinstance(value, dict):
        raise bad_request("a function call's `arguments` must be the JSON text of an object", param)


# chat field names in the chat path's errors -> the Responses request's names
_RENAMES = {"max_completion_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input",
            "tool_choice.function.name": "tool_choice.name"}


def renamed(exc: APIError) -> APIError:
    """A chat-path error with the Responses request's field names."""
    message = exc.message
    for old, new in _RENAMES.items():
        message = message.replace(f"`{old}`", f"`{new}`")
    param = exc.param
    if param is not None:
        head = next((k for k in sorted(_RENAMES, key=len, reverse=True) if param == k or param.startswith(k + "[")
                     or param.startswith(k + ".")), None)
        if head is not None:
            param = "input" if head == "messages" else _RENAMES[head] + param[len(head):]
    return APIError(message, exc.status, exc.type, param, exc.code, exc.headers)
