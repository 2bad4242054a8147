"""The example parsers, examples/corellm-xml-tools, imported from the source tree: the tool
parser ``xml_function`` (``<function=NAME>{json}</function>``) and the reasoning parser
``thought`` (``<thought>...</thought>``), read through the core's ``ChatOutputParser`` as the
server reads them, streamed with a cut at every index: the deltas concatenate to the final
message, the prefix rule holds, malformed calls come back as content with the reason, and the
plugin registers both through the registry. The server, through the installed entry point, is
in tests/test_examples_installed.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.plugin_fixtures import source_module

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "corellm-xml-tools"
EXAMPLE_MODULE = "corellm_xml_tools"
EXAMPLE_ENTRY_POINT = "xml_tools"         # [project.entry-points.corellm] in its pyproject.toml
TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
         for name in ("get_weather", "get_time")]


@pytest.fixture
def xml(monkeypatch):
    """The example's plugin module, imported from the source tree, not installed."""
    yield from source_module(monkeypatch, EXAMPLE, EXAMPLE_MODULE)


def chat_parser(module, tools: bool = True, reasoning: bool = True):
    from corellm.serving.chat_output import ChatOutputParser

    return ChatOutputParser(
        tools=module.XmlFunctionToolParser(TOOLS) if tools else None,
        reasoning=module.ThoughtReasoningParser() if reasoning else None,
        tool_names=frozenset(t["function"]["name"] for t in TOOLS) if tools else None)


def replay(parser, text: str, cuts) -> tuple[str | None, str | None, list[dict], object]:
    """Stream ``text`` cut at ``cuts`` through ``parser``: the joined content, reasoning and
    calls (each call's id and name sent once, first), and the final message."""
    content, reasoning, calls = "", "", {}

    def take(delta) -> None:
        nonlocal content, reasoning
        if delta is None:
            return
        content += delta.content or ""
        reasoning += delta.reasoning_content or ""
        for t in delta.tool_calls:
            if t.index not in calls:
                assert t.id and t.name, "a call's first delta has its id and name"
                assert t.index == len(calls), "calls come in order"
                calls[t.index] = {"id": t.id, "name": t.name, "arguments": ""}
            else:
                assert t.id is None and t.name is None, "a call's id and name come once"
            calls[t.index]["arguments"] += t.arguments or ""

    for cut in cuts:
        take(parser.delta(text[:cut]))
    last, message = parser.finish(text)
    take(last)
    return content or None, reasoning or None, [calls[i] for i in sorted(calls)], message


def every_cut(text: str) -> list[range]:
    return [range(0), range(1, len(text)), range(1, len(text), 7)]


ANSWERS = [
    # (text, content, [(name, arguments)])
    ('<function=get_weather>{"city": "Oslo"}</function>', None,
     [("get_weather", '{"city": "Oslo"}')]),
    ('I\'ll check both.\n<function=get_weather>{"city": "Z\\u00fcrich",\n "days": [1, 2]}'
     '</function>\n<function=get_time> {"zone": "CET"} </function>',
     "I'll check both.",
     [("get_weather", '{"city": "Z\\u00fcrich",\n "days": [1, 2]}'),
      ("get_time", '{"zone": "CET"}')]),
    # The arguments end where their JSON does: a tag inside a string is text.
    ('<function=get_weather>{"city": "</function> <function=x>"}</function> Done.',
     "Done.", [("get_weather", '{"city": "</function> <function=x>"}')]),
    # No arguments: "{}" in the message and, once, in the stream.
    ("Now: <function=get_time></function>", "Now:", [("get_time", "{}")]),
    # A "<" that never becomes a call is content, once it is known not to.
    ("a < b, <func but no call", "a < b, <func but no call", []),
]


