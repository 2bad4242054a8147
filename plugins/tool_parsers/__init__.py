"""Tool-call formats (plugin API 1.8): how model families write tool calls in their output, read
into calls and content while the output streams (``corellm.interfaces.ToolParser``).

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen2.5,
  Qwen3);
- ``llama3_json``: ``[<|python_tag|>]{"name": ..., "parameters": {...}}; ...`` (Llama 3.1,
  3.2);
- ``mistral``: ``[TOOL_CALLS][{...}, ...]`` and ``[TOOL_CALLS]name[ARGS]{...}`` (Mistral);
- ``pythonic``: ``[name(key=value, ...), ...]`` (Llama 3.2, Llama 4).

Each module's docstring gives its format and what is content exactly.
"""

from __future__ import annotations

from collections.abc import Iterator

from corellm import hookimpl
from corellm.components import ToolParserSpec


def _hermes(tools):
    from corellm_plugins.tool_parsers.hermes import HermesToolParser
    return HermesToolParser(tools)


def _llama3_json(tools):
    from corellm_plugins.tool_parsers.llama3_json import Llama3JsonToolParser
    return Llama3JsonToolParser(tools)


def _mistral(tools):
    from corellm_plugins.tool_parsers.mistral import MistralToolParser
    return MistralToolParser(tools)


def _pythonic(tools):
    from corellm_plugins.tool_parsers.pythonic import PythonicToolParser
    return PythonicToolParser(tools)


@hookimpl
def corellm_tool_parsers() -> Iterator[ToolParserSpec]:
    yield ToolParserSpec(
        name="hermes", factory=_hermes,
        summary="<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call> blocks "
                "(Hermes, Qwen2.5, Qwen3).")
    yield ToolParserSpec(
        name="llama3_json", factory=_llama3_json, special_tokens=True,
        summary="[<|python_tag|>]{\"name\": ..., \"parameters\": {...}}; ... "
                "(Llama 3.1, 3.2 JSON tool calling).")
    yield ToolParserSpec(
        name="mistral", factory=_mistral, special_tokens=True,
        summary="[TOOL_CALLS] and a JSON list of calls, or [TOOL_CALLS]name[ARGS]{...} "
                "(tokenizer v11+) (Mistral).")
    yield ToolParserSpec(
        name="pythonic", factory=_pythonic,
        summary="A Python list of calls with literal keyword arguments, "
                "[f(x=1), g(y=\"a\")] (Llama 3.2, Llama 4).")
