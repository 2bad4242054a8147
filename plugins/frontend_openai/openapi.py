"""What ``/openapi.json`` says the server answers, for client generators and API fuzzers.

The request bodies are the models of ``protocol.py``. The answers are described here: the
successful bodies of each route (JSON, or server-sent events when ``stream`` is true) and the
statuses the server really uses for errors, each with OpenAI's error body. FastAPI's own 422
("validation error") is taken out: every validation error is a 400 (``body._OpenAIRoute``).

The shapes below only document: the routes build their answers as dicts. What holds the two
together is the seeded schemathesis run of ``tests/test_server_reliability.py``, which checks
every answer against this schema.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import TypeAdapter
# pydantic takes typing's TypedDict only from Python 3.12 on
from typing_extensions import NotRequired, TypedDict


# --------------------------------------------------------------------------- errors
# The error ``type`` of each status the server answers with (OpenAI's names; APIError.TYPES).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               404: "not_found_error", 413: "invalid_request_error",
               415: "invalid_request_error", 500: "internal_server_error",
               503: "service_unavailable"}
ErrorType = Literal[tuple(sorted(set(ERROR_TYPES.values())))]     # type: ignore[misc]


class Error(TypedDict):
    message: str
    type: ErrorType
    param: str | None          # the field at fault, as the message names it
    code: str | None           # e.g. model_not_found, request_too_large, server_shutting_down


class ErrorResponse(TypedDict):
    error: Error


# --------------------------------------------------------------------------- generation
FinishReason = Literal["stop", "length", "abort"]
StopReason = int | str | None           # the stop token id or stop string, null for EOS/length


class PromptTokensDetails(TypedDict):
    cached_tokens: int


class Usage(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(TypedDict):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(TypedDict):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None     # null in a stream's chunks until the sample ends
    stop_reason: StopReason


class Completion(TypedDict):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(TypedDict):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: NotRequired[Usage]              # the last chunk, with stream_options.include_usage


class TopLogprob(TypedDict):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(TypedDict):
    content: list[TokenLogprob]


class AssistantMessage(TypedDict):
    role: Literal["assistant"]
    content: str


class ChatChoice(TypedDict):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason
    stop_reason: StopReason


class ChatCompletion(TypedDict):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(TypedDict):
    role: NotRequired[Literal["assistant"]]          # the first chunk of each choice
    content: NotRequired[str]


class ChatChunkChoice(TypedDict):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: NotRequired[StopReason]


class ChatCompletionChunk(TypedDict):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: NotRequired[Usage]


# --------------------------------------------------------------------------- the other routes
class TokenizeResponse(TypedDict):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None           # with return_token_strs: true


class DetokenizeResponse(TypedDict):
    prompt: str


class ModelCard(TypedDict):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str                 # the base model's name, or a LoRA adapter's directory
    parent: str | None        # a LoRA adapter's base model (None for the model itself)
    max_model_len: int


class ModelList(TypedDict):
    object: Literal["list"]
    data: list[ModelCard]


class Version(TypedDict):
    version: str


_DOCUMENTED = (ErrorResponse, Completion, CompletionChunk, ChatCompletion, ChatCompletionChunk,
               TokenizeResponse, DetokenizeResponse, ModelList, Version)


def _ref(shape: type) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{shape.__name__}"}


# --------------------------------------------------------------------------- per route
REQUEST_ERRORS = {
    400: "The request is invalid; `param` names the field at fault and the message says why: "
         "malformed JSON, a wrong type, an unknown field, a value out of range or over "
         "`frontend.limits`, a feature this server does not implement, a prompt too long for "
         "the context, an output constraint over `frontend.limits.constraints` or that the "
         "backend could not check or compile within its deadline (code "
         "`constraint_too_complex`). Also a Host header not in `frontend.allowed_hosts` (code "
         "`host_not_allowed`).",
    404: "`model` is not the served model (code `model_not_found`).",
    413: "The body is larger than `frontend.max_request_bytes` (code `request_too_large`).",
    415: "The Content-Type is not `application/json` (or `application/*+json`), or there is "
         "none (code `unsupported_media_type`).",
    500: "The engine died or failed while it ran the request (code `engine_dead`, "
         "`engine_error`), or an internal error (`internal_error`).",
    503: "The server is shutting down (code `server_shutting_down`, with Retry-After), the "
         "engine is dead (`engine_dead`), or other requests' constraints kept this one's from "
         "compiling in time (`server_busy`, with Retry-After).",
}
HOST_ERROR = {400: "The Host header is not in `frontend.allowed_hosts` (code "
                   "`host_not_allowed`)."}
HEALTH_ERRORS = {**HOST_ERROR,
                 503: "The engine is dead or its loop did not answer within "
                      "`frontend.health_timeout_s`, or the server is shutting down."}
KEY_ERROR = "A key is set and the request does not carry it as `Authorization: Bearer <key>` " \
            "(code `invalid_api_key`)."
_RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying, while the "
                                               "server shuts down or is busy.",
                                "schema": {"type": "integer"}}}


def error_response(description: str, status: int) -> dict[str, Any]:
    response = {"description": description,
                "content": {"application/json": {"schema": _ref(ErrorResponse)}}}
    return {**response, "headers": _RETRY_AFTER} if status == 503 else response


def json_body(description: str, shape: type, stream: type | None = None) -> dict[str, Any]:
    """A 200 whose body is ``shape`` as JSON, or with ``stream: true`` server-sent events that
    each carry a ``stream`` chunk (or an error, after which the stream ends), then ``[DONE]``."""
    content: dict[str, Any] = {"application/json": {"schema": _ref(shape)}}
    if stream is not None:
        # The schema of one event, as tools read an event stream's schema in OpenAPI 3.1
        # (schemathesis among them; 3.2 has itemSchema for it, which 3.1 does not allow).
        content["text/event-stream"] = {"schema": {
            "type": "object", "required": ["data"],
            "properties": {"data": {"anyOf": [
                {"const": "[DONE]"},
                {"type": "string", "contentMediaType": "application/json",
                 "contentSchema": {"anyOf": [_ref(stream), _ref(ErrorResponse)]}}]}}}}
    return {"description": description, "content": content}


def responses(ok: dict[str, Any], errors: Mapping[int, str]) -> dict[int | str, Any]:
    """A route's ``responses``: ``ok`` for 200, the error body for each status of ``errors``."""
    return {200: ok, **{status: error_response(description, status)
                        for status, description in errors.items()}}


