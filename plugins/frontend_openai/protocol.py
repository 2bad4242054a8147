"""Request bodies of the OpenAI API (the fields corellm implements), as pydantic models.

Unknown fields are rejected, naming the field and the closest known one: a misspelt
``max_token`` silently ignored would generate 16 tokens and leave the user puzzled. Fields of
the OpenAI API that corellm does not implement are accepted only at their neutral value.
Ranges are checked once, by ``SamplingParams``, whose errors name the field; what one request
may ask for in total (samples, stop strings, tokens) by the server against ``frontend.limits``.
These models are the routes' typed bodies, so ``/openapi.json`` describes every field: its
type, that null means the default, and the ranges and neutral values checked later (stated in
the schema only, so that the errors stay the checks' own).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt,
                      model_validator)

from corellm.engine.chat import RESERVED_TEMPLATE_KEYS
from corellm.sampling_params import MAX_LOGPROBS

_I64 = {"format": "int64"}                         # SamplingParams, the processor
_TEXT_256 = {"minLength": 1, "maxLength": 256}       # user, session_id (the processor's bound)
_NOT_RESERVED = {"propertyNames": {"not": {"enum": sorted(RESERVED_TEMPLATE_KEYS)}}}


def _checked(default: Any, **schema: Any) -> Any:
    """A field with a default whose bounds are checked after parsing (by ``SamplingParams``,
    the processor or the server, errors naming the field): ``schema`` states them in the JSON
    schema only."""
    return Field(default, json_schema_extra=schema)


def _null_is_absent(schema: dict[str, Any]) -> None:
    """The JSON schema of a ``_Strict`` model as ``_null_means_default`` reads a body: every
    field with a default takes null, and so does any unknown key (its null is dropped before
    the unknown-field check)."""
    required = set(schema.get("required", ()))
    for name, prop in schema.get("properties", {}).items():
        if name in required:
            continue
        if "enum" in prop and None not in prop["enum"]:
            prop["enum"] = [*prop["enum"], None]
        if "anyOf" in prop:
            if {"type": "null"} not in prop["anyOf"]:
                prop["anyOf"].append({"type": "null"})
        elif "$ref" in prop:
            prop["anyOf"] = [{"$ref": prop.pop("$ref")}, {"type": "null"}]
        elif isinstance(prop.get("type"), str):
            prop["type"] = [prop["type"], "null"]
    schema["additionalProperties"] = {"type": "null"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False,
                              json_schema_extra=_null_is_absent)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # OpenAI clients send explicit nulls for "not set": treat them as absent.
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class StreamOptions(_Strict):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = _checked(False, enum=[False])  # not implemented


class _SamplingFields(_Strict):
    model: str | None = None
    n: StrictInt = _checked(1, minimum=1, **_I64)   # at most frontend.limits.max_samples
    temperature: StrictFloat | None = _checked(None, minimum=0)
    top_p: StrictFloat | None = _checked(None, exclusiveMinimum=0, maximum=1)
    seed: StrictInt | None = _checked(None, **_I64)
    stop: str | list[str] | None = _checked(None, items={"minLength": 1})
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: StrictFloat = _checked(0.0, minimum=-2, maximum=2)
    frequency_penalty: StrictFloat = _checked(0.0, minimum=-2, maximum=2)
    user: str | None = _checked(None, **_TEXT_256)  # tenant, for scheduling policies
    # not implemented: only empty accepted
    logit_bias: dict[str, StrictFloat] | None = _checked(None, maxProperties=0)
    # vLLM's extensions
    top_k: StrictInt | None = _checked(None, minimum=-1, **_I64)
    min_p: StrictFloat | None = _checked(None, minimum=0, maximum=1)
    repetition_penalty: StrictFloat | None = _checked(None, exclusiveMinimum=0, maximum=10)
    min_tokens: StrictInt = _checked(0, minimum=0, **_I64)  # <= max_tokens
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] | None = _checked(None, items={"minimum": 0})
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    priority: StrictInt = _checked(0, **_I64)
    session_id: str | None = _checked(None, **_TEXT_256)  # corellm's: session-aware policies
    cache_salt: str | None = _checked(None, minLength=1)
    # vLLM's: exactly one of json (a schema), json_object, regex, choice, grammar
    structured_outputs: dict[str, Any] | None = _checked(None, properties={
        "json": {"type": ["object", "string"]}, "json_object": {"type": "boolean"},
        "regex": {"type": "string"}, "grammar": {"type": "string"},
        "choice": {"type": "array", "items": {"type": "string"}}})
    # vLLM's: arguments of the server's logits processors (SamplingParams.extra_args)
    vllm_xargs: dict[str, Any] | None = None
    # Echoed in the id of every response (and every chunk of every sample of a stream): bounded
    # like user and session_id, so a client cannot multiply its own bytes into the output.
    request_id: str | None = Field(None, min_length=1, max_length=256)


_TOKEN_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}


class CompletionRequest(_SamplingFields):
    # Each prompt is tokenized by the processor, which rejects an empty one.
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]] = Field(
        json_schema_extra={"anyOf": [
            {"type": "string", "minLength": 1}, _TOKEN_IDS,
            {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
            {"type": "array", "minItems": 1, "items": _TOKEN_IDS}]})
    max_tokens: StrictInt | None = _checked(16, minimum=1, **_I64)
    logprobs: StrictInt | None = _checked(None, minimum=0, maximum=MAX_LOGPROBS)
    echo: StrictBool = _checked(False, enum=[False])         # not implemented: only false
    best_of: StrictInt | None = _checked(None, minimum=1)    # accepted when equal to n
    suffix: str | None = _checked(None, enum=[None])         # not implemented: only null


_TOOL = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"enum": ["function"]},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
        "description": {"type": "string"}, "parameters": {"type": "object"},
        "strict": {"type": "boolean"}}}}}
_NAMED_CHOICE = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"enum": ["function"]},
    "function": {"type": "object", "required": ["name"],
                 "properties": {"name": {"type": "string"}}}}}


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # Extra keys (tool_calls, ...) on history messages are ignored, as OpenAI does.
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    # Deprecated by OpenAI, still sent by many; unbounded here, as max_completion_tokens
    # overrides it (then it is not checked).
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = _checked(None, minimum=1, **_I64)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = _checked(None, minimum=0, maximum=MAX_LOGPROBS)
    # {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema":
    # {"name": ..., "schema": {...}, "strict": ...}}
    response_format: dict[str, Any] | None = _checked(
        None, properties={"type": {"enum": ["text", "json_object", "json_schema"]},
                          "json_schema": {"type": "object"}})
    # OpenAI's function tools, checked by the server (tools.check_tools); tool_choice: none,
    # auto, required or {"type": "function", "function": {"name": ...}}
    tools: list[Any] | None = _checked(None, items=_TOOL)
    tool_choice: Any = _checked(None, anyOf=[{"enum": ["none", "auto", "required"]},
                                             _NAMED_CHOICE])
    parallel_tool_calls: StrictBool | None = None    # false: at most one call
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = _checked(None, **_NOT_RESERVED)


# --------------------------------------------------------------------------- vLLM's extras
class TokenizeCompletionRequest(_Strict):
    """``POST /tokenize`` with a ``prompt``: the ids the model would see for it."""
    model: str | None = None
    prompt: str
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class TokenizeChatRequest(_Strict):
    """``POST /tokenize`` with ``messages``: rendered by the chat template, as
    /v1/chat/completions renders them."""
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    # only false: the template writes them
    add_special_tokens: StrictBool = _checked(False, enum=[False])
    chat_template_kwargs: dict[str, Any] | None = _checked(None, **_NOT_RESERVED)
    tools: list[Any] | None = _checked(None, items=_TOOL)
    return_token_strs: StrictBool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[StrictInt] = Field(json_schema_extra={"items": {"type": "integer",
                                                                 "minimum": 0}})
