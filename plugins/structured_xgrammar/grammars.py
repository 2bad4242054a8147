"""A request's ``StructuredOutputsParams`` as xgrammar source: what the front end parses (to
refuse a bad schema with a 400) and the worker compiles (against the model's vocabulary).

Both run where a deadline can stop them: the server's checks in its check processes, the
worker's compiles first in a compile process (``probe``), killed at
``logits_processors.compile_timeout_s``, and only then in the worker itself, whose compiled
grammar the matchers need. Nothing here is kept by the size of its input: parsed constraints
are remembered by a 16-byte digest, and a schema's annotations (``description``, ``title``,
``examples``, ...), which constrain nothing, are dropped before anything is keyed or compiled,
so a schema padded with a 900 KB description costs what the same schema without it does."""

from __future__ import annotations

import json

import xgrammar as xgr

from corellm.serving.constraint_shape import digest, without_annotations
from corellm.errors import InvalidRequestError
from corellm.serving.lru import ByteLRU
from corellm.sampling_params import StructuredOutputsParams

# Kinds of source, and what each becomes.
JSON_SCHEMA, JSON_OBJECT, REGEX, GRAMMAR = "json", "json_object", "regex", "grammar"

# What json_object compiles: any JSON object (a top-level ``{...}``), not any JSON value.
JSON_OBJECT_SCHEMA = '{"type": "object"}'

# Digests of the constraints that parsed, up to this many bytes.
CHECKED_BYTES = 4 << 20


def source(so: StructuredOutputsParams) -> tuple[str, str]:
    """(kind, text): the canonical source of a constraint, what the caches are keyed by. A
    choice is a grammar of its alternatives (each a JSON-escaped string literal)."""
    kind = so.kind
    if kind == "json":
        schema = so.json
        try:
            if isinstance(schema, str):
                schema = json.loads(schema)
            # The schema's own key order: xgrammar writes properties in it (a "reasoning"
            # before an "answer" stays first).
            text = json.dumps(without_annotations(schema), ensure_ascii=False)
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


_checked: ByteLRU[bytes, None] = ByteLRU(CHECKED_BYTES)


def _parse(kind: str, text: str) -> None:
    if kind == JSON_SCHEMA:
        xgr.Grammar.from_json_schema(text)
    elif kind == REGEX:
        xgr.Grammar.from_regex(text)
    elif kind == GRAMMAR:
        xgr.Grammar.from_ebnf(text)


def check(so: StructuredOutputsParams) -> None:
    """Parse the constraint (remembered when it parsed before); an ``InvalidRequestError``
    naming the field says why xgrammar refuses it."""
    kind, text = source(so)
    key = digest(kind, text)
    if key in _checked:
        return
    try:
        _parse(kind, text)
    except Exception as exc:         # xgrammar raises RuntimeError / ValueError with its reason
        field = "structured_outputs." + so.kind
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InvalidRequestError(field, f"xgrammar cannot compile it: {reason}") from None
    _checked.put(key, None, 0)


# --------------------------------------------------------------------------- compile processes
_compiler: xgr.GrammarCompiler | None = None


def init_compiler(tokenizer_info: str) -> None:
    """A compile process's initializer: a compiler for the vocabulary (``tokenizer_info``:
    ``TokenizerInfo.serialize_json``), keeping nothing between compiles."""
    global _compiler
    info = xgr.TokenizerInfo.deserialize_json(tokenizer_info)
    _compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def compile_with(compiler: xgr.GrammarCompiler, kind: str, text: str) -> xgr.CompiledGrammar:
    if kind == JSON_SCHEMA:
        # Compact JSON (vLLM's disable_any_whitespace): a small model let free to put
        # whitespace anywhere may never stop putting it.
        return compiler.compile_json_schema(text, any_whitespace=False)
    if kind == JSON_OBJECT:
        # A JSON object, as OpenAI's json_object means (xgrammar's builtin JSON grammar
        # allows any value: an array, a bare string). Not strict: any properties, of any
        # values; compact as a schema's.
        return compiler.compile_json_schema(JSON_OBJECT_SCHEMA, any_whitespace=False,
                                            strict_mode=False)
    if kind == REGEX:
        return compiler.compile_regex(text)
    assert kind == GRAMMAR
    return compiler.compile_grammar(text)


class GrammarRefused(Exception):
    """xgrammar refused to compile a constraint against the vocabulary (its reason)."""


def probe(kind: str, text: str) -> int:
    """Compile in a compile process, to learn that it finishes in time (the compiled grammar
    stays there: sending it back costs more than compiling it again, 2 s for a schema of 300
    properties); its size in bytes."""
    assert _compiler is not None, "init_compiler was not run"
    try:
        return compile_with(_compiler, kind, text).memory_size_bytes
    except (RuntimeError, ValueError) as exc:      # xgrammar's refusals
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
        raise GrammarRefused(reason) from None
