"""Pydantic models of the OpenAI requests the server accepts (the answers: `response_bodies.py`).

Requests are strict (no silent type coercion) and forbid unknown fields, so a field the
engine does not understand is a 400 that names it instead of being dropped. Every number is
bounded to what the engine represents, and every list stops at its first bad element
(`fail_fast`), so a huge malformed array costs one error, not one per element.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WrapValidator

from pagedjax.entrypoints.chat_template import MAX_CHAT_TEMPLATE_KWARGS
from pagedjax.sampling_params import (MAX_BIAS, MAX_INT32, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_REPETITION_PENALTY,
                                      MAX_STOP_LENGTH, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TOKEN_LISTS)

MAX_N = 64  # completions per prompt
MAX_SEED = 2**63 - 1
MAX_SALT_LENGTH = 256
MAX_LENGTH_PENALTY = 10.0  # scores divide by length ** length_penalty: bounded so it never overflows

TokenId = Annotated[int, Field(ge=0, le=MAX_INT32)]
TokenIds = Annotated[list[TokenId], Field(fail_fast=True)]
StopString = Annotated[str, Field(max_length=MAX_STOP_LENGTH)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def _bounded_dict(max_items: int):
    """A dict validator that checks the size first and reports only the first bad entry (a
    dict has no `fail_fast`: a huge malformed object must not cost one error per entry)."""

    def validate(value, handler):
        if isinstance(value, dict) and len(value) > max_items:
            raise ValueError(f"at most {max_items} entries are allowed, got {len(value)}")
        try:
            return handler(value)
        except ValidationError as exc:
            first = exc.errors(include_url=False, include_input=False)[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ValueError(f"{where}: {first['msg']}" if where else first["msg"]) from None

    return WrapValidator(validate)


# OpenAI: token ids (as JSON object keys) to a bias in [-100, 100]
LogitBias = Annotated[dict[Annotated[str, Field(pattern=r"^[0-9]{1,10}$")],
                           Annotated[float, Field(ge=-MAX_BIAS, le=MAX_BIAS)]],
                      Field(max_length=MAX_LOGIT_BIAS), _bounded_dict(MAX_LOGIT_BIAS)]
MAX_CHOICES = 1024  # strings of a `choice` constraint
Choices = Annotated[list[Annotated[str, Field(max_length=MAX_STOP_LENGTH * 16)]],
                    Field(min_length=1, max_length=MAX_CHOICES, fail_fast=True)]
JsonSchema = dict[str, Any]


class JSONSchemaFormat(_Request):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: JsonSchema | None = Field(None, alias="schema")  # none: any JSON object
    strict: bool | None = None  # the output always follows the schema here


class ResponseFormatText(_Request):
    type: Literal["text"]


class ResponseFormatJSONObject(_Request):
    type: Literal["json_object"]


class ResponseFormatJSONSchema(_Request):
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


ResponseFormat = Annotated[ResponseFormatText | ResponseFormatJSONObject | ResponseFormatJSONSchema,
                           Field(discriminator="type")]


class StructuredOutputsRequest(_Request):
    """vLLM's `structured_outputs`: exactly one constraint."""

    json_: JsonSchema | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: Choices | None = None
    grammar: str | None = None


class StreamOptions(_Request):
    include_usage: bool | None = False


class _SamplingRequest(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int | None = Field(1, ge=1, le=MAX_N)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS, fail_fast=True)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    user: str | None = None  # ignored
    logit_bias: LogitBias | None = None
    response_format: ResponseFormat | None = None
    # extra (non-OpenAI) sampling fields
    top_k: int | None = Field(None, ge=-1, le=MAX_INT32)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    ignore_eos: bool | None = False
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS, fail_fast=True)] | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_SALT_LENGTH)  # keeps tenants' prefixes apart
    repetition_penalty: float | None = Field(None, gt=0.0, le=MAX_REPETITION_PENALTY)
    min_tokens: int | None = Field(None, ge=0, le=MAX_INT32)
    bad_words: Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_LENGTH)]],
                         Field(max_length=MAX_TOKEN_LISTS, fail_fast=True)] | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=MAX_TOKEN_LISTS,
                                                      fail_fast=True)] | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # vLLM's older names of structured_outputs' fields
    guided_json: JsonSchema | str | None = None
    guided_regex: str | None = None
    guided_choice: Choices | None = None
    guided_grammar: str | None = None
    # beam search (vLLM): n beams, returned best first; deterministic, so temperature, top_p,
    # top_k, min_p and seed are ignored
    use_beam_search: bool | None = False
    length_penalty: float | None = Field(1.0, ge=-MAX_LENGTH_PENALTY, le=MAX_LENGTH_PENALTY)
    early_stopping: bool | Literal["never"] | None = False
    # vLLM: a stop string that ended the output stays in its text
    include_stop_str_in_output: bool | None = False
    # vLLM: keep only the prompt's last k tokens (-1: the last max_model_len); checked against max_model_len
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=MAX_INT32)
    # vLLM: logprobs name tokens `token_id:N` (tokens that are not valid UTF-8 alone stay telling)
    return_tokens_as_token_ids: bool | None = None


