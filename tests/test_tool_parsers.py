"""The built-in tool parsers (plugin ``tool_parsers``: hermes, llama3_json, mistral, pythonic)
on hand-written model outputs: the calls and content they read, the prefix rule on every
prefix of every output, streaming through ``ChatOutputParser`` cut at every index and char by
char (the deltas concatenate to the message, which equals the unstreamed one), malformed calls
(``ToolParseError`` at the end, the whole text as content) and the registry."""

from __future__ import annotations

import json
import random

import pytest

from corellm.interfaces import ToolParser
from corellm.serving.chat_output import ChatOutputParser
from corellm.tool_calls import ParsedToolCalls, ToolParseError
from corellm_plugins.tool_parsers.hermes import HermesToolParser
from corellm_plugins.tool_parsers.llama3_json import Llama3JsonToolParser
from corellm_plugins.tool_parsers.mistral import MistralToolParser
from corellm_plugins.tool_parsers.pythonic import PythonicToolParser

PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser,
           "mistral": MistralToolParser, "pythonic": PythonicToolParser}

# (parser, output, the message's content (None: none), [(name, arguments), ...])
CALLS = [
    # ------------------------------------------------------------------ hermes
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
               '"days": 3}}\n</tool_call>',
     None, [("get_weather", {"city": "Paris", "days": 3})]),
    ("hermes", 'Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Zürich"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
               '"parameters": {"tz": "Asia/Tokyo", "label": "東京 🌸"}}\n</tool_call>\nDone.',
     "Let me check both.\n\n\nDone.",
     [("get_weather", {"city": "Zürich"}), ("get_time", {"tz": "Asia/Tokyo",
                                                          "label": "東京 🌸"})]),
    ("hermes", r'<tool_call>{"name": "run", "arguments": {"cmd": "echo \"hi\" > C:\\tmp\\o.txt",'
               r' "note": "tab\there \u00e9 \ud83d\ude00"}}</tool_call>',
     None, [("run", {"cmd": 'echo "hi" > C:\\tmp\\o.txt', "note": "tab\there é 😀"})]),
    ("hermes", '<tool_call>{"name": "ping"}</tool_call>', None, [("ping", {})]),
    ("hermes", '<tool_call>{"arguments": {"x": [1, {"y": null}]}, "name": "f"}</tool_call>',
     None, [("f", {"x": [1, {"y": None}]})]),
    ("hermes", '<tool_call>{"name": "echo", "arguments": {"text": "a </tool_call> b '
               '<tool_call>"}}</tool_call> after',
     "after", [("echo", {"text": "a </tool_call> b <tool_call>"})]),
    # ------------------------------------------------------------------ llama3_json
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}',
     None, [("get_weather", {"city": "Paris"})]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {"x": "Zürich"}}; '
                    '{"name": "b", "arguments": {"y": "東京 🎌"}}',
     None, [("a", {"x": "Zürich"}), ("b", {"y": "東京 🎌"})]),
    ("llama3_json", r' {"type": "function", "name": "run", "parameters": {"cmd": '
                    r'"say \"hi\" \\ bye"}}',
     None, [("run", {"cmd": 'say "hi" \\ bye'})]),
    ("llama3_json", '{"name": "a", "parameters": {}};\n', None, [("a", {})]),
    # ------------------------------------------------------------------ mistral
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
     None, [("get_weather", {"city": "Paris"})]),
    ("mistral", 'Checking.[TOOL_CALLS] [{"name": "a", "arguments": {"q": "Zürich"}}, '
                '{"name": "b", "arguments": {"q": "東京 ✈️", "n": -1.5e3}}]',
     "Checking.", [("a", {"q": "Zürich"}), ("b", {"q": "東京 ✈️", "n": -1500.0})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
     None, [("get_weather", {"city": "Paris"})]),
    ("mistral", r'Let me see.[TOOL_CALLS]a[ARGS]{"q": "say \"hi\""}[TOOL_CALLS]b[ARGS]'
                r'{"path": "C:\\x", "city": "Zürich 🏔"}',
     "Let me see.", [("a", {"q": 'say "hi"'}), ("b", {"path": "C:\\x",
                                                       "city": "Zürich 🏔"})]),
    ("mistral", '[TOOL_CALLS]get_time[CALL_ID]abc123XYZ[ARGS]{"tz": "UTC"}',
     None, [("get_time", {"tz": "UTC"})]),
    # ------------------------------------------------------------------ pythonic
    ("pythonic", '[get_weather(city="Paris", days=3)]',
     None, [("get_weather", {"city": "Paris", "days": 3})]),
    ("pythonic", "[get_weather(city='Zürich', units=None), get_time(tz=\"東京\", "
                 "tags=[\"🌸\", 'x'], opts={\"a\": (1, 2.5), \"b\": True})]",
     None, [("get_weather", {"city": "Zürich", "units": None}),
            ("get_time", {"tz": "東京", "tags": ["🌸", "x"],
                          "opts": {"a": [1, 2.5], "b": True}})]),
    ("pythonic", '[run(cmd="echo \\"hi\\" \\\\ done", raw=r"C:\\dir", multi="""a\nb)""")]',
     None, [("run", {"cmd": 'echo "hi" \\ done', "raw": "C:\\dir", "multi": "a\nb)"})]),
    ("pythonic", "\n[ ping() , pong(x=-1) ]", None, [("ping", {}), ("pong", {"x": -1})]),
    ("pythonic", "[f(s=\"a)b(c]\", t='[x]')]", None, [("f", {"s": "a)b(c]", "t": "[x]"})]),
]

