"""Tool calling and reasoning on the chat route: the request's ``tools``, ``tool_choice`` and
history checked (400s naming the field), the server's tool and reasoning parsers
(``frontend.tool_call_parser``, ``frontend.reasoning_parser``: plugin kinds) resolved once at
start-up, and each choice's ``ChatOutputParser`` (``corellm.serving.chat_output``).

``tool_choice``: ``"none"`` (tools are shown to the template, no call is parsed), ``"auto"``
(the model decides; its calls are read by the tool parser, which the server must have:
``--enable-auto-tool-choice --tool-call-parser NAME``, as vLLM asks), ``"required"`` and a
named function (generation constrained by a JSON schema of the calls through the
structured-output processor, so any model returns a valid call; read by the core's
``ForcedToolCalls``).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

from corellm.errors import PluginError
from corellm.serving.chat_output import (ChatOutputParser, ForcedToolCalls, ParserNames,
                                         forced_tool_schema)

from .errors import APIError

logger = logging.getLogger("corellm.server")

_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


# How deeply a tool's parameters schema may nest (objects and lists): the structured-output
# bound's default (frontend.limits.constraints.max_depth); deeper is a 400, before a validator
# or a template recurses through it.
MAX_SCHEMA_DEPTH = 64


def _check_schema(schema: Any, field: str) -> None:
    from corellm.engine.chat import _nesting_depth
    if not isinstance(schema, dict):
        raise APIError(400, f"{field}: must be a JSON schema object", param=field)
    if _nesting_depth(schema, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise APIError(400, f"{field}: nests more than {MAX_SCHEMA_DEPTH} levels deep",
                       param=field)
    try:
        from jsonschema import exceptions, validators
    except ImportError:             # the schema is still compiled by the structured backend
        return
    try:
        validators.validator_for(schema).check_schema(schema)
    except exceptions.SchemaError as exc:
        where = "/".join(map(str, exc.absolute_path))
        raise APIError(400, f"{field}: not a valid JSON schema"
                            f"{f' at {where}' if where else ''}: {exc.message}",
                       param=field) from None
    except Exception as exc:        # a malformed $schema, and the like: the schema's fault
        raise APIError(400, f"{field}: not a valid JSON schema ({type(exc).__name__}: "
                            f"{exc})", param=field) from None
    if schema.get("type", "object") != "object":
        raise APIError(400, f"{field}: a function's parameters must be an object schema "
                            f"(type 'object'), not {schema.get('type')!r}", param=field)


def check_tools(tools: list[Any] | None) -> list[dict]:
    """OpenAI's ``tools``: a list of ``{"type": "function", "function": {"name",
    "description"?, "parameters"?, "strict"?}}`` with distinct names."""
    out: list[dict] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools or ()):
        base = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise APIError(400, f"{base}.type: must be 'function'", param=f"{base}.type")
        unknown = sorted(set(tool) - {"type", "function"})
        if unknown:
            raise APIError(400, f"{base}.{unknown[0]}: unknown key", param=f"{base}.{unknown[0]}")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise APIError(400, f"{base}.function: required (an object with a name)",
                           param=f"{base}.function")
        unknown = sorted(set(fn) - {"name", "description", "parameters", "strict"})
        if unknown:
            raise APIError(400, f"{base}.function.{unknown[0]}: unknown key",
                           param=f"{base}.function.{unknown[0]}")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise APIError(400, f"{base}.function.name: must be 1 to 64 letters, digits, '_' or "
                                f"'-', got {name!r}", param=f"{base}.function.name")
        if name in seen:
            raise APIError(400, f"{base}.function.name: {name!r} is given twice",
                           param=f"{base}.function.name")
        seen.add(name)
        if "description" in fn and not isinstance(fn["description"], str):
            raise APIError(400, f"{base}.function.description: must be a string",
                           param=f"{base}.function.description")
        if "parameters" in fn:
            _check_schema(fn["parameters"], f"{base}.function.parameters")
        out.append({"type": "function", "function": fn})
    return out


def tool_choice_of(req: Any, tools: list[dict]) -> str | None:
    """The request's choice: ``"none"``, ``"auto"``, ``"required"`` or ``"function"`` with
    the function's name (returned second). Default: ``"auto"`` with tools, else ``"none"``."""
    choice = req.tool_choice
    if choice is None:
        return ("auto" if tools else "none"), None
    if not tools and choice in ("none", "auto"):
        return "none", None          # (clients send "auto" by default, tools or not)
    if not tools:
        raise APIError(400, "tool_choice: requires tools", param="tool_choice")
    if choice in ("none", "auto", "required"):
        return choice, None
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str):
            raise APIError(400, "tool_choice: a named choice is {'type': 'function', "
                                "'function': {'name': ...}}", param="tool_choice")
        names = [t["function"]["name"] for t in tools]
        if fn["name"] not in names:
            raise APIError(400, f"tool_choice.function.name: {fn['name']!r} is not among the "
                                f"tools ({', '.join(names)})", param="tool_choice.function.name")
        return "function", fn["name"]
    raise APIError(400, f"tool_choice: {choice!r} is not one of none, auto, required or a "
                        "named function", param="tool_choice")