class CompletionRequest(_SamplingRequest):
    prompt: str | Annotated[list[str], Field(fail_fast=True)] | TokenIds | Annotated[list[TokenIds], Field(fail_fast=True)]
    max_tokens: int | None = Field(16, ge=0, le=MAX_INT32)  # 0: only with echo or prompt_logprobs (scoring)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    suffix: str | None = None  # accepted only when empty
    best_of: int | None = None  # accepted only when equal to n
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM


class TextPart(_Request):
    type: Literal["text"]
    text: str


# ---- tools (their checks and logic: tool_calls.py) ----
MAX_TOOLS = 128  # OpenAI's limit of tools per request
MAX_TOOL_CALLS = 128  # tool calls per assistant message
MAX_ID_LENGTH = 256  # tool call ids
ToolName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]  # OpenAI's rule for function names


class FunctionDefinition(_Request):
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object; none: no arguments
    strict: bool | None = None  # required/named calls always follow the schema here


class ChatTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Request):
    name: str = Field(max_length=MAX_ID_LENGTH)  # not in `tools`: a 400 that names it


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: FunctionName


class FunctionCallParam(_Request):
    name: str = Field(max_length=MAX_ID_LENGTH)
    arguments: str  # JSON text of an object, as the API returned it


class ToolCallParam(_Request):
    id: str = Field(max_length=MAX_ID_LENGTH)
    type: Literal["function"]
    function: FunctionCallParam


class ChatMessage(_Request):
    """One message; which fields each role needs is checked in tool_calls.template_messages."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(fail_fast=True)] | None = None  # null: assistant tool calls
    name: str | None = None
    tool_calls: Annotated[list[ToolCallParam], Field(max_length=MAX_TOOL_CALLS, fail_fast=True)] | None = None
    tool_call_id: str | None = Field(None, max_length=MAX_ID_LENGTH)  # role "tool": the call it answers


class Prediction(_Request):
    type: Literal["content"]
    content: str | Annotated[list[TextPart], Field(fail_fast=True)]


class PromptCacheOptions(_Request):
    mode: Literal["implicit", "explicit"] | None = None
    ttl: Literal["30m"] | None = None


class _ChatNoOpFields(_Request):
    """OpenAI chat fields that cannot change a local engine's result: accepted and ignored.
    (Fields that would change it, such as reasoning_effort, verbosity or web_search_options,
    stay unknown and are a 400 that names them.)"""

    store: bool | None = None
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                        Field(max_length=16), _bounded_dict(16)] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = None
    safety_identifier: str | None = Field(None, max_length=MAX_SALT_LENGTH)
    prompt_cache_key: str | None = Field(None, max_length=MAX_SALT_LENGTH)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    prediction: Prediction | None = None  # predicted outputs speed OpenAI up, never change the answer
    modalities: Annotated[list[Literal["text"]], Field(max_length=2, fail_fast=True)] | None = None  # text only
    audio: None = None  # audio output: only null


# extra variables of the chat template; names as Python identifiers, the renderer's own refused (chat_template.py)
ChatTemplateKwargs = Annotated[dict[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")], Any],
                               Field(max_length=MAX_CHAT_TEMPLATE_KWARGS), _bounded_dict(MAX_CHAT_TEMPLATE_KWARGS)]


class ChatCompletionRequest(_SamplingRequest, _ChatNoOpFields):
    messages: list[ChatMessage] = Field(min_length=1, fail_fast=True)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Annotated[list[ChatTool], Field(max_length=MAX_TOOLS, fail_fast=True)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # default: auto with tools
    parallel_tool_calls: bool | None = None  # default true
    # vLLM: the chat template's options (chat_template.render_chat)
    add_generation_prompt: bool | None = True  # open the assistant's turn
    continue_final_message: bool | None = False  # continue the final assistant message (add_generation_prompt false)
    chat_template_kwargs: ChatTemplateKwargs | None = None  # extra template variables, e.g. {"enable_thinking": false}


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a `prompt`, or chat `messages` rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, fail_fast=True)
    add_generation_prompt: bool | None = True  # messages only
    continue_final_message: bool | None = False  # messages only, as in chat requests
    chat_template_kwargs: ChatTemplateKwargs | None = None  # messages only
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (the template adds them)
    return_token_strs: bool | None = False


class LoadLoRAAdapterRequest(_Request):
    """vLLM's /v1/load_lora_adapter: serve the PEFT adapter at `lora_path` as model `lora_name`."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(_Request):
    """vLLM's /v1/unload_lora_adapter: stop serving the adapter called `lora_name`."""

    lora_name: str = Field(min_length=1)


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: TokenIds


class EmbeddingRequest(_Request):
    """OpenAI's /v1/embeddings: a string, strings, token ids or lists of token ids."""

    model: str | None = None
    input: str | Annotated[list[str], Field(fail_fast=True)] | TokenIds | Annotated[list[TokenIds], Field(fail_fast=True)]
    encoding_format: Literal["float", "base64"] | None = "float"  # base64: little-endian float32 bytes
    dimensions: int | None = Field(None, le=MAX_INT32)  # the first `dimensions` values, renormalized
    user: str | None = None  # ignored