# (parser, output): no call, all content (the message's content: the output, stripped)
PLAIN = [
    ("hermes", "Plain answer."),
    ("hermes", "Tags like <tool_ or <tool_call without > are text: a < b."),
    ("hermes", "It ends with <tool_call"),
    ("llama3_json", "The capital is Paris."),
    ("llama3_json", '<|python_tag|>print("hi")'),
    ("llama3_json", 'Sure! {"name": "a", "parameters": {}}'),
    ("llama3_json", "<|python_tag"),
    ("mistral", "Answer: 42."),
    ("mistral", "Ends with [TOOL_CA"),
    ("pythonic", "The list is [1, 2, 3]."),
    ("pythonic", "[1, 2]"),
    ("pythonic", "[note] something"),
    ("pythonic", "[get_weather (city='x')]"),
    ("pythonic", "Use [f(x=1)] maybe"),
    ("pythonic", "[unfinished"),
]

# (parser, output): a malformed call
MALFORMED = [
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call>'),
    ("hermes", '<tool_call>{"arguments": {"x": 1}}</tool_call>'),
    ("hermes", 'Sure <tool_call>{"name": "f", "arguments": {"x": 1}}'),
    ("hermes", '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>'),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": 01}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": 1}} oops</tool_call>'),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": "a\\qb"}}</tool_call>'),
    ("hermes", '<tool_call>{"na\\qme": "f"}</tool_call>'),
    ("hermes", '<tool_call>[{"name": "f"}]</tool_call>'),
    ("hermes", "<tool_call>"),
    ("llama3_json", '{"name": "a", "parameters": {"x": 1}} {"name": "b"}'),
    ("llama3_json", '{"parameters": {"x": 1}}'),
    ("llama3_json", '{"name": "a", "parameters": {"x": '),
    ("llama3_json", '{"name": "a", "parameters": "x=1"}'),
    ("llama3_json", '{"name": "a"} and more'),
    ("llama3_json", '{"name": "a", "parameters": {"x": tru}}'),
    ("mistral", "[TOOL_CALLS]"),
    ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}'),
    ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}] text'),
    ("mistral", "[TOOL_CALLS][]"),
    ("mistral", '[TOOL_CALLS]get weather[ARGS]{}'),
    ("mistral", '[TOOL_CALLS]a[ARGS]{"x": 1} trailing'),
    ("mistral", '[TOOL_CALLS]a[ARGS][1]'),
    ("mistral", '[TOOL_CALLS]a{"x": 1}'),
    ("mistral", '[TOOL_CALLS]a[ARGS]{"x": 1'),
    ("pythonic", "[f(1, 2)]"),
    ("pythonic", "[f(x=y)]"),
    ("pythonic", "[f(x=1)"),
    ("pythonic", "[f(x=1)] extra"),
    ("pythonic", "[f(x=1) g(y=2)]"),
    ("pythonic", "[f(**k)]"),
    ("pythonic", "[f(x={1, 2})]"),
    ("pythonic", "[f(x=1), 3]"),
    ("pythonic", "[f(x=(1]"),
    ("pythonic", "[f(x='a\nb')]"),
]


def _id(case) -> str:
    return f"{case[0]}:{case[1][:30]!r}"


# ---------------------------------------------------------------------- helpers
def _assert_extends(old: ParsedToolCalls, new: ParsedToolCalls) -> None:
    """The prefix rule: ``new`` (the reading of a longer text) extends ``old``."""
    assert new.content.startswith(old.content), (old.content, new.content)
    assert len(new.calls) >= len(old.calls)
    for a, b in zip(old.calls, new.calls):
        if a.name is not None:
            assert b.name == a.name
        assert b.arguments.startswith(a.arguments), (a.arguments, b.arguments)


