"""The Hermes tool-call format (NousResearch Hermes 2/3, Qwen2.5, Qwen3).

Each call is a JSON object in a ``<tool_call>`` block::

    Let me look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {"tz": "CET"}}
    </tool_call>

``"parameters"`` is read as ``"arguments"``. The content is the text outside the blocks, joined
(the core trims the whitespace around calls); while streaming, a trailing part of it that could
still grow into ``<tool_call>`` is held back. The blocks are delimited by their JSON: what
follows ``<tool_call>`` is read as one object, then ``</tool_call>`` (after whitespace), so a
``</tool_call>`` inside an argument string is just text.

At the end of the output a block whose JSON does not parse, whose object has no ``name`` or
whose arguments are not an object, text between the object and ``</tool_call>``, and a block
without its ``</tool_call>`` are malformed (``ToolParseError``).
"""

from __future__ import annotations

from corellm.interfaces import ToolParser
from corellm.serving.partial_json import partial_suffix, skip_ws
from corellm.tool_calls import ParsedToolCalls, PartialToolCall, ToolParseError
from corellm_plugins.tool_parsers._json_calls import call_of, check_object, read_object

START = "<tool_call>"
END = "</tool_call>"


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number of times (see
    the module's docstring)."""

    def parse(self, text: str, final: bool) -> ParsedToolCalls:
        content: list[str] = []
        calls: list[PartialToolCall] = []
        pos = 0
        while True:
            tag = text.find(START, pos)
            if tag < 0:
                tail = text[pos:]
                if not final:
                    tail = tail[:len(tail) - partial_suffix(tail, START)]
                content.append(tail)
                break
            content.append(text[pos:tag])
            index = len(calls)
            start = skip_ws(text, tag + len(START))
            members, obj_end, limit, error = read_object(text, start)
            calls.append(call_of(text, members, limit))
            if error is None and obj_end is not None:
                after = skip_ws(text, obj_end)
                if text.startswith(END, after):
                    if final:
                        check_object(text, start, obj_end, index)
                    pos = after + len(END)
                    continue
                if not END.startswith(text[after:]):
                    error = f"text after its JSON object, before {END}"
            if final:
                raise ToolParseError(f"call {index}: {error}" if error else
                                     f"call {index} is unterminated (no {END})")
            break                      # the rest is this call, still being generated
        return ParsedToolCalls(content="".join(content), calls=calls)
