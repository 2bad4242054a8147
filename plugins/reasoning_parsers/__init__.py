"""Reasoning formats (plugin API 1.8): where a reasoning model's thinking ends and its answer
starts (``corellm.interfaces.ReasoningParser``).

- ``qwen3``: ``<think>...</think>`` then the answer; output without ``<think>`` is all answer
  (thinking disabled);
- ``deepseek_r1``: the prompt opened ``<think>``: the output is reasoning up to ``</think>``,
  then the answer.

``corellm_plugins.reasoning_parsers.think`` gives the exact rules.
"""

from __future__ import annotations

from collections.abc import Iterator

from corellm import hookimpl
from corellm.components import ReasoningParserSpec


def _qwen3():
    from corellm_plugins.reasoning_parsers.think import Qwen3ReasoningParser
    return Qwen3ReasoningParser()


def _deepseek_r1():
    from corellm_plugins.reasoning_parsers.think import DeepSeekR1ReasoningParser
    return DeepSeekR1ReasoningParser()


@hookimpl
def corellm_reasoning_parsers() -> Iterator[ReasoningParserSpec]:
    yield ReasoningParserSpec(
        name="qwen3", factory=_qwen3,
        summary="<think>...</think> then the answer; without <think>, all answer "
                "(Qwen3, thinking on or off).")
    yield ReasoningParserSpec(
        name="deepseek_r1", factory=_deepseek_r1,
        summary="Reasoning up to </think> (the prompt opened <think>), then the answer "
                "(DeepSeek-R1 and its distills, QwQ, Qwen3 thinking-2507).")