def _absorb(acc: dict, delta) -> None:
    if delta is None:
        return
    acc["content"] += delta.content or ""
    acc["reasoning"] += delta.reasoning_content or ""
    for tc in delta.tool_calls:
        call = acc["calls"].setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
        if tc.id is not None:
            assert call["id"] is None, "a call's id sent twice"
            call["id"] = tc.id
        if tc.name is not None:
            assert call["name"] is None, "a call's name sent twice"
            call["name"] = tc.name
        call["arguments"] += tc.arguments or ""


def stream(make, text: str, cuts) -> tuple[dict, object, ChatOutputParser]:
    """Feed ``text`` cut at ``cuts`` to a fresh ``make()`` (a ChatOutputParser), then finish:
    the concatenated deltas, the message and the parser."""
    out = make()
    acc = {"content": "", "reasoning": "", "calls": {}}
    for cut in cuts:
        _absorb(acc, out.delta(text[:cut]))
    last, message = out.finish(text)
    _absorb(acc, last)
    return acc, message, out


def _calls_of(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls]


def assert_streams(make, text: str) -> object:
    """Streamed cut at each index, and char by char: the deltas concatenate to the message,
    which is the unstreamed message. Returns that message."""
    _, whole, plain = stream(make, text, [])
    assert plain.malformed is None, plain.malformed
    runs = [[i] for i in range(1, len(text))] + [list(range(1, len(text) + 1))]
    for cuts in runs:
        acc, message, out = stream(make, text, cuts)
        assert out.malformed is None
        assert (acc["content"] or None) == message.content == whole.content
        assert (acc["reasoning"] or None) == message.reasoning_content \
            == whole.reasoning_content
        sent = [acc["calls"][i] for i in sorted(acc["calls"])]
        assert sorted(acc["calls"]) == list(range(len(sent)))
        assert [(c["id"], c["name"], c["arguments"]) for c in sent] == \
            [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls]
        assert _calls_of(message) == _calls_of(whole)
    return whole


def _chat(name: str, **kw):
    return lambda: ChatOutputParser(tools=PARSERS[name]([]), **kw)


# ---------------------------------------------------------------------- readings
@pytest.mark.parametrize("case", CALLS, ids=_id)
def test_calls_are_read(case):
    name, text, content, expected = case
    parsed = PARSERS[name]([]).parse(text, True)
    assert [c.name for c in parsed.calls] == [n for n, _ in expected]
    assert [json.loads(c.arguments or "{}") for c in parsed.calls] == [a for _, a in expected]
    assert (parsed.content.strip() or None) == content
    message = assert_streams(_chat(name), text)
    assert message.content == content
    assert [(n, json.loads(a)) for n, a in _calls_of(message)] == expected


def test_json_arguments_are_the_generated_text():
    """Arguments are spans of the output, escapes as generated (not a re-serialization)."""
    text = r'<tool_call>{"name": "f", "arguments": {"s": "\"q\" \\ \u00e9 東京"}}</tool_call>'
    assert HermesToolParser().parse(text, True).calls[0].arguments == \
        r'{"s": "\"q\" \\ \u00e9 東京"}'
    text = '[TOOL_CALLS]f[ARGS]{"a" :  [1, 2] }'
    assert MistralToolParser().parse(text, True).calls[0].arguments == '{"a" :  [1, 2] }'
    text = "[f(s='Zürich \"x\"', n=1.0)]"
    assert PythonicToolParser().parse(text, True).calls[0].arguments == \
        '{"s": "Zürich \\"x\\"", "n": 1.0}'


@pytest.mark.parametrize("case", PLAIN, ids=_id)
def test_outputs_without_calls_are_content(case):
    name, text = case
    parsed = PARSERS[name]([]).parse(text, True)
    assert parsed == ParsedToolCalls(content=text)
    message = assert_streams(_chat(name), text)
    assert message.content == text.strip() and not message.tool_calls


@pytest.mark.parametrize("case", MALFORMED, ids=_id)
def test_malformed_calls_are_content(case):
    name, text = case
    parser = PARSERS[name]([])
    with pytest.raises(ToolParseError):
        parser.parse(text, True)
    _, message, out = stream(_chat(name), text, [])
    assert out.malformed and message.content == text.strip() and not message.tool_calls
    # Streamed, no reading before the end raises; the end is malformed.
    _, _, out = stream(_chat(name), text, range(1, len(text) + 1))
    assert out.malformed