@pytest.mark.parametrize("text, content, calls", ANSWERS)
def test_deltas_concatenate_to_the_message_at_every_cut(xml, text, content, calls):
    for cuts in every_cut(text):
        parser = chat_parser(xml, reasoning=False)
        s_content, s_reasoning, s_calls, message = replay(parser, text, cuts)
        assert parser.malformed is None
        assert message.content == s_content == content
        assert message.reasoning_content is None and s_reasoning is None
        assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == calls
        assert [(c["name"], c["arguments"]) for c in s_calls] == calls
        assert [c["id"] for c in s_calls] == [c.id for c in message.tool_calls]
        for call in message.tool_calls:
            assert isinstance(json.loads(call.function.arguments), dict)


THOUGHT = ('<thought>\nThe user wants the weather.\nA tool: get_weather.\n</thought>\n'
           'Checking.\n<function=get_weather>{"city": "Oslo"}</function>')


@pytest.mark.parametrize("text, reasoning, content, calls", [
    (THOUGHT, "The user wants the weather.\nA tool: get_weather.", "Checking.",
     [("get_weather", '{"city": "Oslo"}')]),
    ("  <thought>hm</thought>\n\nParis.", "hm", "Paris.", []),
    # Not starting with <thought>: all answer, whatever follows.
    ("Paris. <thought>no</thought>", None, "Paris. <thought>no</thought>", []),
    ("<thoughts>", None, "<thoughts>", []),
    ("<thou", None, "<thou", []),
    # Cut short while thinking: reasoning only, no answer, and no call read from the thinking.
    ('<thought>\nmaybe <function=get_time>{"zone": "UTC"}</function>\n', 'maybe '
     '<function=get_time>{"zone": "UTC"}</function>', None, []),
])
def test_reasoning_then_the_answer_at_every_cut(xml, text, reasoning, content, calls):
    for cuts in every_cut(text):
        s_content, s_reasoning, s_calls, message = replay(chat_parser(xml), text, cuts)
        assert message.reasoning_content == s_reasoning == reasoning
        assert message.content == s_content == content
        assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == calls
        assert [(c["name"], c["arguments"]) for c in s_calls] == calls


def test_the_prefix_rule_held_directly(xml):
    """Each reading of a longer text extends the one before: content, the calls' names once
    known, their arguments; the last reading (final) extends them all."""
    text = THOUGHT.split("</thought>\n")[1] + ' then <function=get_time>{"zone": "CET"}'
    text += "</function>"
    tools, thought = xml.XmlFunctionToolParser(TOOLS), xml.ThoughtReasoningParser()
    readings = [tools.parse(text[:k], final=False) for k in range(len(text) + 1)]
    readings.append(tools.parse(text, final=True))
    for old, new in zip(readings, readings[1:]):
        assert new.content.startswith(old.content)
        assert len(new.calls) >= len(old.calls)
        for a, b in zip(old.calls, new.calls):
            assert a.name in (None, b.name) and b.arguments.startswith(a.arguments)
    thoughts = [thought.parse(THOUGHT[:k], final=False) for k in range(len(THOUGHT) + 1)]
    thoughts.append(thought.parse(THOUGHT, final=True))
    for old, new in zip(thoughts, thoughts[1:]):
        assert new.reasoning.startswith(old.reasoning) and new.content.startswith(old.content)
        assert new.answer_started or not old.answer_started


def test_a_partial_tag_is_held_back_and_the_name_waits_for_its_gt(xml):
    from corellm.tool_calls import PartialToolCall

    p = xml.XmlFunctionToolParser(TOOLS)
    assert p.parse("Hi <func", final=False).content == "Hi "
    assert p.parse("Hi <func", final=True).content == "Hi <func"
    assert p.parse("Hi <function=get_wea", final=False).calls == [PartialToolCall(None)]
    assert p.parse("Hi <function=get_weather>", final=False).calls == \
        [PartialToolCall("get_weather", "")]
    assert p.parse('<function=get_weather> {"city": "Os', final=False).calls == \
        [PartialToolCall("get_weather", '{"city": "Os')]
    r = xml.ThoughtReasoningParser()
    assert (r.parse("<thought>a </thou", final=False).reasoning, r.end_marker) == \
        ("a", "</thought>")
    assert r.parse("<thought>a </thought> b", final=False).content == "b"


