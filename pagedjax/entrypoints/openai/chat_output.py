"""A chat completion's output text -> the parts of its message: the reasoning split off first
(reasoning.py, with `--reasoning-parser`), then tool calls parsed from the content after it
(tool_calls.py), so a call written inside the reasoning is never parsed, nor run by a client.

The same parsers run for a stream (`deltas`, delta by delta) and for a whole output
(`message`), so a streamed answer accumulates to the non-streamed one. /v1/chat/completions
and /v1/responses both build their answers from these parts.
"""
from __future__ import annotations

from pagedjax.entrypoints.openai.reasoning import ReasoningParser, ReasoningStream
from pagedjax.entrypoints.openai.response_bodies import ToolCall
from pagedjax.entrypoints.openai.tool_calls import ToolPlan, ToolStreams

Delta = dict  # {"reasoning_content"?: str, "content"?: str | None, "tool_calls"?: [...]}


class OutputParser:
    """The parsers of one request's choices. `tools`: the request's tool plan (None: no
    tools); `reasoning`: the server's reasoning parser (None: off, or the output is
    constrained); `in_reasoning`: whether the output starts inside the reasoning."""

    def __init__(self, tools: ToolPlan | None, reasoning: ReasoningParser | None, in_reasoning: bool = False) -> None:
        self.tools = tools if tools is not None and tools.parses else None
        self.reasoning, self.in_reasoning = reasoning, in_reasoning
        self.tool_streams = ToolStreams(self.tools) if self.tools is not None else None
        self.thinking: dict[int, ReasoningStream] = {}

    def deltas(self, index: int, text: str, reason: str | None) -> list[tuple[Delta, str | None]]:
        """The (delta fields, finish_reason) chunks of choice `index` for its new `text` (and
        its end, when `reason` is set)."""
        thought = ""
        if self.reasoning is not None:
            stream = self.thinking.get(index)
            if stream is None:
                stream = self.thinking[index] = self.reasoning.stream(self.in_reasoning)
            thought, text = stream.feed(text, final=reason is not None)
        if self.tool_streams is None:
            parts: list[tuple[Delta, str | None]] = [({"content": text or None}, reason)]
        else:
            parts = self.tool_streams.deltas(index, text, reason)
        if thought:
            parts[0] = ({"reasoning_content": thought, **parts[0][0]}, parts[0][1])
        return parts

    def message(self, text: str, reason: str) -> tuple[str | None, str | None, list[ToolCall] | None, str]:
        """(reasoning, content, tool calls, finish_reason) of a whole output. Without any
        parser the content is the text as it is ("" included)."""
        thought, content = (None, text) if self.reasoning is None else self.reasoning.split(text, self.in_reasoning)
        calls = None
        if self.tools is not None:
            content, calls, reason = self.tools.message(content, reason)
        elif thought is not None and not content:
            content = None
        return thought, content, calls, reason
