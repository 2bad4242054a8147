"""Reading JSON that is still being generated: where a value ends (or that it has not ended
yet), and an object's members so far, as spans of the text. What tool parsers need to stream a
call's arguments as the model writes them: the arguments' text so far is a prefix of their
final text, so a parser reports spans of the generated text, never a re-serialization.

JSON (RFC 8259) with two allowances: a value may be followed by anything (the scanner reads one
value and says where it ends), and a string may hold raw control characters, as constrained
decoders' JSON grammars let a model write them; ``escape_control_chars`` makes such text strict
JSON, character by character, so it can be applied to each prefix as it grows.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_WS = " \t\n\r"
_LITERALS = ("true", "false", "null")
_NUMBER_CHARS = set("0123456789+-.eE")


class JSONScanError(ValueError):
    """The text cannot be the start of a JSON value (whatever follows)."""


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


# A string's body: characters other than the quote and the backslash, and escapes (a
# backslash and any one character), up to its closing quote; scanned in C, so reading a long
# argument again as the output grows costs little.
_STRING_BODY = re.compile(r'(?:[^"\\]++|\\.)*+"', re.S)      # possessive: no backtracking


def _scan_string(text: str, i: int) -> int | None:
    """``text[i]`` is '"': the index after the closing quote, or None if the text ends first."""
    m = _STRING_BODY.match(text, i + 1)
    return m.end() if m else None


def scan_value(text: str, i: int) -> int | None:
    """The index just past the JSON value that starts at ``text[i]`` (after whitespace), or
    None when the text ends before the value does. Raises ``JSONScanError`` where the text
    cannot be JSON. A number at the very end of the text is not known to have ended: None."""
    i = skip_ws(text, i)
    n = len(text)
    if i >= n:
        return None
    c = text[i]
    if c == '"':
        return _scan_string(text, i)
    if c in "{[":
        stack = [c]
        i += 1
        while i < n:
            c = text[i]
            if c == '"':
                end = _scan_string(text, i)
                if end is None:
                    return None
                i = end
                continue
            if c in "{[":
                stack.append(c)
            elif c in "}]":
                if not stack or {"}": "{", "]": "["}[c] != stack[-1]:
                    raise JSONScanError(f"unbalanced {c!r} at {i}")
                stack.pop()
                if not stack:
                    return i + 1
            i += 1
        return None
    for lit in _LITERALS:
        if text.startswith(lit, i):
            return i + len(lit)
        if lit.startswith(text[i:]):
            return None
    if c in "-0123456789":
        j = i
        while j < n and text[j] in _NUMBER_CHARS:
            j += 1
        return None if j == n else j
    raise JSONScanError(f"unexpected {c!r} at {i}")


@dataclass
class Member:
    """An object member: its key, and its value's span (``end`` None while unfinished)."""

    key: str
    start: int
    end: int | None

    def value(self, text: str):
        """The value, parsed (only once it has ended)."""
        assert self.end is not None
        return json.loads(text[self.start:self.end])


def object_members(text: str, i: int) -> tuple[list[Member], int | None]:
    """The members of the object that starts at ``text[i]`` (after whitespace), in order, as
    far as the text goes: a member is listed once its key is complete and its value has
    started (its ``end`` None while the value is unfinished). Returns them and the index past
    the object's closing brace, or None while it is open. Raises ``JSONScanError`` where the
    text cannot be a JSON object."""
    i = skip_ws(text, i)
    n = len(text)
    if i >= n:
        return [], None
    if text[i] != "{":
        raise JSONScanError(f"expected an object at {i}, found {text[i]!r}")
    members: list[Member] = []
    i = skip_ws(text, i + 1)
    if i < n and text[i] == "}":
        return members, i + 1
    while i < n:
        if text[i] != '"':
            raise JSONScanError(f"expected a key at {i}, found {text[i]!r}")
        key_end = _scan_string(text, i)
        if key_end is None:
            return members, None
        try:
            key = json.loads(text[i:key_end])
        except ValueError as exc:
            raise JSONScanError(f"bad key at {i}: {exc}") from None
        i = skip_ws(text, key_end)
        if i >= n:
            return members, None
        if text[i] != ":":
            raise JSONScanError(f"expected ':' after key {key!r} at {i}")
        start = skip_ws(text, i + 1)
        if start >= n:
            return members, None
        end = scan_value(text, start)
        members.append(Member(key, start, end))
        if end is None:
            return members, None
        i = skip_ws(text, end)
        if i >= n:
            return members, None
        if text[i] == "}":
            return members, i + 1
        if text[i] != ",":
            raise JSONScanError(f"expected ',' or '}}' at {i}, found {text[i]!r}")
        i = skip_ws(text, i + 1)
    return members, None


_CONTROL = re.compile(r"[\x00-\x1f]")


def escape_control_chars(text: str) -> str:
    """``text`` (JSON, or the start of it) with every raw control character inside a string
    written as its ``\\u00XX`` escape, the rest unchanged. It works a character at a time: the
    escape of a prefix is a prefix of the escape of the whole."""
    if not _CONTROL.search(text):
        return text
    out, in_string, escaped = [], False, False
    for c in text:
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
            elif c < " ":
                c = f"\\u{ord(c):04x}"
        elif c == '"':
            in_string = True
        out.append(c)
    return "".join(out)


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``marker`` (0 when
    none): what a parser holds back while streaming, as it may still become ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


__all__ = ["JSONScanError", "Member", "escape_control_chars", "object_members",
           "partial_suffix", "scan_value", "skip_ws"]