def template_messages(req: Any) -> list[dict]:
    """The history as the chat template reads it: assistant ``tool_calls`` (their arguments
    given to the template as objects, as Hugging Face templates expect) and ``tool`` messages'
    ``tool_call_id``."""
    out = []
    for i, m in enumerate(req.messages):
        msg: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name:
            msg["name"] = m.name
        extra = m.model_extra or {}
        if m.role == "tool":
            call_id = extra.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise APIError(400, f"messages[{i}].tool_call_id: required in a tool message "
                                    "(the id of the call it answers)",
                               param=f"messages[{i}].tool_call_id")
            msg["tool_call_id"] = call_id
        calls = extra.get("tool_calls")
        if calls is not None and m.role == "assistant":
            if not isinstance(calls, list):
                raise APIError(400, f"messages[{i}].tool_calls: must be a list",
                               param=f"messages[{i}].tool_calls")
            msg["tool_calls"] = [_history_call(c, f"messages[{i}].tool_calls[{j}]")
                                 for j, c in enumerate(calls)]
        out.append(msg)
    return out


def _history_call(call: Any, field: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise APIError(400, f"{field}.function: an object with a name and arguments",
                       param=f"{field}.function")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except (ValueError, RecursionError) as exc:
            raise APIError(400, f"{field}.function.arguments: not JSON ({exc})",
                           param=f"{field}.function.arguments") from None
    return {"id": call.get("id"), "type": "function",
            "function": {"name": fn["name"], "arguments": args}}


@dataclass
class ChatTools:
    """The server's parsers, resolved once: their registry entries (``None``: not set)."""

    tool_parser: Any = None
    reasoning_parser: Any = None
    auto_tool_choice: bool = False

    @classmethod
    def for_options(cls, options: Any, registry: Any) -> ChatTools:
        """From ``frontend.tool_call_parser``, ``enable_auto_tool_choice`` and
        ``reasoning_parser``; a ConfigError names the key of an unknown parser."""
        from corellm.errors import ConfigError, PluginError

        def entry(section: str, name: str | None, key: str) -> Any:
            if name is None:
                return None
            try:
                return registry.get(section, name)
            except PluginError as exc:
                raise ConfigError([(f"frontend.{key}", str(exc))]) from None
        if options.enable_auto_tool_choice and options.tool_call_parser is None:
            raise ConfigError([("frontend.enable_auto_tool_choice",
                                "needs frontend.tool_call_parser (--tool-call-parser): the "
                                "format the model writes its calls in")])
        return cls(entry("tool_parser", options.tool_call_parser, "tool_call_parser"),
                   entry("reasoning_parser", options.reasoning_parser, "reasoning_parser"),
                   options.enable_auto_tool_choice)

    def answer_marker(self, tokenizer: Any, prompt_ids: list[int]) -> list[int] | None:
        """The token ids after which a structured output applies (the reasoning parser's
        ``end_marker``: the schema constrains the answer, not the thinking), or None: no
        reasoning parser, or the prompt already ends the reasoning (a template that closed
        an empty thinking block, as Qwen3's does with thinking off)."""
        if self.reasoning_parser is None:
            return None
        marker = self.reasoning_parser.spec.factory().end_marker
        if not marker:
            return None
        tail = tokenizer.decode(prompt_ids[-32:], skip_special_tokens=False)
        if tail.rstrip().endswith(marker):
            return None
        return list(tokenizer.encode(marker, add_special_tokens=False)) or None

    def needs_special_tokens(self, choice: str) -> bool:
        return bool((self.reasoning_parser is not None and
                     self.reasoning_parser.spec.special_tokens)
                    or (choice == "auto" and self.tool_parser is not None
                        and self.tool_parser.spec.special_tokens))

    def check_auto(self, choice: str, tools: list[dict]) -> None:
        if choice == "auto" and tools and not self.auto_tool_choice:
            raise APIError(400, "tool_choice: 'auto' needs a server started with "
                                "--enable-auto-tool-choice and --tool-call-parser (or give "
                                "tool_choice 'required', a named function or 'none')",
                           param="tool_choice")

    def output_parser(self, choice: str, name: str | None, tools: list[dict],
                      json_content: bool = False) -> ChatOutputParser | None:
        """A choice's parser, or None when its output is plain content. ``json_content``: a
        ``response_format`` made the answer JSON (its strings' raw control characters, which
        xgrammar's JSON grammar lets through, are sent escaped: strict JSON for clients)."""
        names = ParserNames()
        if self.tool_parser is not None:
            names.tool = self.tool_parser.describe()
        if self.reasoning_parser is not None:
            names.reasoning = self.reasoning_parser.describe()
        reasoning = parser = None
        try:
            if self.reasoning_parser is not None:
                reasoning = self.reasoning_parser.spec.factory()
            if choice in ("required", "function"):
                parser = ForcedToolCalls(tools, name)
                names.tool = "corellm's reader of tool_choice calls"
            elif choice == "auto" and tools and self.tool_parser is not None:
                parser = self.tool_parser.spec.factory(tools)
        except Exception as exc:
            who = names.reasoning if reasoning is None and self.reasoning_parser is not None \
                else names.tool
            raise PluginError(f"{who}: its factory failed: {type(exc).__name__}: "
                              f"{exc}") from exc
        if parser is None and reasoning is None and not json_content:
            return None
        return ChatOutputParser(tools=parser, reasoning=reasoning, names=names,
                                tool_names=frozenset(t["function"]["name"] for t in tools)
                                if parser is not None else None, json_content=json_content)


def forced_constraint(req: Any, choice: str, name: str | None,
                      tools: list[dict]) -> dict | None:
    """The ``structured_outputs`` of a ``required`` or named choice, or None."""
    if choice not in ("required", "function"):
        return None
    fmt = req.response_format or {}
    if req.structured_outputs is not None or fmt.get("type", "text") != "text":
        raise APIError(400, "tool_choice: a required or named tool choice constrains the "
                            "output to the call; it cannot be combined with "
                            + ("structured_outputs" if req.structured_outputs is not None
                               else "response_format"), param="tool_choice")
    parallel = req.parallel_tool_calls is not False
    return {"json": forced_tool_schema(tools, name, parallel)}


def log_malformed(rid: str, index: int, parser: ChatOutputParser) -> None:
    if parser.malformed:
        logger.warning("%s choice %d: the output's tool call could not be read (%s); it is "
                       "returned as content", rid, index, parser.malformed)


def parsed(step: Callable[[str], Any], text: str) -> Any:
    """A parser's step; a parser that fails ends this request only, with a 500 naming the
    parser and its plugin."""
    from corellm.errors import PluginError
    from corellm.serving.chat_output import ParserContractError
    try:
        return step(text)
    except (PluginError, ParserContractError) as exc:
        logger.error("%s", exc)
        raise APIError(500, str(exc), code="parser_error") from None


def chat_message(parts: Any) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": parts.content}
    if parts.reasoning_content is not None:
        message["reasoning_content"] = parts.reasoning_content
    if parts.tool_calls:
        message["tool_calls"] = [call.to_dict() for call in parts.tool_calls]
    return message


def chat_delta(d: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if d is None:
        return out
    if d.reasoning_content:
        out["reasoning_content"] = d.reasoning_content
    if d.content:
        out["content"] = d.content
    if d.tool_calls:
        out["tool_calls"] = [t.to_dict() for t in d.tool_calls]
    return out


def finish_reason_of(reason: str | None, parts: Any, choice: str = "auto") -> str | None:
    """``tool_calls`` for a message that calls tools and ended on its own (a length cut keeps
    ``length``), except for a named function's call: ``stop``, as OpenAI answers it."""
    if parts.tool_calls and reason == "stop" and choice != "function":
        return "tool_calls"
    return reason