@pytest.mark.parametrize("text, reason", [
    ('<function=get_weather>{"city": Oslo}</function>', "are not JSON"),
    ('Sure. <function=get_weather>{"city": "Oslo"}', "unterminated"),
    ('<function=get_weather>{"city": "Oslo"', "unfinished"),
    ("<function=get weather>{}</function>", "is not a function name"),
    ("<function=>{}</function>", "is not a function name"),
    ("<function=get_weather", "its name is unterminated"),
    ("<function=get_weather>[1, 2]</function>", "a list, not a JSON object"),
    ('<function=get_weather>{"a" 1}</function>', "are not JSON"),
    ('<function=get_weather>{"city": "Oslo"} and </function>', "text after its arguments"),
    # The second call is malformed: the first, already streamed, is not in the message.
    ('<function=get_time>{}</function> <function=get_weather>{"x": tru}</function>',
     "are not JSON"),
])
def test_a_malformed_call_is_content_with_the_reason(xml, text, reason):
    from corellm.tool_calls import ToolParseError

    with pytest.raises(ToolParseError, match=reason):
        xml.XmlFunctionToolParser(TOOLS).parse(text, final=True)
    for cuts in every_cut(text):
        parser = chat_parser(xml, reasoning=False)
        s_content, _, _, message = replay(parser, text, cuts)
        assert message.content == s_content == text.strip()
        assert message.tool_calls == []
        assert reason in parser.malformed


def test_a_call_of_a_tool_the_request_does_not_have_is_content(xml):
    text = '<function=rm_rf>{"path": "/"}</function>'
    parser = chat_parser(xml)
    _, message = parser.finish(text)
    assert message.content == text and not message.tool_calls
    assert "not among the request's tools" in parser.malformed


def test_registered_through_the_registry_and_the_example_config(xml):
    from corellm.components import ReasoningParserSpec, ToolParserSpec
    from corellm.config.compose import load_config
    from corellm.plugins import PLUGIN_API_VERSION
    from corellm.plugins.discovery import load_registry
    from corellm_plugins.frontend_openai.tools import ChatTools

    assert xml.CORELLM_PLUGIN_API == ".".join(map(str, PLUGIN_API_VERSION))
    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["corellm"] == {EXAMPLE_ENTRY_POINT: EXAMPLE_MODULE}

    # The entry point is disabled in case the example is also installed here.
    registry = load_registry(disable=[EXAMPLE_ENTRY_POINT], plugins=[xml])
    assert registry.broken == []
    tool = registry.get("tool_parser", "xml_function")
    thought = registry.get("reasoning_parser", "thought")
    assert isinstance(tool.spec, ToolParserSpec) and not tool.spec.special_tokens
    assert isinstance(thought.spec, ReasoningParserSpec)
    assert isinstance(tool.spec.factory(TOOLS), xml.XmlFunctionToolParser)
    assert isinstance(thought.spec.factory(), xml.ThoughtReasoningParser)
    assert "xml_function" in registry.choices("tool_parser")
    assert "tool parser 'xml_function'" in tool.describe()

    # The config: the server's parsers, resolved by name as `corellm serve` resolves them.
    config = load_config(EXAMPLE / "config.yaml", registry=registry)
    assert (config.frontend.name, config.frontend.tool_call_parser,
            config.frontend.reasoning_parser, config.frontend.enable_auto_tool_choice) == (
        "openai", "xml_function", "thought", True)
    chat_tools = ChatTools.for_options(config.frontend, registry)
    assert chat_tools.tool_parser is tool and chat_tools.reasoning_parser is thought
    parser = chat_tools.output_parser("auto", None, TOOLS)
    _, message = parser.finish(THOUGHT)
    assert message.reasoning_content.startswith("The user wants")
    assert [c.function.name for c in message.tool_calls] == ["get_weather"]


def test_entry_module_does_not_import_torch():
    """Discovery imports the entry module on every run: the parsers need no torch."""
    code = (f"import sys, {EXAMPLE_MODULE}; "
            "print(sorted({'torch', 'numpy', 'transformers'} & set(sys.modules)))")
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                          text=True, timeout=60, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": f"{EXAMPLE}{os.pathsep}{REPO}"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
