"""The server's errors: ``APIError``, which becomes an OpenAI-style error response, and the
``APIError`` that each of the engine's and pydantic's errors becomes (a 400 naming the field, or
the status of an aborted request)."""

from __future__ import annotations

import difflib
import json
import reprlib
from collections.abc import Sequence
from typing import Any

from fastapi import HTTPException
from fastapi.responses import Response
from pydantic import BaseModel

from corellm.errors import InvalidRequestError, RequestAbortedError

from .openapi import ERROR_TYPES


# What a client is told to wait before retrying a server that is shutting down.
RETRY_AFTER_S = 5


class APIError(HTTPException):
    """Becomes an OpenAI-style error response. An ``HTTPException``, so FastAPI lets it through
    when body parsing raises it."""

    TYPES = ERROR_TYPES

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(status, message, headers)
        self.status, self.message, self.param, self.code = status, message, param, code

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> Response:
        # ASCII-escaped: whatever a message quotes, the answer is valid JSON and UTF-8.
        return Response(json.dumps(self.body()), status_code=self.status,
                        media_type="application/json", headers=self.headers)


_short_repr = reprlib.Repr()
_short_repr.maxstring = _short_repr.maxother = 80
_short_repr.maxlist = _short_repr.maxdict = 8


def _invalid(exc: InvalidRequestError, renames: dict[str, str] | None = None) -> APIError:
    field = exc.field.removeprefix("sampling_params.")
    field = (renames or {}).get(field, field)
    return APIError(400, f"{field}: {exc.message}", param=field)


def _validation_error(errors: Sequence[Any], model: type[BaseModel] | None) -> APIError:
    """The first of pydantic's (or FastAPI's) validation errors, as a 400 naming the field."""
    err = errors[0]
    loc = [str(p) for p in err["loc"]]
    if loc[:1] == ["body"]:
        loc = loc[1:]
    # An unknown key is the client's own text, last in loc: kept whole, whatever it looks like.
    key = loc.pop() if err["type"] == "extra_forbidden" and loc else None
    # Unions report the failing member first in loc ("str", "list[int]", ...): drop those.
    loc = [p for p in loc if not any(c in p for c in "[]") and p not in ("str", "int")]
    if key is not None:
        shown = key if len(key) <= 80 else key[:77] + "..."
        field = ".".join([*loc, shown])
        fields = list(model.model_fields) if model is not None and not loc else []
        close = difflib.get_close_matches(key, fields, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else ""
        return APIError(400, f"{field}: unknown field{hint}", param=field)
    field = ".".join(loc) or None
    if err["type"] == "missing":
        return APIError(400, f"{field or 'request body'}: field required", param=field)
    return APIError(400, f"{field or 'request body'}: {err['msg']} "
                         f"(got {_short_repr.repr(err.get('input'))})", param=field)


def _busy(message: str) -> APIError:
    """A 503 to retry: the server could not serve the request in time for others' work."""
    return APIError(503, message, code="server_busy",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def _aborted(exc: RequestAbortedError) -> APIError:
    """A request the engine aborted: 503 (retry later) when the server is shutting down."""
    if exc.reason == "shutdown":
        return APIError(503, str(exc), code="server_shutting_down",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    return APIError(500, str(exc), code=f"aborted_{exc.reason}")
