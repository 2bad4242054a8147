"""An example third-party plugin with both parser kinds of the chat API (plugin API 1.8).

``xml_function``, a tool parser: a model that calls tools writes each call as
``<function=NAME>{json arguments}</function>``, any number of them, with text around them::

    I'll check both.
    <function=get_weather>{"city": "Oslo"}</function>
    <function=get_time>{"zone": "CET"}</function>

The text outside the calls is the content. ``<function=NAME></function>`` is a call without
arguments (``{}``). At the end of the output a call without its ``>`` or ``</function>``, a
name that is not 1 to 64 letters, digits, ``_`` or ``-``, arguments that are not a JSON
object and text between the arguments and ``</function>`` are malformed (``ToolParseError``):
the server then returns the whole text as content and logs why.

``thought``, a reasoning parser: the model thinks in a ``<thought>`` block before it answers::

    <thought>
    The user wants the weather; I have a tool for that.
    </thought>
    <function=get_weather>{"city": "Oslo"}</function>

Output that does not start with ``<thought>`` (after whitespace) is all answer.

Both read the whole text so far, each time it grows, and keep the prefix rule: while not final,
what they report only grows. A trailing part that could still become a tag is held back; a
call's name is reported once its ``>`` is generated; its arguments are the span of the text
that the JSON value takes so far, found with ``corellm.serving.partial_json.scan_value``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

from corellm import hookimpl
from corellm.components import ReasoningParserSpec, ToolParserSpec
from corellm.interfaces import ReasoningParser, ToolParser
from corellm.serving.partial_json import JSONScanError, partial_suffix, scan_value, skip_ws
from corellm.tool_calls import ParsedReasoning, ParsedToolCalls, PartialToolCall, ToolParseError

CORELLM_PLUGIN_API = "1.13"

CALL_START = "<function="
CALL_END = "</function>"
THOUGHT_START = "<thought>"
THOUGHT_END = "</thought>"
_NAME = re.compile(r"[A-Za-z0-9_-]{0,64}")   # OpenAI's function names; empty while generated


def read_json(text: str, start: int) -> tuple[int | None, int, str | None]:
    """The JSON value at ``text[start]``: ``(end, limit, error)``. ``end``: the index past the
    value, or None while it is unfinished. ``limit``: how far the text reads as JSON,
    ``len(text)`` unless ``error`` says where it stopped being JSON."""
    try:
        return scan_value(text, start), len(text), None
    except JSONScanError as exc:
        error = str(exc)
    # The longest prefix that is still the start of a value, so that the arguments reported
    # before the text went wrong stay a prefix of what is reported now. More text never makes
    # a text that is not the start of a value into one: bisection finds it.
    lo, hi = start, len(text)           # text[:lo] reads, text[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            scan_value(text[:mid], start)
            lo = mid
        except JSONScanError:
            hi = mid
    return None, lo, error


class XmlFunctionToolParser(ToolParser):
    """``<function=NAME>{json}</function>``, any number of times (see the module's
    docstring)."""

    def parse(self, text: str, final: bool) -> ParsedToolCalls:
        content: list[str] = []
        calls: list[PartialToolCall] = []
        pos = 0
        while True:
            tag = text.find(CALL_START, pos)
            if tag < 0:
                tail = text[pos:]
                if not final:           # "<func" may still become a call: held back
                    tail = tail[:len(tail) - partial_suffix(tail, CALL_START)]
                content.append(tail)
                break
            content.append(text[pos:tag])
            call, after, problem = self.read_call(text, tag + len(CALL_START))
            calls.append(call)
            if after is not None:
                if final:
                    self.check_arguments(call, len(calls) - 1)
                pos = after
                continue
            if final:
                raise ToolParseError(f"call {len(calls) - 1}: {problem}")
            break                       # the rest is this call, still being generated
        return ParsedToolCalls(content="".join(content), calls=calls)

    def read_call(self, text: str, i: int) -> tuple[PartialToolCall, int | None, str]:
        """The call whose name starts at ``text[i]``, as far as the text goes: the call, the
        index past its ``</function>`` (None while it is unfinished or wrong) and why not."""
        gt = text.find(">", i)
        name = text[i:gt if gt >= 0 else len(text)]
        if not _NAME.fullmatch(name) or (gt >= 0 and not name):
            return PartialToolCall(None), None, f"{name[:80]!r} is not a function name"
        if gt < 0:
            return PartialToolCall(None), None, "its name is unterminated (no '>')"
        start = skip_ws(text, gt + 1)
        if text.startswith(CALL_END, start):
            return PartialToolCall(name), start + len(CALL_END), ""     # no arguments
        end, limit, error = read_json(text, start)
        call = PartialToolCall(name, text[start:end if end is not None else limit])
        if error is not None:
            return call, None, f"its arguments are not JSON ({error})"
        if end is None:
            return call, None, f"its arguments are unfinished (no {CALL_END})"
        after = skip_ws(text, end)
        if text.startswith(CALL_END, after):
            return call, after + len(CALL_END), ""
        if CALL_END.startswith(text[after:]):
            return call, None, f"it is unterminated (no {CALL_END})"
        return call, None, f"text after its arguments, before {CALL_END}"

    @staticmethod
    def check_arguments(call: PartialToolCall, index: int) -> None:
        """At the end of the output: a call's arguments are a JSON object (or absent)."""
        if not call.arguments:
            return
        try:
            value = json.loads(call.arguments)
        except ValueError as exc:
            raise ToolParseError(f"call {index} ({call.name}): its arguments are not JSON "
                                 f"({exc})") from None
        if not isinstance(value, dict):
            raise ToolParseError(f"call {index} ({call.name}): its arguments are a "
                                 f"{type(value).__name__}, not a JSON object")


class ThoughtReasoningParser(ReasoningParser):
    """``<thought>reasoning</thought>answer``; without the leading ``<thought>``, all answer.
    The whitespace around the reasoning and before the answer is layout, left out."""

    end_marker = THOUGHT_END

    def parse(self, text: str, final: bool) -> ParsedReasoning:
        i = skip_ws(text, 0)
        if not text.startswith(THOUGHT_START, i):
            if not final and THOUGHT_START.startswith(text[i:]):
                return ParsedReasoning("", "")          # may still become <thought>
            return ParsedReasoning("", text[i:], answer_started=True)
        body = i + len(THOUGHT_START)
        close = text.find(THOUGHT_END, body)
        if close < 0:                   # still thinking (or, when final, cut short)
            reasoning = text[body:]
            if not final:
                reasoning = reasoning[:len(reasoning) - partial_suffix(reasoning, THOUGHT_END)]
            # Trailing whitespace is held back: it may be the layout before </thought>.
            return ParsedReasoning(reasoning.strip(), "")
        return ParsedReasoning(text[body:close].strip(),
                               text[close + len(THOUGHT_END):].lstrip(), answer_started=True)


@hookimpl
def corellm_tool_parsers() -> Iterator[ToolParserSpec]:
    yield ToolParserSpec(name="xml_function", factory=XmlFunctionToolParser,
                         summary="<function=NAME>{json arguments}</function>, any number of "
                                 "times, text around them the content")


@hookimpl
def corellm_reasoning_parsers() -> Iterator[ReasoningParserSpec]:
    yield ReasoningParserSpec(name="thought", factory=ThoughtReasoningParser,
                              summary="<thought>...</thought> before the answer")
