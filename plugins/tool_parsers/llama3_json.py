"""The Llama 3.1 / 3.2 JSON tool-call format.

The output is the calls and nothing else: optionally ``<|python_tag|>`` (a special token),
then one or more JSON objects separated by ``;``::

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

``"arguments"`` is read as ``"parameters"``; other members (Llama 3.2's ``"type"``) are
ignored. The output is read as calls only when, after whitespace and the optional
``<|python_tag|>``, it starts with ``{``; any other output is content, whole (while streaming,
nothing is content until that is known). Calls have no content. At the end of the output an
object that does not parse or has no ``name``, an unfinished object, and text after the calls
other than whitespace and a last ``;`` are malformed (``ToolParseError``).
"""

from __future__ import annotations

from corellm.interfaces import ToolParser
from corellm.serving.partial_json import skip_ws
from corellm.tool_calls import ParsedToolCalls, PartialToolCall, ToolParseError
from corellm_plugins.tool_parsers._json_calls import call_of, check_object, read_object

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    """``[<|python_tag|>]{"name": ..., "parameters": {...}}; ...`` (see the module's
    docstring)."""

    def parse(self, text: str, final: bool) -> ParsedToolCalls:
        i = skip_ws(text, 0)
        if text.startswith(PYTHON_TAG, i):
            i = skip_ws(text, i + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(text[i:]):
            return ParsedToolCalls(content="")         # whitespace, or the tag's start
        if i >= len(text):
            return ParsedToolCalls(content=text if final else "")
        if text[i] != "{":
            return ParsedToolCalls(content=text)
        calls: list[PartialToolCall] = []
        while True:
            index = len(calls)
            members, end, limit, error = read_object(text, i)
            calls.append(call_of(text, members, limit))
            if error is None and end is not None:
                if final:
                    check_object(text, i, end, index)
                k = skip_ws(text, end)
                if k < len(text) and text[k] == ";":
                    k = skip_ws(text, k + 1)
                if k >= len(text):
                    break                  # the end, or the next call not started yet
                if text[k] == "{" and text[skip_ws(text, end)] == ";":
                    i = k
                    continue
                error = f"unexpected {text[k]!r} after it"
            if final:
                raise ToolParseError(f"call {index}: {error}" if error else
                                     f"call {index} is unfinished")
            break
        return ParsedToolCalls(content="", calls=calls)
