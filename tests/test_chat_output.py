"""The core's reading of generated chat text (``corellm.serving.chat_output``): partial JSON
spans, stream deltas that concatenate to the message, the calls of a required or named
``tool_choice``, and parsers that break their contract or raise, named."""

from __future__ import annotations

import json

import jsonschema
import pytest

from corellm.errors import PluginError
from corellm.interfaces import ReasoningParser, ToolParser
from corellm.serving.chat_output import (ChatOutputParser, ForcedToolCalls, ParserContractError,
                                         ParserNames, forced_tool_schema)
from corellm.serving.partial_json import (JSONScanError, object_members, partial_suffix,
                                          scan_value)
from corellm.tool_calls import ParsedReasoning, ParsedToolCalls, PartialToolCall


@pytest.mark.parametrize("value", ['{"a": [1, {"b": "x}]"}], "c": null}', '"q\\"}"', '[]',
                                   '-12.5e3 ', "true", '{"k": "\\\\"}'])
def test_scan_value_finds_the_end_and_never_before(value):
    end = scan_value(value, 0)
    assert end == len(value.rstrip())
    json.loads(value[:end])
    for i in range(len(value.rstrip())):
        assert scan_value(value[:i], 0) is None, value[:i]


def test_scan_value_refuses_what_cannot_be_json():
    for bad in ("{]", "x", '{"a": 1]'):
        with pytest.raises(JSONScanError):
            scan_value(bad, 0)


def test_object_members_as_far_as_the_text_goes():
    text = '{"name": "f", "arguments": {"x": "a,b}"}}'
    members, end = object_members(text, 0)
    assert end == len(text)
    assert [(m.key, text[m.start:m.end]) for m in members] == \
        [("name", '"f"'), ("arguments", '{"x": "a,b}"}')]
    members, end = object_members(text[:-6], 0)
    assert end is None and members[1].end is None
    assert text[members[1].start:len(text) - 6] == '{"x": "a'
    assert object_members('{"na', 0) == ([], None)


def test_partial_suffix():
    assert partial_suffix("hello <tool", "<tool_call>") == 5
    assert partial_suffix("hello", "<tool_call>") == 0
    assert partial_suffix("<tool_call>", "<tool_call>") == 0      # whole: not partial


class Tagged(ToolParser):
    """A small parser for the tests: ``CALL name {json}`` at the end of the text."""

    def parse(self, text, final):
        head, sep, rest = text.partition("CALL ")
        if not sep:
            return ParsedToolCalls(content=text[:len(text) - partial_suffix(text, "CALL ")])
        name, space, args = rest.partition(" ")
        if not space:
            return ParsedToolCalls(content=head, calls=[PartialToolCall(None)])
        return ParsedToolCalls(content=head, calls=[PartialToolCall(name, args)])


def _replay(parser_factory, text, cuts):
    """Stream ``text`` cut at ``cuts``: the joined deltas and the final message."""
    p = parser_factory()
    content, reasoning, calls = "", "", {}

    def take(d):
        nonlocal content, reasoning
        if d is None:
            return
        content += d.content or ""
        reasoning += d.reasoning_content or ""
        for t in d.tool_calls:
            c = calls.setdefault(t.index, {"id": t.id, "name": t.name, "arguments": ""})
            assert t.index in calls
            c["arguments"] += t.arguments or ""
    for cut in cuts:
        take(p.delta(text[:cut]))
    last, message = p.finish(text)
    take(last)
    return content or None, reasoning or None, calls, message


@pytest.mark.parametrize("cuts", [[], [3, 9, 14], list(range(1, 40))])
def test_deltas_concatenate_to_the_message(cuts):
    text = 'Sure.  CALL get {"a": "b c"}'
    content, _, calls, message = _replay(lambda: ChatOutputParser(tools=Tagged()), text, cuts)
    assert content == message.content == "Sure."
    assert len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert (call.function.name, call.function.arguments) == ("get", '{"a": "b c"}')
    assert calls == {0: {"id": call.id, "name": "get", "arguments": '{"a": "b c"}'}}


def test_a_call_of_an_unknown_tool_is_content():
    text = 'CALL rm {"path": "/"}'
    p = ChatOutputParser(tools=Tagged(), tool_names=frozenset({"get"}))
    _, message = p.finish(text)
    assert message.content == text and not message.tool_calls
    assert "not among the request's tools" in p.malformed


class Think(ReasoningParser):
    end_marker = "</t>"

    def parse(self, text, final):
        r, sep, c = text.partition("</t>")
        if sep:
            return ParsedReasoning(r, c, True)
        return ParsedReasoning(r[:len(r) - partial_suffix(r, "</t>")], "", False)


def test_reasoning_then_content_then_a_call():
    text = 'hmm</t>Ok CALL get {}'
    content, reasoning, calls, message = _replay(
        lambda: ChatOutputParser(tools=Tagged(), reasoning=Think()), text, range(1, len(text)))
    assert (reasoning, content) == ("hmm", "Ok") == (message.reasoning_content,
                                                     message.content)
    assert message.tool_calls[0].function.arguments == "{}"
    assert calls[0]["arguments"] == "{}"


