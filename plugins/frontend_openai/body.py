"""Request bodies as OpenAI's API takes them: read within ``frontend.max_request_bytes``,
parsed as strict JSON (UTF-8, valid Unicode, integers Python can convert), large ones on the
preprocessing pool, and validated against the routes' models; every error an ``APIError``
(415 for another content type, 413 over the size limit, 400 naming the field)."""

from __future__ import annotations

import json
import re
import sys
import typing
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError

from .errors import APIError, _validation_error
from .options import RequestLimits


# JSON text may spell a lone UTF-16 surrogate ("\ud800"): valid JSON, but not a string any
# tokenizer or encoder accepts. Bodies whose bytes contain such an escape are checked value by
# value (a valid pair, "\ud83d\ude00", merely triggers the check).
_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


class _HugeInt:
    """Stands in for an integer literal longer than Python converts (``int_max_str_digits``),
    so the error can name the field it was in."""

    __slots__ = ("digits",)

    def __init__(self, digits: int) -> None:
        self.digits = digits


def _parse_int(text: str) -> int | _HugeInt:
    limit = sys.get_int_max_str_digits() or 4300
    return _HugeInt(len(text)) if len(text) > limit else int(text)


def _reject_constant(name: str) -> Any:
    raise APIError(400, f"request body is not valid JSON: {name} is not a JSON number")


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object, or an ``APIError`` (400) that names what is wrong: not
    JSON, not an object, nested too deeply, an integer too long to convert or a string that is
    not valid Unicode (these two name the field)."""
    try:
        # Strict UTF-8 (RFC 8259): json.loads(bytes) would let encoded surrogates through.
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"request body is not valid UTF-8: {exc}") from None
    checked = _ESCAPED_SURROGATE.search(raw) is not None
    try:
        try:
            data = json.loads(text, parse_constant=_reject_constant)
        except ValueError as exc:
            if isinstance(exc, json.JSONDecodeError):
                raise
            # An integer literal over Python's digit limit: parse again, marking it, to name it.
            data = json.loads(text, parse_constant=_reject_constant, parse_int=_parse_int)
            checked = True
    except json.JSONDecodeError as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise APIError(400, "request body is not valid JSON: nested too deeply") from None
    if not isinstance(data, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(data).__name__}")
    if checked:
        try:
            _check_values(data, "")
        except RecursionError:
            raise APIError(400, "request body is not valid JSON: nested too deeply") from None
    return data


def _check_values(value: Any, path: str) -> None:
    if isinstance(value, str):
        m = _SURROGATE.search(value)
        if m:
            raise APIError(400, f"{path or 'request body'}: not valid Unicode (a lone UTF-16 "
                                f"surrogate {ascii(m.group())[1:-1]} at character {m.start()})",
                           param=path or None)
    elif isinstance(value, _HugeInt):
        raise APIError(400, f"{path}: an integer of {value.digits} digits is out of range",
                       param=path or None)
    elif isinstance(value, dict):
        for key, item in value.items():
            if _SURROGATE.search(key):
                raise APIError(400, f"{path or 'request body'}: a key is not valid Unicode "
                                    f"({ascii(key)})", param=path or None)
            _check_values(item, f"{path}.{key}" if path else key)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_values(item, f"{path}[{i}]")


async def _read_body(request: Request, limit: int) -> bytes:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(413, f"request body of {length} bytes exceeds the limit of {limit} bytes "
                            "(frontend.max_request_bytes)", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes "
                                "(frontend.max_request_bytes)", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


# Routes whose bodies carry chat messages.
_CHAT_ROUTES = frozenset({"/v1/chat/completions", "/tokenize"})
# Bodies up to this size are parsed on the event loop (well under a millisecond); larger ones on
# the preprocessing pool, at a cost of a unit (about a microsecond) per this many bytes.
INLINE_PARSE_BYTES = 64 << 10
JSON_BYTES_PER_COST = 50


def check_message_count(data: dict[str, Any], limits: RequestLimits) -> None:
    """``messages`` within ``frontend.limits.max_messages``, a list content counting each of its
    parts: checked on the parsed JSON, before pydantic validates each message, because
    validating tens of thousands of messages (and rendering them) holds the event loop for a
    noticeable fraction of a second."""
    messages = data.get("messages")
    if not isinstance(messages, list):
        return
    limit = limits.max_messages
    count = len(messages)
    if count <= limit:
        count = sum(len(m["content"]) if isinstance(m, dict) and isinstance(
            m.get("content"), list) and m["content"] else 1 for m in messages)
    if count > limit:
        what = f"{count} messages" if count == len(messages) else \
            f"{count} messages and content parts (a list content counts each part)"
        raise APIError(400, f"messages: {what} exceed the limit of {limit} "
                            "(frontend.limits.max_messages)", param="messages")


class _JSONRequest(Request):
    """A request whose body is read with the size limit and parsed by ``parse_json_body``
    (FastAPI calls ``body()`` and ``json()`` when it builds a typed body)."""

    async def body(self) -> bytes:
        if not hasattr(self, "_body"):
            self._body = await _read_body(self, self.app.state.max_request_bytes)
        return self._body

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            raw = await self.body()
            serving = self.app.state.serving
            if len(raw) <= INLINE_PARSE_BYTES:
                self._json = self._parse(raw, serving.limits)
            else:
                # Parsing a large body takes milliseconds per MiB: on the loop, many such bodies
                # at once would hold every other client's request for their sum; on the pool
                # they wait behind smaller jobs (docs/benchmarks.md, the abuse benchmark).
                self._json = await serving.off_loop(self._parse, raw, serving.limits,
                                                    cost=len(raw) / JSON_BYTES_PER_COST)
        return self._json

    def _parse(self, raw: bytes, limits: RequestLimits) -> dict[str, Any]:
        data = parse_json_body(raw)
        if self.scope["path"] in _CHAT_ROUTES:
            check_message_count(data, limits)
        return data


def _is_json(content_type: str | None) -> bool:
    if not content_type:
        return False
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/")
                                          and kind.endswith("+json"))


class _OpenAIRoute(APIRoute):
    """Routes whose JSON bodies are checked as OpenAI's API does: 415 for another content type,
    413 over the size limit, and every parse or validation error a 400 naming the field."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()
        model = next((t for t in typing.get_type_hints(self.endpoint).values()
                      if isinstance(t, type) and issubclass(t, BaseModel)), None)
        takes_body = "POST" in self.methods

        async def route(request: Request) -> Response:
            if takes_body and not _is_json(request.headers.get("content-type")):
                got = request.headers.get("content-type")
                return APIError(415, "Content-Type must be application/json, got "
                                     f"{got!r}" if got else "Content-Type must be "
                                     "application/json (the header is missing)",
                                code="unsupported_media_type").response()
            try:
                return await handler(_JSONRequest(request.scope, request.receive))
            except RequestValidationError as exc:
                return _validation_error(exc.errors(), model).response()
            except APIError as exc:
                return exc.response()
            except HTTPException as exc:          # FastAPI's own (e.g. a body it cannot read)
                return APIError(exc.status_code, str(exc.detail)).response()
        return route


def _parse(model: type[BaseModel], data: dict[str, Any]) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc.errors(), model) from None
