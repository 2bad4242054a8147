"""The pythonic tool-call format (Llama 3.2, Llama 4): the output is a Python list of calls
with keyword arguments whose values are literals::

    [get_weather(city="Paris", days=3), search(query='café', filters={"lang": ["fr"]})]

The output is read as calls only when, after whitespace, it starts with ``[``, a Python
identifier and ``(`` (whitespace allowed after ``[``); any other output is content, whole
(while streaming, nothing is content until that is known). Calls have no content.

A call's name is known once ``name(`` is generated; its arguments, converted with ``ast`` to
a JSON object (``json.dumps(..., ensure_ascii=False)``: strings, numbers, booleans, ``None``,
lists, tuples as lists and dicts with string keys), are given whole once its closing
parenthesis is generated, and are "" before. At the end of the output positional or ``**``
arguments, values that are not such literals, an unfinished call or list, and text after the
list are malformed (``ToolParseError``).
"""

from __future__ import annotations

import ast
import json
import math
import warnings
from collections.abc import Sequence
from typing import Any

from corellm.interfaces import ToolParser
from corellm.serving.partial_json import skip_ws
from corellm.tool_calls import ParsedToolCalls, PartialToolCall, ToolParseError

_CLOSE = {")": "(", "]": "[", "}": "{"}


class _NotLiteral(ValueError):
    pass


def _identifier_end(text: str, i: int) -> int:
    """The end of the identifier at ``text[i]`` (``i`` when none starts there)."""
    if i >= len(text) or not (text[i].isalpha() or text[i] == "_"):
        return i
    j = i + 1
    while j < len(text) and (text[j].isalnum() or text[j] == "_"):
        j += 1
    return j


def _closing(text: str, i: int) -> int | None:
    """``text[i]`` is ``(``: the index past its matching ``)``, or None while the text ends
    first. Knows Python's strings (quotes, triple quotes, backslash escapes), nothing else.
    Raises ValueError on a bracket that closes the wrong one."""
    stack: list[str] = []
    n = len(text)
    while i < n:
        c = text[i]
        if c in "'\"":
            quote = c * 3 if text.startswith(c * 3, i) else c
            j = i + len(quote)
            while True:
                if j >= n:
                    return None
                if text[j] == "\\":
                    j += 2
                elif text.startswith(quote, j):
                    j += len(quote)
                    break
                elif text[j] == "\n" and len(quote) == 1:
                    raise ValueError(f"a line break in a string at {j}")
                else:
                    j += 1
            i = j
            continue
        if c in "([{":
            stack.append(c)
        elif c in _CLOSE:
            if not stack or stack[-1] != _CLOSE[c]:
                raise ValueError(f"unbalanced {c!r} at {i}")
            stack.pop()
            if not stack:
                return i + 1
        i += 1
    return None


def _json_value(value: Any) -> Any:
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _NotLiteral(f"{value!r} has no JSON form")
        return value
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise _NotLiteral(f"a dict key {k!r} that is not a string")
            out[k] = _json_value(v)
        return out
    raise _NotLiteral(f"a {type(value).__name__}, which has no JSON form")


def _arguments(source: str) -> str:
    """The JSON text of the keyword arguments of the call ``source`` (``name(...)``)."""
    try:
        with warnings.catch_warnings():      # "invalid escape sequence" in a model's string
            warnings.simplefilter("ignore")
            call = ast.parse(source, mode="eval").body
    except SyntaxError as exc:
        raise _NotLiteral(f"not a Python call ({exc.msg})") from None
    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
        raise _NotLiteral("not a call of a plain name")
    if call.args:
        raise _NotLiteral("positional arguments (only keyword arguments name parameters)")
    args = {}
    for kw in call.keywords:
        if kw.arg is None:
            raise _NotLiteral("** arguments")
        try:
            value = ast.literal_eval(kw.value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            raise _NotLiteral(f"the value of {kw.arg!r} is not a literal") from None
        args[kw.arg] = _json_value(value)
    return json.dumps(args, ensure_ascii=False)


class PythonicToolParser(ToolParser):
    """``[name(key=literal, ...), ...]`` (see the module's docstring). Each complete call's
    conversion is kept (by its source text), so streaming converts each call once."""

    def __init__(self, tools: Sequence[dict] | None = None) -> None:
        super().__init__(tools)
        self._converted: dict[str, str | _NotLiteral] = {}

    def _convert(self, source: str) -> str:
        found = self._converted.get(source)
        if found is None:
            try:
                found = _arguments(source)
            except _NotLiteral as exc:
                found = exc
            self._converted[source] = found
        if isinstance(found, _NotLiteral):
            raise _NotLiteral(str(found))
        return found

    def parse(self, text: str, final: bool) -> ParsedToolCalls:
        i = skip_ws(text, 0)
        first = skip_ws(text, i + 1)
        name_end = _identifier_end(text, first)
        if i < len(text) and text[i] == "[" and name_end > first \
                and name_end < len(text) and text[name_end] == "(":
            return self._calls(text, first, final)
        undecided = (i >= len(text)
                     or (text[i] == "[" and name_end == len(text)))  # "[", "[na", "[  "...
        return ParsedToolCalls(content="" if undecided and not final else text)

    def _calls(self, text: str, start: int, final: bool) -> ParsedToolCalls:
        calls: list[PartialToolCall] = []
        error: str | None = None
        complete = False
        while True:
            index = len(calls)
            name_end = _identifier_end(text, start)
            call = PartialToolCall(text[start:name_end], "")
            calls.append(call)
            try:
                end = _closing(text, name_end)
                if end is None:
                    break
                call.arguments = self._convert(text[start:end])
            except ValueError as exc:
                error = f"call {index} ({call.name}): {exc}"
                break
            k = skip_ws(text, end)
            if k >= len(text):
                break
            if text[k] == "]":
                if skip_ws(text, k + 1) < len(text):
                    error = "text after the list of calls"
                else:
                    complete = True
                break
            if text[k] != ",":
                error = f"unexpected {text[k]!r} after call {index}"
                break
            k = skip_ws(text, k + 1)
            name_end = _identifier_end(text, k)
            if k >= len(text) or name_end == len(text):
                break                                   # the next name still being generated
            if name_end == k or text[name_end] != "(":
                error = f"not a call after call {index}"
                break
            start = k
        if final and not complete:
            raise ToolParseError(error or "the list of calls is unfinished")
        return ParsedToolCalls(content="", calls=calls)