def test_calls_of_unknown_functions_are_malformed():
    text = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    _, message, out = stream(lambda: ChatOutputParser(tools=HermesToolParser(),
                                                      tool_names=frozenset({"ls"})), text, [])
    assert "rm_rf" in out.malformed and message.content == text


def test_streamed_names_wait_until_complete():
    parser = HermesToolParser()
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa'
    for i in range(len(text) + 1):
        calls = parser.parse(text[:i], False).calls
        assert all(c.name in (None, "get_weather") for c in calls)
    assert parser.parse(text, False).calls[0].arguments == '{"city": "Pa'
    assert parser.parse(text[:text.index('"arguments"') + 13], False).calls[0].arguments == ""
    parser = PythonicToolParser()
    assert parser.parse("[get_weather(", False).calls[0].name == "get_weather"
    assert parser.parse("[get_weather(city='Pa'", False).calls[0].arguments == ""
    assert parser.parse("[get_wea", False) == ParsedToolCalls(content="")


# ---------------------------------------------------------------------- the prefix rule
@pytest.mark.parametrize("case", CALLS + [c + (None, []) for c in PLAIN], ids=_id)
def test_every_prefix_extends_to_the_final_reading(case):
    name, text = case[:2]
    parser = PARSERS[name]([])
    final = parser.parse(text, True)
    before = ParsedToolCalls(content="")
    for i in range(len(text) + 1):
        now = parser.parse(text[:i], False)
        _assert_extends(before, now)
        _assert_extends(now, final)
        before = now


@pytest.mark.parametrize("case", MALFORMED, ids=_id)
def test_malformed_outputs_keep_the_prefix_rule_until_the_end(case):
    name, text = case
    parser = PARSERS[name]([])
    before = ParsedToolCalls(content="")
    for i in range(len(text) + 1):
        now = parser.parse(text[:i], False)
        _assert_extends(before, now)
        before = now


_PIECES = list('{}[]()",:;\\ \n\'=xé東<>/_') + [
    "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|python_tag|>",
    '"name": "f"', '"arguments": {', "f(", '"""']


def test_mangled_outputs_keep_the_prefix_rule():
    """Samples with random edits: no reading before the end raises, each extends the one
    before, and a final reading that does not raise extends them all and has only named calls
    with object arguments."""
    rng = random.Random(1234)
    samples = [c[:2] for c in CALLS] + PLAIN + MALFORMED
    for _ in range(400):
        name, text = rng.choice(samples)
        chars = list(text)
        for _ in range(rng.randint(1, 3)):
            pos = rng.randint(0, len(chars))
            if rng.random() < 0.4 and chars:
                del chars[min(pos, len(chars) - 1)]
            else:
                chars[pos:pos] = list(rng.choice(_PIECES))
        text = "".join(chars)
        parser = PARSERS[name]([])
        readings = [parser.parse(text[:i], False) for i in range(len(text) + 1)]
        for before, now in zip(readings, readings[1:]):
            _assert_extends(before, now)
        try:
            final = parser.parse(text, True)
        except ToolParseError:
            continue
        for now in readings:
            _assert_extends(now, final)
        for call in final.calls:
            assert call.name and isinstance(json.loads(call.arguments or "{}"), dict)


def test_partial_start_tags_are_held_back():
    assert HermesToolParser().parse("Hi <tool_ca", False).content == "Hi "
    assert HermesToolParser().parse("Hi <tool_ca", True).content == "Hi <tool_ca"
    assert MistralToolParser().parse("Hi [TOOL_", False).content == "Hi "
    assert Llama3JsonToolParser().parse(" <|python", False).content == ""
    assert Llama3JsonToolParser().parse(" <|python", True).content == " <|python"
    assert PythonicToolParser().parse("[", False).content == ""
    assert PythonicToolParser().parse("[", True).content == "["


# ---------------------------------------------------------------------- the registry
def test_tool_parsers_are_registered():
    from corellm.plugins.discovery import load_registry

    registry = load_registry()
    special = {"hermes": False, "llama3_json": True, "mistral": True, "pythonic": False}
    assert set(registry.choices("tool_parser")) >= set(special)
    for name, special_tokens in special.items():
        entry = registry.get("tool_parser", name)
        assert entry.plugin.distribution == "corellm"
        assert entry.plugin.value == "corellm_plugins.tool_parsers"
        assert entry.spec.special_tokens is special_tokens and entry.spec.summary
        tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
        parser = entry.spec.factory(tools)
        assert isinstance(parser, ToolParser) and isinstance(parser, PARSERS[name])
        assert parser.tools == tools
