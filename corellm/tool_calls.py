"""What tool parsers and reasoning parsers return (plugin API 1.8), and the OpenAI-shaped calls
and deltas the chat API makes of it.

A tool parser (``corellm.interfaces.ToolParser``) reads a request's generated text, the whole
of it so far, and returns ``ParsedToolCalls``: the content that is not a call and the calls, each
with its name once generated in full and its arguments' JSON text so far. A reasoning parser
(``corellm.interfaces.ReasoningParser``) returns ``ParsedReasoning``. The core
(``corellm.serving.chat_output``) turns successive parses into streamed ``DeltaMessage``s and the
final parse into the message, so that the deltas concatenate to the message by construction.
"""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass, field


class ToolParseError(ValueError):
    """Raised by a parser's final ``parse`` for text that holds a malformed call (a call tag
    whose JSON does not parse, a call without a name): the text is returned as content and the
    reason logged."""


@dataclass
class PartialToolCall:
    """One call in generated text. ``name``: None until generated in full. ``arguments``: the
    JSON text of the arguments object so far, exactly as it will end (each parse of longer
    text extends it), or empty until the parser can tell where it starts."""

    name: str | None
    arguments: str = ""


@dataclass
class ParsedToolCalls:
    """A tool parser's reading of the text so far: ``content``, the text that is not a call
    (while not final, without a trailing part that could still begin a call), and ``calls``
    in order. Each parse of longer text extends ``content`` and every call's ``arguments``
    (prefix-stable), and keeps the calls already seen."""

    content: str
    calls: list[PartialToolCall] = field(default_factory=list)


@dataclass
class ParsedReasoning:
    """A reasoning parser's reading: ``reasoning`` (the thinking), ``content`` (the answer) and
    whether the answer has started (the end-of-reasoning marker was generated, or the model
    answered without thinking). Prefix-stable as ``ParsedToolCalls``."""

    reasoning: str
    content: str
    answer_started: bool = False


@dataclass
class FunctionCall:
    name: str
    arguments: str                    # a JSON object, as text (OpenAI's shape)


_ID_CHARS = string.ascii_letters + string.digits


def new_tool_call_id() -> str:
    """An OpenAI-shaped tool call id: ``call_`` and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


@dataclass
class ToolCall:
    function: FunctionCall
    id: str = field(default_factory=new_tool_call_id)
    type: str = "function"

    def to_dict(self) -> dict:
        return {"id": self.id, "type": self.type,
                "function": {"name": self.function.name, "arguments": self.function.arguments}}


@dataclass
class DeltaToolCall:
    """One call's part of a streamed delta: ``id`` and ``name`` once (its first delta), then
    argument fragments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None

    def to_dict(self) -> dict:
        out: dict = {"index": self.index}
        if self.id is not None:
            out["id"], out["type"] = self.id, "function"
        fn = {}
        if self.name is not None:
            fn["name"] = self.name
        if self.arguments is not None:
            fn["arguments"] = self.arguments
        if fn:
            out["function"] = fn
        return out


@dataclass
class DeltaMessage:
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning_content or self.tool_calls)


@dataclass
class ChatMessageParts:
    """The assistant message a generated text makes: ``content`` (None when only calls or
    only reasoning), ``reasoning_content`` (None without a reasoning parser or thinking) and
    ``tool_calls``."""

    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


__all__ = ["ChatMessageParts", "DeltaMessage", "DeltaToolCall", "FunctionCall",
           "ParsedReasoning", "ParsedToolCalls", "PartialToolCall", "ToolCall",
           "ToolParseError", "new_tool_call_id"]
