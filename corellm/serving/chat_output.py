"""From generated text to OpenAI's assistant message and stream deltas: reasoning, content and
tool calls, through the request's reasoning parser and tool parser (plugin kinds, API 1.8).

``ChatOutputParser`` is made once per choice. ``delta(text)`` takes the whole text so far and
returns what is new since the last call; ``finish(text)`` returns the last delta and the
message. Both come from the parsers' readings of the whole text (``parse(text, final)``), so
the concatenated deltas equal the message by construction: content and reasoning are sent as
they grow, a call's id and name once its name is complete, then its arguments' new text.

``tool_choice`` ``"required"`` and a named function constrain generation with a JSON schema
(``forced_tool_schema``); their output is read by the core's ``ForcedToolCalls`` parser,
whatever the model's own tool format.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from corellm.errors import PluginError
from corellm.interfaces import ReasoningParser, ToolParser
from corellm.serving.partial_json import (JSONScanError, escape_control_chars, object_members,
                                          scan_value, skip_ws)
from corellm.tool_calls import (ChatMessageParts, DeltaMessage, DeltaToolCall, FunctionCall,
                                ParsedReasoning, ParsedToolCalls, PartialToolCall, ToolCall,
                                ToolParseError, new_tool_call_id)

logger = logging.getLogger("corellm.serving.chat_output")


class ParserContractError(RuntimeError):
    """A parser broke the prefix rule: a later reading does not extend an earlier one."""


@dataclass
class _SentCall:
    id: str
    name: str
    arguments: str = ""          # the arguments' text sent so far


@dataclass
class ParserNames:
    """Who made each parser, for the errors that end a request (``describe`` of the registry
    entries: the parser's name and its plugin's distribution)."""

    tool: str = "the tool parser"
    reasoning: str = "the reasoning parser"


def _extends(old: str, new: str, what: str, who: str) -> str:
    if not new.startswith(old):
        raise ParserContractError(f"{who} broke the prefix rule: its {what} {new!r} does not "
                                  f"extend the {old!r} it gave before")
    return new[len(old):]


@dataclass
class ChatOutputParser:
    """One choice's parsing (see the module's docstring). ``tools`` None: no tool parsing;
    ``reasoning`` None: no reasoning split. ``tool_names``: the request's functions (a call
    of another is malformed). ``json_content``: the answer is JSON (a ``response_format``),
    its raw control characters inside strings sent as escapes, as a call's arguments are.
    After ``finish``, ``malformed`` says why calls were read as content (the server logs
    it)."""

    tools: ToolParser | None = None
    reasoning: ReasoningParser | None = None
    tool_names: frozenset[str] | None = None
    json_content: bool = False
    names: ParserNames = field(default_factory=ParserNames)
    malformed: str | None = None
    _reasoning_sent: str = ""
    _content_sent: str = ""
    _calls: list[_SentCall] = field(default_factory=list)

    # ------------------------------------------------------------------ readings
    def _split(self, text: str, final: bool) -> tuple[str, str, bool]:
        if self.reasoning is None:
            return "", text, True
        try:
            r = self.reasoning.parse(text, final)
        except Exception as exc:
            raise PluginError(f"{self.names.reasoning} failed: "
                              f"{type(exc).__name__}: {exc}") from exc
        if not isinstance(r, ParsedReasoning) or not isinstance(r.reasoning, str) \
                or not isinstance(r.content, str):
            raise ParserContractError(f"{self.names.reasoning} returned {r!r}, not a "
                                      "ParsedReasoning of two strings")
        return r.reasoning, r.content, bool(r.answer_started)

    def _read(self, answer: str, final: bool) -> ParsedToolCalls:
        if self.tools is None:
            return ParsedToolCalls(content=answer)
        try:
            parsed = self.tools.parse(answer, final)
            if not isinstance(parsed, ParsedToolCalls) or not isinstance(parsed.content, str) \
                    or not all(isinstance(c, PartialToolCall)
                               and isinstance(c.arguments, str)
                               and (c.name is None or isinstance(c.name, str))
                               for c in parsed.calls):
                raise ParserContractError(f"{self.names.tool} returned {parsed!r}, not a "
                                          "ParsedToolCalls of strings")
            # Raw control characters in a string (a constrained decoder's JSON allows them)
            # become escapes: the arguments are strict JSON for every client.
            for call in parsed.calls:
                call.arguments = escape_control_chars(call.arguments)
            if final:
                self._check(parsed)
            return parsed
        except ParserContractError:
            raise
        except ToolParseError as exc:
            if not final:
                raise PluginError(f"{self.names.tool} raised ToolParseError "
                                  f"before the end of the output: {exc}") from exc
            self.malformed = str(exc)
            return ParsedToolCalls(content=answer)
        except Exception as exc:
            raise PluginError(f"{self.names.tool} failed: "
                              f"{type(exc).__name__}: {exc}") from exc

    def _check(self, parsed: ParsedToolCalls) -> None:
        for i, call in enumerate(parsed.calls):
            if not call.name:
                raise ToolParseError(f"call {i} has no name")
            if self.tool_names is not None and call.name not in self.tool_names:
                raise ToolParseError(f"call {i} names {call.name!r}, which is not among the "
                                     f"request's tools ({', '.join(sorted(self.tool_names))})")
            try:
                args = json.loads(call.arguments or "{}")
            except (ValueError, RecursionError) as exc:
                raise ToolParseError(f"call {i} ({call.name}): its arguments are not JSON "
                                     f"({exc})") from None
            if not isinstance(args, dict):
                raise ToolParseError(f"call {i} ({call.name}): its arguments are a "
                                     f"{type(args).__name__}, not a JSON object")

    # ------------------------------------------------------------------ deltas
    def _diff(self, text: str, final: bool) -> tuple[DeltaMessage, ParsedToolCalls, str]:
        reasoning, answer, started = self._split(text, final)
        out = DeltaMessage()
        who_r = self.names.reasoning
        new_r = _extends(self._reasoning_sent, reasoning, "reasoning", who_r)
        if new_r:
            out.reasoning_content, self._reasoning_sent = new_r, reasoning
        parsed = self._read(answer if started else "", final)
        content = parsed.content
        if self.json_content:
            content = escape_control_chars(content)
        if self.tools is not None:
            # Around calls, whitespace is layout: none leads, and a trailing run is sent only
            # once text follows it (or never, at the end).
            content = content.strip() if final else content.lstrip().rstrip()
        who = self.names.tool if self.tools is not None else who_r
        if self.malformed and final:
            # The whole answer is the message's content. Calls already streamed stay as sent,
            # and so does content sent between them: what was not sent comes now.
            new_c = content[len(self._content_sent):] \
                if content.startswith(self._content_sent) else content
            if new_c:
                out.content = new_c
            self._content_sent = content
            return out, parsed, reasoning
        new_c = _extends(self._content_sent, content, "content", who)
        if new_c:
            out.content, self._content_sent = new_c, self._content_sent + new_c
        if len(parsed.calls) < len(self._calls):
            raise ParserContractError(f"{who} dropped a call it had read ({len(self._calls)} "
                                      f"before, {len(parsed.calls)} now)")
        for i, call in enumerate(parsed.calls):
            if i < len(self._calls):
                sent = self._calls[i]
                if call.name != sent.name:
                    raise ParserContractError(f"{who} renamed call {i} from {sent.name!r} to "
                                              f"{call.name!r}")
                new_a = _extends(sent.arguments, call.arguments, f"call {i}'s arguments", who)
                if new_a:
                    out.tool_calls.append(DeltaToolCall(index=i, arguments=new_a))
                    sent.arguments = call.arguments
                continue
            if not call.name or (not final and self.tool_names is not None
                                 and call.name not in self.tool_names):
                # Its name first, and a name of the request's tools (a call of another is
                # malformed, read as content at the end): later calls wait for it.
                break
            sent = _SentCall(new_tool_call_id(), call.name, call.arguments)
            self._calls.append(sent)
            out.tool_calls.append(DeltaToolCall(index=i, id=sent.id, name=call.name,
                                                arguments=call.arguments))
        return out, parsed, reasoning

    def delta(self, text: str) -> DeltaMessage | None:
        """What is new in ``text`` (the whole output so far) since the last call, or None."""
        out, _, _ = self._diff(text, final=False)
        return out or None

    def finish(self, text: str) -> tuple[DeltaMessage | None, ChatMessageParts]:
        """The last delta and the whole message of the final ``text``."""
        out, parsed, reasoning = self._diff(text, final=True)
        calls = []
        if not self.malformed:
            for i, call in enumerate(parsed.calls):
                call_id = self._calls[i].id if i < len(self._calls) else new_tool_call_id()
                calls.append(ToolCall(FunctionCall(call.name or "", call.arguments or "{}"),
                                      id=call_id))
            # Calls whose name came only now were sent whole above; a call with no arguments
            # is sent "{}" here, as the message has it.
            for i, call in enumerate(parsed.calls):
                if not call.arguments and i < len(self._calls):
                    out.tool_calls.append(DeltaToolCall(index=i, arguments="{}"))
        return out or None, ChatMessageParts(content=self._content_sent or None,
                                             reasoning_content=reasoning or None,
                                             tool_calls=calls)


# ---------------------------------------------------------------------- forced calls
class ForcedToolCalls(ToolParser):
    """The reading of output constrained by ``forced_tool_schema``: a named function's
    arguments object (``name`` given), or (``"required"``) a JSON array of
    ``{"name": ..., "parameters": {...}}``."""

    def __init__(self, tools: Sequence[dict] | None = None, name: str | None = None) -> None:
        super().__init__(tools)
        self.name = name
        self._last = ParsedToolCalls(content="")

    def parse(self, text: str, final: bool) -> ParsedToolCalls:
        try:
            self._last = self._named(text, final) if self.name is not None \
                else self._array(text, final)
        except ToolParseError:
            raise
        except (ValueError, RecursionError) as exc:   # JSONScanError, a member not JSON
            if final:
                raise ToolParseError(f"the constrained output is not the call's JSON: {exc}")
            # (the calls read so far stand until the end says the output is malformed)
        return self._last

    def _named(self, text: str, final: bool) -> ParsedToolCalls:
        start = skip_ws(text, 0)
        end = scan_value(text, start)
        if final and end is None:
            raise ToolParseError("the arguments object is unfinished")
        if final and text[end:].strip():
            raise ToolParseError("text after the arguments object")
        return ParsedToolCalls(content="", calls=[PartialToolCall(
            self.name, text[start:end if end is not None else len(text)])])

    def _array(self, text: str, final: bool) -> ParsedToolCalls:
        calls: list[PartialToolCall] = []
        i = skip_ws(text, 0)
        if i >= len(text):
            if final:
                raise ToolParseError("no output")
            return ParsedToolCalls(content="")
        if text[i] != "[":
            raise JSONScanError(f"expected '[' at {i}")
        i = skip_ws(text, i + 1)
        done = False
        while i < len(text):
            if text[i] == "]":
                done = True
                break
            members, end = object_members(text, i)
            name = args = None
            for m in members:
                if m.key == "name" and m.end is not None:
                    name = m.value(text)
                elif m.key in ("parameters", "arguments"):
                    args = text[m.start:m.end if m.end is not None else len(text)]
            calls.append(PartialToolCall(name if isinstance(name, str) else None, args or ""))
            if end is None:
                break
            i = skip_ws(text, end)
            if i < len(text) and text[i] == ",":
                i = skip_ws(text, i + 1)
        if final and not done:
            raise ToolParseError("the array of calls is unfinished")
        return ParsedToolCalls(content="", calls=calls)


def _parameters(tool: Mapping[str, Any]) -> dict:
    params = tool.get("function", {}).get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object"}


def _hoisted(schema: dict, prefix: str, defs: dict) -> dict:
    """``schema`` with its own ``$defs`` (and ``definitions``) moved into ``defs`` under
    ``prefix``, and its references to them rewritten: a tool's schema nested in the array of
    calls keeps resolving its ``#/$defs/...`` (they are relative to the document's root)."""
    own = {**schema.get("definitions", {}), **schema.get("$defs", {})}
    if not own:
        return schema
    names = {k: f"{prefix}{k}" for k in own}

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            out = {}
            for k, v in node.items():
                if k == "$ref" and isinstance(v, str):
                    for root in ("#/$defs/", "#/definitions/"):
                        head, _, rest = v[len(root):].partition("/")
                        if v.startswith(root) and head in names:
                            v = f"#/$defs/{names[head]}" + (f"/{rest}" if rest else "")
                            break
                    out[k] = v
                else:
                    out[k] = rewrite(v)
            return out
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node
    for k, v in own.items():
        defs[names[k]] = rewrite(v)
    return rewrite({k: v for k, v in schema.items() if k not in ("$defs", "definitions")})


def forced_tool_schema(tools: Sequence[Mapping[str, Any]], choice: str | None,
                       parallel: bool = True) -> dict:
    """The JSON schema that makes a model call a tool: the named function's parameters
    (``choice`` its name), or for ``"required"`` (``choice`` None) an array of at least one
    ``{"name", "parameters"}`` object of any of the tools (at most one when not
    ``parallel``), each tool's ``$defs`` moved to the root under its name."""
    if choice is not None:
        for tool in tools:
            if tool.get("function", {}).get("name") == choice:
                return _parameters(tool)
        raise KeyError(choice)
    defs: dict = {}
    items = [{"type": "object",
              "properties": {"name": {"const": t["function"]["name"]},
                             "parameters": _hoisted(_parameters(t),
                                                    f"{t['function']['name']}.", defs)},
              "required": ["name", "parameters"], "additionalProperties": False}
             for t in tools]
    schema: dict = {"type": "array", "minItems": 1,
                    "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


__all__ = ["ChatOutputParser", "ForcedToolCalls", "ParserContractError", "ParserNames",
           "forced_tool_schema"]