def test_a_parser_that_breaks_the_prefix_rule_or_raises_is_named():
    class Shrinks(ToolParser):
        def parse(self, text, final):
            return ParsedToolCalls(content=text[::-1])

    class Raises(ToolParser):
        def parse(self, text, final):
            raise KeyError("boom")
    p = ChatOutputParser(tools=Shrinks(), names=ParserNames(tool="tool parser 'x' of y"))
    p.delta("ab")
    with pytest.raises(ParserContractError, match="tool parser 'x' of y"):
        p.delta("abc")
    p = ChatOutputParser(tools=Raises(), names=ParserNames(tool="tool parser 'r' of pkg 1.0"))
    with pytest.raises(PluginError, match="tool parser 'r' of pkg 1.0 failed: KeyError"):
        p.delta("x")


TOOLS = [{"type": "function", "function": {"name": "a", "parameters": {
            "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}},
         {"type": "function", "function": {"name": "b"}}]


def test_forced_schemas():
    assert forced_tool_schema(TOOLS, "a") == TOOLS[0]["function"]["parameters"]
    assert forced_tool_schema(TOOLS, "b") == {"type": "object"}
    schema = forced_tool_schema(TOOLS, None, parallel=False)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    jsonschema.validate([{"name": "a", "parameters": {"n": 1}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "a", "parameters": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], schema)
    with pytest.raises(KeyError):
        forced_tool_schema(TOOLS, "zzz")


def test_forced_calls_stream_as_they_are_generated():
    text = '[{"name": "a", "parameters": {"n": 12}}, {"name": "b", "parameters": {}}]'
    content, _, calls, message = _replay(lambda: ChatOutputParser(tools=ForcedToolCalls(TOOLS)),
                                         text, range(1, len(text)))
    assert content is None and message.content is None
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == \
        [("a", '{"n": 12}'), ("b", "{}")]
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == \
        [("a", '{"n": 12}'), ("b", "{}")]
    named = '{"n": 3}'
    _, _, calls, message = _replay(lambda: ChatOutputParser(tools=ForcedToolCalls(TOOLS, "a")),
                                   named, range(1, len(named)))
    assert message.tool_calls[0].function.arguments == named == calls[0]["arguments"]


def test_forced_output_cut_short_is_content_with_the_reason():
    p = ChatOutputParser(tools=ForcedToolCalls(TOOLS))
    _, message = p.finish('[{"name": "a", "parameters": {"n": 1')
    assert message.content == '[{"name": "a", "parameters": {"n": 1'
    assert p.malformed == "the array of calls is unfinished"


def test_raw_control_characters_in_arguments_become_escapes_prefix_by_prefix():
    """A constrained decoder's JSON grammar lets a model write a raw control character in a
    string: the arguments a client gets are strict JSON, streamed and not, all the same."""
    text = '[{"name": "a", "parameters": {"n": 1, "s": "x\x1dy\\"\x01"}}]'
    tools = TOOLS[:1] + [{"type": "function", "function": {"name": "a2"}}]
    _, _, calls, message = _replay(lambda: ChatOutputParser(tools=ForcedToolCalls(tools)),
                                   text, range(1, len(text)))
    args = message.tool_calls[0].function.arguments
    assert json.loads(args) == {"n": 1, "s": 'x\x1dy"\x01'}
    assert "\x1d" not in args and calls[0]["arguments"] == args


def test_required_keeps_each_tools_definitions_resolvable():
    """Tools' schemas with ``$defs`` (what pydantic writes): nested in the array of calls, their
    references would point at the array; they are moved to the root under each tool's name."""
    def tool(name, field):
        return {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "required": ["p"],
            "$defs": {"P": {"type": "object", "properties": {field: {"type": "integer"}},
                            "required": [field]}}}}}
    schema = forced_tool_schema([tool("a", "x"), tool("b", "y")], None)
    assert set(schema["$defs"]) == {"a.P", "b.P"}
    jsonschema.validate([{"name": "a", "parameters": {"p": {"x": 1}}},
                         {"name": "b", "parameters": {"p": {"y": 2}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "a", "parameters": {"p": {"y": 1}}}], schema)


def test_a_call_of_an_unknown_tool_is_not_streamed_as_a_call():
    text = 'CALL rm {"path": "/"}'
    _, _, calls, message = _replay(
        lambda: ChatOutputParser(tools=Tagged(), tool_names=frozenset({"get"})), text,
        range(1, len(text)))
    assert calls == {} and message.content == text and not message.tool_calls


def test_a_parser_rewriting_arguments_it_gave_is_caught():
    class Rewrites(ToolParser):
        def parse(self, text, final):
            return ParsedToolCalls(content="", calls=[PartialToolCall("f", text)])
    p = ChatOutputParser(tools=Rewrites())
    p.delta('{"a":1')
    with pytest.raises(ParserContractError, match="arguments"):
        p.delta('{"b":22}')


def test_a_parser_returning_the_wrong_types_is_named():
    class Wrong(ToolParser):
        def parse(self, text, final):
            return ParsedToolCalls(content=None)
    with pytest.raises(ParserContractError, match="tool parser 'w'"):
        ChatOutputParser(tools=Wrong(), names=ParserNames(tool="tool parser 'w'")).delta("x")
