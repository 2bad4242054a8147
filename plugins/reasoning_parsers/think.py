"""``<think>`` ... ``</think>`` reasoning.

Both parsers split the output at the first ``</think>``: before it the reasoning, after it the
answer (``answer_started`` from then on). Line breaks are layout there: those right after
``<think>`` and right before ``</think>`` are not reasoning, and those right after ``</think>``
are not answer. While streaming, the reasoning leaves out a trailing part that could still
grow into ``</think>`` and its trailing line breaks (they are dropped if ``</think>`` follows),
so each reading extends the one before.

- ``Qwen3ReasoningParser`` (``qwen3``): output that starts (after whitespace) with ``<think>``
  is reasoning up to ``</think>``; any other output is all answer, as it is (thinking
  disabled), and has started at once, except that while streaming an output that is
  whitespace and a start of ``<think>`` is held back (nothing yet). Output that ends without
  ``</think>`` after ``<think>`` is all reasoning.
- ``DeepSeekR1ReasoningParser`` (``deepseek_r1``): the prompt already opened ``<think>``, so the
  output starts in the reasoning (a leading ``<think>``, after whitespace, is skipped); the
  reasoning ends at ``</think>``; output that never has one is all reasoning, and the answer
  never starts (as vLLM's ``deepseek_r1``).
"""

from __future__ import annotations

from abc import abstractmethod

from corellm.interfaces import ReasoningParser
from corellm.serving.partial_json import partial_suffix
from corellm.tool_calls import ParsedReasoning

START = "<think>"
END = "</think>"
_WS = " \t\r\n"
_NL = "\r\n"


def _lstrip_ws(text: str) -> int:
    i = 0
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _from(text: str, start: int, final: bool) -> ParsedReasoning:
    """The reading of ``text`` whose reasoning starts at ``text[start]``."""
    while start < len(text) and text[start] in _NL:
        start += 1
    end = text.find(END, start)
    if end >= 0:
        return ParsedReasoning(reasoning=text[start:end].rstrip(_NL),
                               content=text[end + len(END):].lstrip(_NL), answer_started=True)
    reasoning = text[start:]
    if not final:
        reasoning = reasoning[:len(reasoning) - partial_suffix(reasoning, END)].rstrip(_NL)
    return ParsedReasoning(reasoning=reasoning, content="", answer_started=False)


class _ThinkParser(ReasoningParser):
    """``<think>...</think>`` then the answer; ``_untagged`` reads an output that does not
    open ``<think>``."""

    end_marker = END

    def parse(self, text: str, final: bool) -> ParsedReasoning:
        i = _lstrip_ws(text)
        if text.startswith(START, i):
            return _from(text, i + len(START), final)
        if not final and START.startswith(text[i:]):
            return ParsedReasoning(reasoning="", content="", answer_started=False)
        return self._untagged(text, final)

    @abstractmethod
    def _untagged(self, text: str, final: bool) -> ParsedReasoning:
        """The reading of an output that does not open ``<think>``."""


class Qwen3ReasoningParser(_ThinkParser):
    """``<think>...</think>`` then the answer, or the answer alone (see the module's
    docstring)."""

    def _untagged(self, text: str, final: bool) -> ParsedReasoning:
        return ParsedReasoning(reasoning="", content=text, answer_started=True)


class DeepSeekR1ReasoningParser(_ThinkParser):
    """Reasoning (the prompt opened ``<think>``) up to ``</think>``, then the answer (see the
    module's docstring)."""

    def _untagged(self, text: str, final: bool) -> ParsedReasoning:
        return _from(text, 0, final)
