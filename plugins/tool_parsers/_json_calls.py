"""Shared reading of JSON tool calls still being generated (``{"name": ..., "arguments": {...}}``
objects), on ``corellm.serving.partial_json``.

A call's ``arguments`` is always a span of the generated text (the value of its ``arguments``
or ``parameters`` member, or the text after a format's own marker), so that each reading of a
longer text extends it. Where the text stops being JSON while streaming, the reading keeps what
the longest still-readable prefix gave (the calls already reported stay as they were) and the
final reading raises ``ToolParseError``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

from corellm.serving.partial_json import Member, object_members, scan_value
from corellm.tool_calls import PartialToolCall, ToolParseError

ARGUMENT_KEYS = ("arguments", "parameters")

T = TypeVar("T")


def _tolerant(read: Callable[[str], T], text: str, start: int) -> tuple[T, int, str | None]:
    """``read(text)``, or where the text is not JSON (a ValueError: ``JSONScanError``, or a
    key with a bad escape), ``read`` of the longest prefix it accepts. Returns the result, the
    length of the text it read and the error (None when it read the whole text). A reader
    that accepts a text accepts each of its prefixes from ``start`` on, so the longest one is
    found by bisection."""
    try:
        return read(text), len(text), None
    except ValueError as exc:
        error = str(exc) or type(exc).__name__
    lo, hi = start, len(text)          # read(text[:lo]) is fine, read(text[:hi]) raises
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            read(text[:mid])
            lo = mid
        except ValueError:
            hi = mid
    return read(text[:lo]), lo, error


def read_object(text: str, i: int) -> tuple[list[Member], int | None, int, str | None]:
    """The members of the object at ``text[i]`` (after whitespace) so far: ``(members, end,
    limit, error)``: ``end`` past the closing brace or None, ``limit`` how far the text could
    be read (``len(text)`` unless ``error`` says why it stopped)."""
    (members, end), limit, error = _tolerant(lambda t: object_members(t, i), text, i)
    return members, end, limit, error


def read_value(text: str, i: int) -> tuple[int | None, int, str | None]:
    """As ``read_object`` for any JSON value: ``(end, limit, error)``."""
    end, limit, error = _tolerant(lambda t: scan_value(t, i), text, i)
    return end, limit, error


def call_of(text: str, members: list[Member], limit: int) -> PartialToolCall:
    """The call that an object's members so far describe: its name once the ``name`` member's
    value is complete (and a non-empty string), its arguments the text of the first
    ``arguments`` or ``parameters`` member's value so far ("" until that value starts)."""
    name: str | None = None
    arguments = ""
    seen_name = seen_args = False
    for m in members:
        if m.key == "name" and not seen_name:
            seen_name = True
            if m.end is not None:
                try:
                    value = m.value(text)
                except ValueError:
                    value = None
                if isinstance(value, str) and value:
                    name = value
        elif m.key in ARGUMENT_KEYS and not seen_args:
            seen_args = True
            arguments = text[m.start:m.end if m.end is not None else limit]
    return PartialToolCall(name, arguments)


def check_object(text: str, start: int, end: int, index: int) -> None:
    """At the end of the output: the call object ``text[start:end]`` must be JSON, with a
    non-empty string ``name`` and an object as its arguments (when it has any)."""
    try:
        # strict=False: a raw control character in a string (the core escapes it in the
        # arguments a client gets) does not make the call malformed
        obj = json.loads(text[start:end], strict=False)
    except (ValueError, RecursionError) as exc:
        raise ToolParseError(f"call {index}: its JSON does not parse ({exc})") from None
    if not isinstance(obj, dict):
        raise ToolParseError(f"call {index}: a {type(obj).__name__}, not a JSON object")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise ToolParseError(f"call {index} has no name")
    for key in ARGUMENT_KEYS:
        if key in obj:
            check_arguments(obj[key], index)
            break


def check_arguments(value: Any, index: int) -> None:
    if not isinstance(value, dict):
        raise ToolParseError(f"call {index}: its arguments are a {type(value).__name__}, "
                             "not a JSON object")


def check_arguments_text(text: str, index: int) -> None:
    """At the end of the output: a call's arguments text must be a JSON object."""
    try:
        value = json.loads(text, strict=False)
    except (ValueError, RecursionError) as exc:
        raise ToolParseError(f"call {index}: its arguments are not JSON ({exc})") from None
    check_arguments(value, index)


__all__ = ["ARGUMENT_KEYS", "call_of", "check_arguments_text", "check_object", "read_object",
           "read_value"]
