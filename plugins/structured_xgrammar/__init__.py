"""Structured outputs (JSON schema, JSON object, regex, choice, EBNF grammar) on xgrammar: a
logits processor that masks every token the grammar does not allow next.

Optional: ``pip install 'corellm[structured]'``. Without xgrammar the processor is listed as
unavailable (``corellm plugins``) and requests asking for structured outputs get a 400 saying
so. The checks where requests come in (``validate``) parse the schema, regex or grammar without
the tokenizer (a server runs them in its check processes, killed at a deadline); the worker
compiles it against the model's vocabulary in the background, first in a compile process that
``logits_processors.compile_timeout_s`` can kill (``processor``)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import Any

from corellm import hookimpl
from corellm.components import BuildContext, LogitsProcessorSpec, NoOptions


def _unavailable() -> str | None:
    try:
        found = importlib.util.find_spec("xgrammar") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return "needs the optional dependency 'xgrammar' (pip install 'corellm[structured]')"
    return None


def _make(options: NoOptions, ctx: BuildContext):
    from corellm_plugins.structured_xgrammar.processor import XGrammarProcessor
    return XGrammarProcessor.for_engine(ctx)


def _validate(params) -> None:
    if params.structured_outputs is None:
        return
    from corellm.errors import InvalidRequestError
    from corellm_plugins.structured_xgrammar.grammars import check

    if params.min_tokens > 0:
        # A grammar may be complete before min_tokens: then only the end of the sequence is
        # allowed, and min_tokens bans it.
        raise InvalidRequestError("sampling_params.min_tokens",
                                  "cannot be combined with structured_outputs (a complete "
                                  "grammar allows only the end of the sequence, which "
                                  "min_tokens holds back)")
    check(params.structured_outputs)


def _constrains(params: Any) -> bool:
    return params.structured_outputs is not None


@hookimpl
def corellm_logits_processors() -> Iterator[LogitsProcessorSpec]:
    yield LogitsProcessorSpec(
        name="xgrammar", factory=_make, validate=_validate,
        validate_imports=("corellm_plugins.structured_xgrammar.grammars",),
        structured_outputs=True, constrains=_constrains,
        priority=10, unavailable=_unavailable(),
        summary="Structured outputs: JSON schema, JSON object, regex, choice and EBNF "
                "grammars, as token masks (xgrammar).")