# --------------------------------------------------------------------------- the document
def install(app: FastAPI, needs_key: Callable[[str], bool] | None) -> None:
    """Serve the finished document as ``/openapi.json``. ``needs_key(path)``: whether a route
    answers 401 without the API key (None: no key is set)."""

    def openapi() -> dict[str, Any]:
        if not app.openapi_schema:
            app.openapi_schema = _finish(get_openapi(title=app.title, version=app.version,
                                                     routes=app.routes), needs_key)
        return app.openapi_schema

    app.openapi = openapi           # type: ignore[method-assign]


def _finish(spec: dict[str, Any], needs_key: Callable[[str], bool] | None) -> dict[str, Any]:
    for path, item in spec["paths"].items():
        for operation in item.values():
            answers = operation["responses"]
            answers.pop("422", None)
            if needs_key is not None and needs_key(path):
                answers["401"] = error_response(KEY_ERROR, 401)
                operation["security"] = [{"apiKey": []}]
            operation["responses"] = dict(sorted(answers.items()))
    schemas = spec.setdefault("components", {}).setdefault("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    _, defs = TypeAdapter.json_schemas(
        [(shape, "validation", TypeAdapter(shape)) for shape in _DOCUMENTED],
        ref_template="#/components/schemas/{model}")
    for name, schema in defs.get("$defs", {}).items():
        schemas.setdefault(name, schema)
    spec["components"]["schemas"] = dict(sorted(schemas.items()))
    if needs_key is not None:
        spec["components"]["securitySchemes"] = {"apiKey": {
            "type": "http", "scheme": "bearer",
            "description": "frontend.api_key (or $CORELLM_API_KEY)"}}
    return spec
