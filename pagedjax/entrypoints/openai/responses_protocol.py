"""Pydantic models of the /v1/responses request (OpenAI's Responses API, its core).

Strict as `protocol.py`: unknown fields are a 400 that names them. Fields a client may send
that this server cannot honour (stored responses, built-in tools, background runs...) are
declared so that their null or default is accepted and anything else answered with a 400
that says why (serving_responses.check_supported).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator

from pagedjax.sampling_params import MAX_INT32
from pagedjax.entrypoints.openai.protocol import (MAX_ID_LENGTH, MAX_SALT_LENGTH, MAX_TOOLS, FunctionDefinition,
                                                  _bounded_dict, _Request)

Status = Literal["in_progress", "completed", "incomplete"]
MAX_ITEMS = 4096  # input items per request


class InputText(_Request):
    type: Literal["input_text"]
    text: str
    prompt_cache_breakpoint: dict[str, Any] | None = None  # a prompt-caching hint: ignored


class OutputText(_Request):
    """An earlier answer's text, as a response's output gives it (annotations ignored)."""

    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]] | None = None
    logprobs: list[dict[str, Any]] | None = None


class Refusal(_Request):
    type: Literal["refusal"]
    refusal: str


PART_TYPES = ("input_text", "output_text", "refusal")


def _part_type(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in PART_TYPES else None


ContentPart = Annotated[
    Annotated[InputText, Tag("input_text")] | Annotated[OutputText, Tag("output_text")]
    | Annotated[Refusal, Tag("refusal")],
    Discriminator(_part_type, custom_error_type="invalid_content_part",
                  custom_error_message="a content part must be an object whose `type` is one of "
                  + ", ".join(PART_TYPES) + " (this server serves text-only models: no input_image, input_file "
                  "or input_audio)")]


class MessageItem(_Request):
    """A message: `{"role", "content"}` (the "easy" form) or a response's output message."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | Annotated[list[ContentPart], Field(fail_fast=True)]
    id: str | None = Field(None, max_length=MAX_ID_LENGTH)
    status: Status | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallItem(_Request):
    """A function call of an earlier response, fed back with its output."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=MAX_ID_LENGTH)
    name: str = Field(max_length=MAX_ID_LENGTH)
    arguments: str  # JSON text of an object
    id: str | None = Field(None, max_length=MAX_ID_LENGTH)
    status: Status | None = None


class FunctionCallOutputItem(_Request):
    """The result of running a function call (the call it answers: `call_id`)."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=MAX_ID_LENGTH)
    output: str | Annotated[list[InputText], Field(fail_fast=True)]
    id: str | None = Field(None, max_length=MAX_ID_LENGTH)
    status: Status | None = None


class SummaryText(_Request):
    type: Literal["summary_text"]
    text: str


class ReasoningText(_Request):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(_Request):
    """An earlier response's reasoning: accepted and left out of the prompt (chat templates
    drop earlier turns' thinking)."""

    type: Literal["reasoning"]
    id: str | None = Field(None, max_length=MAX_ID_LENGTH)
    summary: list[SummaryText] = []
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: Status | None = None


ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def _item_type(value: Any) -> str | None:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in ITEM_TYPES else None


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type, custom_error_type="invalid_item",
                  custom_error_message="an input item must be an object whose `type` is one of " + ", ".join(ITEM_TYPES)
                  + " (this server stores nothing, so `item_reference` is not supported)")]


class FunctionTool(FunctionDefinition):
    """A function tool in the Responses shape: the chat API's function definition, flat."""
    type: Literal["function"]


class ToolChoiceFunction(_Request):
    type: Literal["function"]
    name: str = Field(max_length=MAX_ID_LENGTH)


class TextFormatText(_Request):
    type: Literal["text"]


class TextFormatJSONObject(_Request):
    type: Literal["json_object"]


class TextFormatJSONSchema(_Request):
    type: Literal["json_schema"]
    name: str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None  # the output always follows the schema here


TextFormat = Annotated[TextFormatText | TextFormatJSONObject | TextFormatJSONSchema, Field(discriminator="type")]


class TextConfig(_Request):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # not supported: only null


class ReasoningConfig(_Request):
    """OpenAI's reasoning options: not supported (only nulls); a model here thinks as its
    chat template says, and `--reasoning-parser` returns the thinking."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesStreamOptions(_Request):
    include_obfuscation: bool | None = None  # no obfuscation padding is sent: ignored


class ResponsesRequest(_Request):
    """POST /v1/responses."""

    model: str | None = None
    input: str | Annotated[list[InputItem], Field(max_length=MAX_ITEMS, fail_fast=True)]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS, fail_fast=True)] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None  # default true
    text: TextConfig | None = None
    stream: bool | None = False
    stream_options: ResponsesStreamOptions | None = None
    # accepted, with no effect on the answer
    store: bool | None = None  # nothing is stored, whatever it says (docs/responses.md)
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                        Field(max_length=16), _bounded_dict(16)] | None = None  # echoed in the response
    user: str | None = None
    safety_identifier: str | None = Field(None, max_length=MAX_SALT_LENGTH)
    prompt_cache_key: str | None = Field(None, max_length=MAX_SALT_LENGTH)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = None
    # not supported: only their null (or the default) is accepted (serving_responses.check_supported)
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    prompt: dict[str, Any] | None = None
    include: list[str] | None = None
    reasoning: ReasoningConfig | None = None
    truncation: Literal["auto", "disabled"] | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, tools: Any) -> Any:
        """A built-in tool (web_search, file_search, ...) is named as such, not as a shape error."""
        for i, tool in enumerate(tools if isinstance(tools, list) else ()):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if isinstance(kind, str) and kind != "function":
                raise ValueError(f"tools[{i}] is the built-in tool {kind[:64]!r}: this server runs no tools itself; "
                                 "only function tools ({\"type\": \"function\", \"name\", \"parameters\"}) are supported")
        return tools

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice_only(cls, choice: Any) -> Any:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if isinstance(kind, str) and kind != "function":
            raise ValueError(f"a `tool_choice` of type {kind[:64]!r} is not supported: use \"none\", \"auto\", "
                             "\"required\" or {\"type\": \"function\", \"name\": ...}")
        return choice
