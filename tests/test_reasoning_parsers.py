"""The built-in reasoning parsers (plugin ``reasoning_parsers``: qwen3, deepseek_r1) on
hand-written outputs: where the reasoning ends and the answer starts, the line breaks around
the tags, the prefix rule on every prefix, streaming through ``ChatOutputParser`` cut at every
index and char by char (alone and with a tool parser), and the registry."""

from __future__ import annotations

import pytest

from corellm.interfaces import ReasoningParser
from corellm.serving.chat_output import ChatOutputParser
from corellm.tool_calls import ParsedReasoning
from corellm_plugins.reasoning_parsers.think import (DeepSeekR1ReasoningParser,
                                                     Qwen3ReasoningParser)
from corellm_plugins.tool_parsers.hermes import HermesToolParser
from tests.test_tool_parsers import assert_streams

PARSERS = {"qwen3": Qwen3ReasoningParser, "deepseek_r1": DeepSeekR1ReasoningParser}

# (parser, output, reasoning, content, answer_started) of the final reading
CASES = [
    ("qwen3", "<think>\nLet me add: 2 + 2 = 4.\n</think>\n\nThe answer is 4.",
     "Let me add: 2 + 2 = 4.", "The answer is 4.", True),
    ("qwen3", "<think>\n\nZürich → 東京 🚄?\nFirst line.\n\nSecond.\n\n</think>\n\nYes 🎉\n",
     "Zürich → 東京 🚄?\nFirst line.\n\nSecond.", "Yes 🎉\n", True),
    ("qwen3", "\n<think></think>Short.", "", "Short.", True),
    ("qwen3", "<think>\n\n</think>\n\nThinking was empty.", "", "Thinking was empty.", True),
    ("qwen3", "The answer is 4.", "", "The answer is 4.", True),
    ("qwen3", "\n\nAnswer with a </think> in it.", "", "\n\nAnswer with a </think> in it.",
     True),
    ("qwen3", "<thinking> is not the tag", "", "<thinking> is not the tag", True),
    ("qwen3", "<thi", "", "<thi", True),
    ("qwen3", "<think>\nCut off by max_tokens\n", "Cut off by max_tokens\n", "", False),
    ("qwen3", "<think>\nNested <think> stays; a </thin is text.\n</think>A",
     "Nested <think> stays; a </thin is text.", "A", True),
    ("deepseek_r1", "Okay, 2 + 2.\nThat is 4.\n</think>\n\n**4**",
     "Okay, 2 + 2.\nThat is 4.", "**4**", True),
    ("deepseek_r1", "<think>\nHmm, Zürich or 東京 🗼\n</think>\n\nTokyo.",
     "Hmm, Zürich or 東京 🗼", "Tokyo.", True),
    ("deepseek_r1", "\n\nLeading lines are layout.\n</think>Done", "Leading lines are layout.",
     "Done", True),
    ("deepseek_r1", "</think>\n\nNo thinking at all.", "", "No thinking at all.", True),
    ("deepseek_r1", "All reasoning, never ended.\n\n", "All reasoning, never ended.\n\n", "",
     False),
    ("deepseek_r1", "<thi", "<thi", "", False),
    ("deepseek_r1", "", "", "", False),
]


def _id(case) -> str:
    return f"{case[0]}:{case[1][:30]!r}"


def _assert_extends(old: ParsedReasoning, new: ParsedReasoning) -> None:
    assert new.reasoning.startswith(old.reasoning), (old.reasoning, new.reasoning)
    assert new.content.startswith(old.content), (old.content, new.content)
    assert new.answer_started or not old.answer_started


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_reasoning_and_answer(case):
    name, text, reasoning, content, started = case
    assert PARSERS[name]().parse(text, True) == ParsedReasoning(reasoning, content, started)
    message = assert_streams(lambda: ChatOutputParser(reasoning=PARSERS[name]()), text)
    assert message.reasoning_content == (reasoning or None)
    assert message.content == (content or None)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_every_prefix_extends_to_the_final_reading(case):
    name, text = case[:2]
    parser = PARSERS[name]()
    final = parser.parse(text, True)
    before = ParsedReasoning("", "", False)
    for i in range(len(text) + 1):
        now = parser.parse(text[:i], False)
        _assert_extends(before, now)
        _assert_extends(now, final)
        before = now


def test_streaming_holds_back_what_may_be_stripped():
    qwen = Qwen3ReasoningParser()
    assert qwen.parse(" <thi", False) == ParsedReasoning("", "", False)
    assert qwen.parse("<think>\n\nabc\n\n", False).reasoning == "abc"
    assert qwen.parse("<think>\nabc\n</thi", False).reasoning == "abc"
    assert qwen.parse("<think>\nabc\n</think>\n", False) == ParsedReasoning("abc", "", True)
    assert qwen.parse("Hi", False) == ParsedReasoning("", "Hi", True)
    r1 = DeepSeekR1ReasoningParser()
    assert r1.parse("\n", False) == ParsedReasoning("", "", False)
    assert r1.parse("abc </", False).reasoning == "abc "
    assert r1.parse("abc </", True).reasoning == "abc </"
    assert r1.parse("<think>\nabc", False).reasoning == "abc"


TOOL_CASES = [
    ("qwen3", '<think>\nThe user wants the weather in Zürich.\n</think>\n\n<tool_call>\n'
              '{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>',
     "The user wants the weather in Zürich.", None),
    ("deepseek_r1", 'Need a tool.\n</think>\n\nOne moment.\n<tool_call>\n{"name": '
                    '"get_weather", "arguments": {"city": "東京"}}\n</tool_call>',
     "Need a tool.", "One moment."),
]


@pytest.mark.parametrize("case", TOOL_CASES, ids=_id)
def test_reasoning_then_tool_calls(case):
    name, text, reasoning, content = case
    message = assert_streams(lambda: ChatOutputParser(reasoning=PARSERS[name](),
                                                      tools=HermesToolParser()), text)
    assert message.reasoning_content == reasoning and message.content == content
    assert [c.function.name for c in message.tool_calls] == ["get_weather"]


def test_a_tool_call_inside_the_reasoning_is_not_a_call():
    text = '<think>\nMaybe <tool_call>{"name": "f"}</tool_call>?\n</think>\n\nNo call.'
    message = assert_streams(lambda: ChatOutputParser(reasoning=Qwen3ReasoningParser(),
                                                      tools=HermesToolParser()), text)
    assert message.content == "No call." and not message.tool_calls


def test_reasoning_parsers_are_registered():
    from corellm.plugins.discovery import load_registry

    registry = load_registry()
    assert set(registry.choices("reasoning_parser")) >= set(PARSERS)
    for name, cls in PARSERS.items():
        entry = registry.get("reasoning_parser", name)
        assert entry.plugin.distribution == "corellm"
        assert entry.plugin.value == "corellm_plugins.reasoning_parsers"
        assert entry.spec.special_tokens is False and entry.spec.summary
        parser = entry.spec.factory()
        assert isinstance(parser, ReasoningParser) and isinstance(parser, cls)
        assert parser.end_marker == "</think>"
