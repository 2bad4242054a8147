"""A request's ``StructuredOutputsParams`` as xgrammar source: what the front end parses (to
refuse a bad schema with a 400) and the worker compiles (against the model's vocabulary)."""

from __future__ import annotations

import functools
import json

import xgrammar as xgr

from corellm.errors import InvalidRequestError
from corellm.sampling_params import StructuredOutputsParams

# Kinds of source, and what each becomes.
JSON_SCHEMA, JSON_OBJECT, REGEX, GRAMMAR = "json", "json_object", "regex", "grammar"


def source(so: StructuredOutputsParams) -> tuple[str, str]:
    """(kind, text): the canonical source of a constraint, the key of both caches. A choice is
    a grammar of its alternatives (each a JSON-escaped string literal)."""
    kind = so.kind
    if kind == "json":
        schema = so.json
        try:
            if isinstance(schema, str):
                schema = json.loads(schema)
            # The schema's own key order: xgrammar writes properties in it (a "reasoning"
            # before an "answer" stays first).
            text = json.dumps(schema, ensure_ascii=False)
        except (ValueError, RecursionError) as exc:
            raise InvalidRequestError("structured_outputs.json",
                                      f"is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError("structured_outputs.json",
                                      f"a JSON schema is an object, got {type(schema).__name__}")
        return JSON_SCHEMA, text
    if kind == "json_object":
        return JSON_OBJECT, ""
    if kind == "regex":
        return REGEX, so.regex or ""
    if kind == "choice":
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in so.choice or [])
        return GRAMMAR, f"root ::= {alternatives}"
    return GRAMMAR, so.grammar or ""


@functools.lru_cache(maxsize=512)
def _parse(kind: str, text: str) -> None:
    if kind == JSON_SCHEMA:
        xgr.Grammar.from_json_schema(text)
    elif kind == REGEX:
        xgr.Grammar.from_regex(text)
    elif kind == GRAMMAR:
        xgr.Grammar.from_ebnf(text)


def check(so: StructuredOutputsParams) -> None:
    """Parse the constraint (answered from a cache when seen before); an
    ``InvalidRequestError`` naming the field says why xgrammar refuses it."""
    kind, text = source(so)
    try:
        _parse(kind, text)
    except Exception as exc:         # xgrammar raises RuntimeError / ValueError with its reason
        field = "structured_outputs." + so.kind
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InvalidRequestError(field, f"xgrammar cannot compile it: {reason}") from None
