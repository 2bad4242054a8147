"""Turning chat messages into prompt token ids with the model's chat template.

Shared by ``LLM.chat`` and every front end, so a conversation becomes the same tokens offline
and over HTTP.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from corellm.errors import InvalidRequestError

Message = Mapping[str, Any]

# Keys chat_template_kwargs may not carry: they would replace the template (running a caller's
# Jinja) or change what apply_chat_template returns.
RESERVED_TEMPLATE_KEYS = frozenset({
    "chat_template", "tokenize", "return_dict", "return_tensors", "conversation", "messages",
    "add_generation_prompt", "tools", "documents", "continue_final_message", "tokenizer_kwargs"})


def message_text(content: Any, field: str) -> str:
    """A message's content: a string, or OpenAI's list of parts (text parts only)."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, Sequence):
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"{field}[{i}]", "only text parts "
                                          "({'type': 'text', 'text': ...}) are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise InvalidRequestError(field, f"expected a string or a list of text parts, got "
                              f"{type(content).__name__}")


# How deeply chat_template_kwargs may nest. transformers copies every template argument into
# plain data recursively before rendering, a few frames per level: a value nested a few hundred
# levels deep (well inside what JSON parsing allows) would exhaust Python's recursion limit there.
MAX_TEMPLATE_KWARGS_DEPTH = 64


def _nesting_depth(value: Any, limit: int) -> int:
    """How deeply lists, tuples and mappings nest in ``value``; counting stops past ``limit``."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, Mapping):
            children = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if depth > limit:
            break
        todo.extend((child, depth + 1) for child in children)
    return deepest


def load_chat_template(value: str, key: str = "chat_template") -> str:
    """A chat template given as a file's path or as the template itself (text with a ``{``
    in it, as vLLM's ``--chat-template`` takes either); a ConfigError names ``key`` for a
    file that cannot be read."""
    from pathlib import Path

    from corellm.errors import ConfigError
    if "{" in value:
        return value
    try:
        return Path(value).expanduser().read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([(key, f"cannot read the chat template file {value!r}: "
                                 f"{exc.strerror or exc}")]) from None


def render_chat_text(tokenizer: Any, messages: Sequence[Message], *,
                     add_generation_prompt: bool = True, continue_final_message: bool = False,
                     chat_template: str | None = None,
                     chat_template_kwargs: Mapping[str, Any] | None = None,
                     field: str = "messages", tools: Sequence[Mapping[str, Any]] | None = None,
                     ) -> str:
    """The chat template's text for ``messages`` (the tokenizer's template, or
    ``chat_template``), with ``tools`` (OpenAI's function tools) given to the template as
    ``tools`` (a template that does not read them ignores them).

    Errors are ``InvalidRequestError`` naming ``field``: no template, malformed messages, or a
    template that refused them (Jinja ``raise_exception``); or naming ``chat_template_kwargs``:
    a reserved key, or values nested too deeply.
    """
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise InvalidRequestError(field, "this model's tokenizer has no chat template; give "
                                  "chat_template, or send plain prompts (completions)")
    if isinstance(messages, (str, Mapping)) or not isinstance(messages, Sequence) \
            or not messages:
        raise InvalidRequestError(field, "expected a non-empty list of messages")
    reserved = sorted(set(chat_template_kwargs or {}) & RESERVED_TEMPLATE_KEYS)
    if reserved:
        raise InvalidRequestError("chat_template_kwargs", f"{reserved[0]!r} cannot be set "
                                  "through chat_template_kwargs")
    if _nesting_depth(chat_template_kwargs, MAX_TEMPLATE_KWARGS_DEPTH) \
            > MAX_TEMPLATE_KWARGS_DEPTH:
        raise InvalidRequestError("chat_template_kwargs", "values nest more than "
                                  f"{MAX_TEMPLATE_KWARGS_DEPTH} levels deep")
    if add_generation_prompt and continue_final_message:
        raise InvalidRequestError(field, "add_generation_prompt and continue_final_message "
                                  "cannot both be true")
    conversation = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise InvalidRequestError(f"{field}[{i}]", "expected a mapping with a string 'role'")
        conversation.append({**m, "content": message_text(m.get("content"),
                                                          f"{field}[{i}].content")})
    if tools:
        chat_template_kwargs = {**(chat_template_kwargs or {}), "tools": list(tools)}
    try:
        return tokenizer.apply_chat_template(
            conversation, chat_template=template, tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
    except InvalidRequestError:
        raise
    except Exception as exc:         # jinja errors: the template refused these messages
        raise InvalidRequestError(field, f"the chat template failed: {exc}") from None


def render_chat(tokenizer: Any, messages: Sequence[Message], *,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                chat_template: str | None = None,
                chat_template_kwargs: Mapping[str, Any] | None = None,
                field: str = "messages",
                tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
    """Apply the chat template (``render_chat_text``: the same arguments, the same errors) and
    tokenize."""
    text = render_chat_text(tokenizer, messages, add_generation_prompt=add_generation_prompt,
                            continue_final_message=continue_final_message,
                            chat_template=chat_template,
                            chat_template_kwargs=chat_template_kwargs, field=field,
                            tools=tools)
    # The template writes the special tokens (BOS) itself.
    return tokenizer.encode(text, add_special_tokens=False)
