"""Chat prompts: messages rendered with a chat template. The one helper behind `LLM.chat`,
the server's /v1/chat/completions and /tokenize, and `pagedjax generate --chat`.

`render_chat` checks the options as vLLM does (continue_final_message extends a final
assistant message and cannot go with add_generation_prompt; chat_template_kwargs may not
override the renderer's own arguments) and renders with the tokenizer's template, or the
one given (`load_chat_template`: a Jinja file path or the template text itself).
"""
from __future__ import annotations

import inspect
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

MAX_CHAT_TEMPLATE_KWARGS = 64  # entries of chat_template_kwargs


class ChatTemplateError(ValueError):
    """A request the chat template cannot render; `param` names the argument at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def load_chat_template(value: str | os.PathLike | None) -> str | None:
    """A chat template given as a file path or as inline Jinja text -> the template text
    (None stays None: the tokenizer's own). ValueError for a path that is no file and text
    that is no Jinja template, or a template that does not compile."""
    if value is None:
        return None
    text = str(value)
    try:
        path = Path(text).expanduser()
        is_file = path.is_file()
    except (OSError, ValueError):  # e.g. a long inline template is no valid file name
        is_file = False
    if is_file:
        text = path.read_text()
    elif isinstance(value, os.PathLike) or not ("{{" in text or "{%" in text):
        raise ValueError(f"chat template {text[:200]!r} is neither a file nor a Jinja template (no '{{{{' or '{{%')")
    _check_compiles(text)
    return text


def _check_compiles(template: str) -> None:
    """ValueError for a template that is not valid Jinja (as transformers compiles it)."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # another transformers layout: the first render reports it
        return
    try:
        _compile_jinja_template(template)
    except ImportError:
        raise
    except Exception as exc:
        raise ValueError(f"the chat template is not a valid Jinja template: {exc}") from None


def conversation(messages: Sequence[Mapping], where: str = "messages") -> list[dict]:
    """Python-API messages (dicts with a role and a string content, or content as a list of
    {"type": "text", "text": ...} parts) as plain dicts; ValueError naming the bad one."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError(f"{where} must be a non-empty list of messages (dicts with a role and a content)")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ValueError(f"{where}[{i}] must be a dict with a string `role`, got {type(m).__name__}: {m!r:.100}")
        msg = dict(m)
        content = msg.get("content")
        if isinstance(content, Sequence) and not isinstance(content, str):
            texts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, Mapping) else None
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"{where}[{i}].content[{j}]: only text parts ({{'type': 'text', 'text': ...}}) "
                                     f"are supported (pagedjax serves text models), got {part!r:.100}")
                texts.append(part["text"])
            msg["content"] = "".join(texts)
        elif content is not None and not isinstance(content, str):
            raise ValueError(f"{where}[{i}].content must be a string or a list of text parts, got "
                             f"{type(content).__name__}")
        out.append(msg)
    return out


def _renderer_arguments(tokenizer) -> frozenset[str]:
    """Names chat_template_kwargs may not use: apply_chat_template's own parameters and the
    template's `messages`."""
    try:
        names = set(inspect.signature(tokenizer.apply_chat_template).parameters)
    except (TypeError, ValueError):
        names = set()
    return frozenset((names | {"messages", "conversation", "tools", "chat_template", "add_generation_prompt",
                               "continue_final_message", "tokenize"}) - {"kwargs", "self"})


def check_options(messages: list[dict], add_generation_prompt: bool, continue_final_message: bool,
                  chat_template_kwargs: Mapping | None, tokenizer=None) -> dict:
    """The rendering options checked (ChatTemplateError naming the argument); returns the
    template kwargs as a dict."""
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be true: the first "
                                "extends the last (assistant) message, the second starts a new one; set "
                                "add_generation_prompt to false", "continue_final_message")
    if continue_final_message and (not messages or messages[-1].get("role") != "assistant"):
        raise ChatTemplateError("continue_final_message needs the last message to be an assistant message (the text "
                                "the model continues)", "continue_final_message")
    if chat_template_kwargs is None:
        return {}
    if not isinstance(chat_template_kwargs, Mapping) or not all(isinstance(k, str) for k in chat_template_kwargs):
        raise ChatTemplateError("chat_template_kwargs must be a dict with string keys", "chat_template_kwargs")
    if len(chat_template_kwargs) > MAX_CHAT_TEMPLATE_KWARGS:
        raise ChatTemplateError(f"chat_template_kwargs may hold at most {MAX_CHAT_TEMPLATE_KWARGS} entries, got "
                                f"{len(chat_template_kwargs)}", "chat_template_kwargs")
    taken = sorted(set(chat_template_kwargs) & _renderer_arguments(tokenizer))
    if taken:
        raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(taken)}: the renderer's own arguments "
                                "(give those as arguments or request fields of their own)", "chat_template_kwargs")
    return dict(chat_template_kwargs)


def render_chat(tokenizer, messages: list[dict], *, chat_template: str | None = None, tools: list[dict] | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                chat_template_kwargs: Mapping | None = None) -> str:
    """The prompt text of `messages` (dicts as chat templates take them): the tokenizer's chat
    template, or `chat_template` (template text), rendered with the tools and the template
    kwargs. ChatTemplateError (a ValueError naming the argument) for options that do not go
    together, a model without a template, or a template that rejects the messages;
    ImportError when no template engine (jinja2) is installed."""
    if tokenizer is None:
        raise ChatTemplateError("this model has no tokenizer, so it has no chat template: give token-id prompts",
                                "messages")
    kwargs = check_options(messages, add_generation_prompt, continue_final_message, chat_template_kwargs, tokenizer)
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("this model has no chat template; give one (chat_template: a Jinja file or the "
                                "template text) or plain prompts", "chat_template")
    try:
        return tokenizer.apply_chat_template(messages, tools=tools or None, chat_template=chat_template,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, tokenize=False, **kwargs)
    except ImportError:
        raise
    except Exception as exc:  # jinja errors, raise_exception() in the template, continue_final_message not found
        raise ChatTemplateError(f"the chat template rejected the messages: {exc}", "messages") from None


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    """Token ids of a rendered chat prompt: the template wrote the special tokens itself."""
    return tokenizer.encode(text, add_special_tokens=False)


def render_conversations(tokenizer, conversations: Sequence[Any], **options) -> list[tuple[str, list[int]]]:
    """(text, token ids) of each conversation (LLM.chat's messages: one conversation, a list of
    message dicts, or a list of them)."""
    if isinstance(conversations, Sequence) and conversations and all(
            isinstance(c, Sequence) and not isinstance(c, (str, bytes)) for c in conversations):
        many = [conversation(c, f"messages[{i}]") for i, c in enumerate(conversations)]
    else:
        many = [conversation(conversations)]
    out = []
    for msgs in many:
        text = render_chat(tokenizer, msgs, **options)
        out.append((text, chat_prompt_ids(tokenizer, text)))
    return out
