"""The Mistral tool-call formats (``[TOOL_CALLS]``, ``[ARGS]`` and ``[CALL_ID]`` are special
tokens).

Before tokenizer v11 (Mistral 7B v0.3, Mixtral 8x22B, Nemo...): ``[TOOL_CALLS]`` then a JSON
array of call objects::

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]

From v11 (Mistral Small 3.2, Magistral, Devstral...): each call is ``[TOOL_CALLS]``, its name,
``[ARGS]`` and its arguments object (v11 may put ``[CALL_ID]`` and an id before ``[ARGS]``;
the id is dropped)::

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}

Which one is read is told by what follows the first ``[TOOL_CALLS]``: ``[`` (after whitespace)
is the array. The content is the text before the first ``[TOOL_CALLS]`` (while streaming,
without a trailing part that could still grow into it); after it, only calls. At the end of
the output, no call after ``[TOOL_CALLS]``, JSON that does not parse, a call without a name
(or, in v11, a name that is not a function name: letters, digits, ``_``, ``-``, ``.``),
arguments that are not an object, an unfinished call and any other text after the calls are
malformed (``ToolParseError``).
"""

from __future__ import annotations

import re

from corellm.interfaces import ToolParser
from corellm.serving.partial_json import partial_suffix, skip_ws
from corellm.tool_calls import ParsedToolCalls, PartialToolCall, ToolParseError
from corellm_plugins.tool_parsers._json_calls import (call_of, check_arguments_text,
                                                      check_object, read_object, read_value)

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
_NAME = re.compile(r"[\w.\-]+")


class MistralToolParser(ToolParser):
    """``[TOOL_CALLS][{...}, ...]`` or ``[TOOL_CALLS]name[ARGS]{...}`` repeated (see the
    module's docstring)."""

    def parse(self, text: str, final: bool) -> ParsedToolCalls:
        tag = text.find(TOOL_CALLS)
        if tag < 0:
            keep = len(text) if final else len(text) - partial_suffix(text, TOOL_CALLS)
            return ParsedToolCalls(content=text[:keep])
        i = skip_ws(text, tag + len(TOOL_CALLS))
        if i >= len(text):
            if final:
                raise ToolParseError(f"no call after {TOOL_CALLS}")
            calls: list[PartialToolCall] = []
        elif text[i] == "[":
            calls = self._array(text, i, final)
        else:
            calls = self._tagged(text, tag, final)
        return ParsedToolCalls(content=text[:tag], calls=calls)

    @staticmethod
    def _array(text: str, i: int, final: bool) -> list[PartialToolCall]:
        calls: list[PartialToolCall] = []
        i = skip_ws(text, i + 1)
        error: str | None = None
        while True:
            if i >= len(text):
                break                                   # the next call not started yet
            if text[i] == "]" and not calls:
                error = "an empty list of calls"
                break
            index = len(calls)
            members, end, limit, error = read_object(text, i)
            calls.append(call_of(text, members, limit))
            if error is not None or end is None:
                break
            if final:
                check_object(text, i, end, index)
            k = skip_ws(text, end)
            if k >= len(text):
                break
            if text[k] == ",":
                i = skip_ws(text, k + 1)
                continue
            if text[k] == "]":
                if skip_ws(text, k + 1) < len(text):
                    error = "text after the list of calls"
                    break
                return calls                            # complete
            error = f"unexpected {text[k]!r} after call {index}"
            break
        if final:
            raise ToolParseError(error or "the list of calls is unfinished")
        return calls

    @staticmethod
    def _tagged(text: str, tag: int, final: bool) -> list[PartialToolCall]:
        calls: list[PartialToolCall] = []
        error: str | None = None
        complete = False
        while True:
            index = len(calls)
            name_start = tag + len(TOOL_CALLS)
            args = text.find(ARGS, name_start)
            if args < 0:
                calls.append(PartialToolCall(None, ""))  # its name still being generated
                error = f"call {index} has no {ARGS}"
                break
            name = text[name_start:args]
            if CALL_ID in name:
                name = name[:name.index(CALL_ID)]
            name = name.strip()
            if not _NAME.fullmatch(name):
                calls.append(PartialToolCall(None, ""))
                error = f"call {index}: {name!r} is not a function name"
                break
            start = skip_ws(text, args + len(ARGS))
            end, limit, error = read_value(text, start)
            calls.append(PartialToolCall(name, text[start:end if end is not None else limit]))
            if error is not None or end is None:
                if error is not None:
                    error = f"call {index}: {error}"
                break
            if final:
                check_arguments_text(text[start:end], index)
            k = skip_ws(text, end)
            if text.startswith(TOOL_CALLS, k):
                tag = k
                continue
            if k >= len(text):
                complete = True
            elif final or not TOOL_CALLS.startswith(text[k:]):
                error = f"text after call {index}"
            break
        if final and not complete:
            raise ToolParseError(error or f"call {len(calls) - 1} is unfinished")
        return calls
