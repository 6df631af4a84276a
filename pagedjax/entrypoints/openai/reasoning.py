"""Reasoning parsers (`--reasoning-parser`): split a thinking model's output into its
reasoning (the `<think>...</think>` span) and its content, for `reasoning_content` on
/v1/chat/completions and the reasoning items of /v1/responses.

The two parsers, and what they do with each shape of output:

| output                                   | `qwen3`                    | `deepseek_r1`              |
|------------------------------------------|----------------------------|----------------------------|
| `<think>R</think>C`                      | reasoning R, content C     | reasoning R, content C     |
| `R</think>C` (the prompt opened `<think>`)| reasoning R, content C     | reasoning R, content C     |
| `R</think>C` (the prompt did not)        | content, all of it         | reasoning R, content C     |
| `<think>R` (cut before `</think>`)       | reasoning R, no content    | reasoning R, no content    |
| `C` (no tags at all)                     | content C                  | reasoning C, no content    |

So `deepseek_r1` always starts inside the reasoning (DeepSeek-R1's template opens `<think>`
in the prompt; as vLLM's, an output that never closes it is all reasoning), while `qwen3`
starts in the content and enters the reasoning only where the output opens with `<think>` or
the rendered prompt ends with an open `<think>` (Qwen3 "thinking" templates; with
`enable_thinking` false the template closes an empty think span itself, and the output is
all content). Unlike vLLM's qwen3 parser, an output cut inside its reasoning is reasoning
in both modes: streamed deltas cannot be taken back, so the whole answer says what the
stream said. Only a leading `<think>` opens the reasoning; after `</think>` everything is
content (a later tag included). The reasoning is stripped of surrounding blanks and the
content of the blanks that follow `</think>`; output without reasoning is left as it is.

Streaming (one `ReasoningStream` per choice) gives exactly the non-streamed split, however
the text is cut into deltas: a tail that may be the start of a tag, and blanks that may end
the reasoning, are held back until the next delta decides them.
"""
from __future__ import annotations

REASONING_PARSERS = ("deepseek_r1", "qwen3")
THINK_START, THINK_END = "<think>", "</think>"
_OPENING, _REASONING, _AFTER, _CONTENT = range(4)  # the stream's states


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper prefix of `tag`."""
    return next((k for k in range(min(len(text), len(tag) - 1), 0, -1) if text.endswith(tag[:k])), 0)


class ReasoningParser:
    """The `--reasoning-parser NAME` of a server: which state a model's output starts in and
    how it is split (the table above). Stateless; `stream()` gives a choice's state."""

    def __init__(self, name: str) -> None:
        if name not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r} (choose from: {', '.join(REASONING_PARSERS)})")
        self.name = name
        self.starts_inside = name == "deepseek_r1"

    def starts_in_reasoning(self, prompt_tail: str) -> bool:
        """Whether an output of the prompt ending in `prompt_tail` (its last few tokens, as
        text) starts inside the reasoning."""
        tail = prompt_tail.rstrip()
        return self.starts_inside or (tail.endswith(THINK_START) and THINK_END not in tail)

    def stream(self, in_reasoning: bool = False) -> ReasoningStream:
        """The per-choice state of one streamed output (`in_reasoning`: the prompt opened the
        reasoning; always so for deepseek_r1)."""
        return ReasoningStream(in_reasoning or self.starts_inside)

    def split(self, text: str, in_reasoning: bool = False) -> tuple[str | None, str]:
        """(reasoning or None, content) of a whole output."""
        reasoning, content = self.stream(in_reasoning).feed(text, final=True)
        return reasoning or None, content


class ReasoningStream:
    """One output's split, fed delta by delta: `feed` returns the (reasoning, content) text
    each delta releases; the concatenations equal `ReasoningParser.split` of the whole."""

    def __init__(self, in_reasoning: bool) -> None:
        self.state = _OPENING  # until it is known whether the output opens with <think>
        self.default = _REASONING if in_reasoning else _CONTENT  # where an output without <think> starts
        self.buf = ""  # text not released yet
        self.blanks = ""  # reasoning: trailing blanks held until more reasoning follows
        self.started = False  # reasoning: something but blanks released

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """The (reasoning, content) released by the new `text`; `final`: the output ends here."""
        self.buf += text
        reasoning = content = ""
        while True:
            if self.state == _OPENING:
                rest = self.buf.lstrip()
                if rest.startswith(THINK_START):
                    self.buf, self.state = rest[len(THINK_START):], _REASONING
                elif final or not THINK_START.startswith(rest):
                    self.state = self.default  # the held text goes where the output starts
                else:
                    break  # blanks, or the start of a tag: wait for more
            elif self.state == _REASONING:
                end = self.buf.find(THINK_END)
                if end >= 0:
                    reasoning += self._reasoning(self.buf[:end], closing=True)
                    self.buf, self.state = self.buf[end + len(THINK_END):], _AFTER
                    continue
                keep = 0 if final else _partial_suffix(self.buf, THINK_END)
                piece, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                reasoning += self._reasoning(piece, closing=final)
                break
            elif self.state == _AFTER:  # the blanks after </think> are dropped
                rest = self.buf.lstrip()
                self.buf = rest
                if not rest:
                    break
                self.state = _CONTENT
            else:
                content, self.buf = content + self.buf, ""
                break
        return reasoning, content

    def _reasoning(self, piece: str, closing: bool) -> str:
        """What of the reasoning text `piece` can go out now: blanks at the reasoning's start
        are dropped, blanks at its end held (dropped when it closes)."""
        text = self.blanks + piece
        if not self.started:
            text = text.lstrip()
        body = text.rstrip()
        self.blanks = "" if closing else text[len(body):]
        self.started = self.started or bool(body)
        return body
