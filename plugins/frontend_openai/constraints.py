"""A request's output constraints as ``StructuredOutputsParams``: OpenAI's ``response_format``
(chat) and vLLM's ``structured_outputs`` (both routes), with errors naming the field the client
sent; the bounds a constraint must keep before anything parses it
(``frontend.limits.constraints``); and the functions the check processes run."""

from __future__ import annotations

import json
from typing import Any

from corellm.errors import InvalidRequestError
from corellm.sampling_params import SamplingParams, StructuredOutputsParams

from .errors import APIError
from .options import ConstraintLimits


def structured_outputs(req: Any) -> StructuredOutputsParams | None:
    """The constraint a request asks for, or None; a 400 for one that is malformed."""
    given = req.structured_outputs
    fmt = getattr(req, "response_format", None)
    kind = fmt.get("type", "text") if fmt else "text"
    if given is not None and kind != "text":
        raise APIError(400, "structured_outputs: give either structured_outputs or a "
                            "response_format of type json_object / json_schema, not both",
                       param="structured_outputs")
    if given is not None:
        fields = set(StructuredOutputsParams.KINDS)
        unknown = sorted(set(given) - fields)
        if unknown:
            raise APIError(400, f"structured_outputs.{unknown[0]}: unknown key (expected one of "
                                f"{', '.join(StructuredOutputsParams.KINDS)})",
                           param=f"structured_outputs.{unknown[0]}")
        return StructuredOutputsParams(**given)
    if kind == "text":
        unknown = sorted(set(fmt or {}) - {"type"})
        if unknown:
            raise APIError(400, f"response_format.{unknown[0]}: not allowed with type text",
                           param=f"response_format.{unknown[0]}")
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise APIError(400, f"response_format.type: {kind!r} is not one of text, json_object, "
                            "json_schema", param="response_format.type")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise APIError(400, "response_format.json_schema: required with type json_schema (an "
                            "object with name and schema)", param="response_format.json_schema")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise APIError(400, "response_format.json_schema.schema: must be a JSON schema object",
                       param="response_format.json_schema.schema")
    return StructuredOutputsParams(json=schema)


def constraint_fields(req: Any) -> dict[str, str]:
    """``InvalidRequestError`` fields of a constraint -> the request field they came from."""
    fmt = getattr(req, "response_format", None)
    fields = {"extra_args": "vllm_xargs"}
    if req.structured_outputs is None and fmt and fmt.get("type") in ("json_object",
                                                                       "json_schema"):
        fields.update({"structured_outputs.json": "response_format.json_schema.schema",
                       "structured_outputs.json_object": "response_format",
                       "structured_outputs": "response_format"})
    return fields


# --------------------------------------------------------------------------- bounds
# Schema keywords whose value is a map of names to subschemas, and those whose value is a
# subschema or a list of them: the places a walk finds nested schemas (and properties to count).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_VALUES = ("items", "additionalProperties", "additionalItems", "contains", "not", "if",
                  "then", "else", "propertyNames", "unevaluatedItems",
                  "unevaluatedProperties", "prefixItems", "allOf", "anyOf", "oneOf")


def _quantifier(text: str, i: int) -> tuple[int, int] | None:
    """A ``{m}``, ``{m,}`` or ``{m,n}`` at ``text[i]``: (the copies it unrolls to, its length);
    None when ``text[i]`` begins none (then it is a literal brace). ``{m,}`` unrolls ``m``
    copies and a loop."""
    end = text.find("}", i)
    if end < 0:
        return None
    low, comma, high = text[i + 1:end].partition(",")
    low, high = low.strip(), high.strip()
    if not low.isdigit() or (high and not high.isdigit()):
        return None
    copies = int(high) if high else int(low) + (1 if comma else 0)
    return copies, end + 1 - i


def repetition_size(pattern: str) -> int:
    """How many atoms a regular expression's counted repetitions (``{m,n}``) unroll to, summed
    over its outermost ones, nested ones multiplying (``(a{1,30}){1,30}`` is 900). ``*``, ``+``
    and ``?`` are loops and unroll nothing. A converter that expands ``[a-z]{1,n}`` into n
    copies spends time and memory in proportion to this, or more: xgrammar turning a JSON
    schema's ``pattern`` into a grammar takes 0.4 s at ``{1,3000}`` and minutes at
    ``{1,40000}`` (docs/server.md)."""
    # One frame per open group: [unrolled size, repeated size, last atom's size, its repeated].
    frames = [[0, 0, 0, 0]]

    def atom(size: int, repeated: int) -> None:
        f = frames[-1]
        f[0] += size
        f[1] += repeated
        f[2], f[3] = size, repeated

    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            atom(1, 0)
            i += 2
        elif c == "[":
            j = i + 1
            j += pattern.startswith("^", j)
            j += pattern.startswith("]", j)
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            atom(1, 0)
            i = j + 1
        elif c == "(":
            frames.append([0, 0, 0, 0])
            i += 1
        elif c == ")" and len(frames) > 1:
            size, repeated, _, _ = frames.pop()
            atom(size, repeated)
            i += 1
        elif c == "{" and (q := _quantifier(pattern, i)) is not None:
            copies, length = q
            f = frames[-1]
            f[0] += f[2] * (copies - 1)
            f[1] += f[2] * copies - f[3]
            f[2] = f[3] = 0
            i += length
        elif c in "|*+?":
            frames[-1][2] = frames[-1][3] = 0
            i += 1
        else:
            atom(1, 0)
            i += 1
    return sum(f[1] for f in frames)


def _schema_shape(schema: Any, field: str, limits: ConstraintLimits,
                  ) -> tuple[int, int, list[str]]:
    """(deepest nesting, properties, regular expressions) of a JSON schema, walked without
    recursion; a 400 naming ``field`` as soon as the depth passes its bound."""
    depth = properties = 0
    patterns: list[str] = []
    todo: list[tuple[Any, int]] = [(schema, 1)]
    while todo:
        node, level = todo.pop()
        if not isinstance(node, dict):
            continue
        if level > limits.max_depth:
            raise InvalidRequestError(field, f"nests subschemas deeper than the limit of "
                                             f"{limits.max_depth} "
                                             "(frontend.limits.constraints.max_depth)")
        depth = max(depth, level)
        if isinstance(node.get("pattern"), str):
            patterns.append(node["pattern"])
        for key in _SCHEMA_MAPS:
            table = node.get(key)
            if isinstance(table, dict):
                if key == "properties":
                    properties += len(table)
                elif key == "patternProperties":
                    patterns.extend(table)
                todo.extend((sub, level + 1) for sub in table.values())
        for key in _SCHEMA_VALUES:
            sub = node.get(key)
            if isinstance(sub, list):
                todo.extend((s, level + 1) for s in sub)
            elif isinstance(sub, dict):
                todo.append((sub, level + 1))
    return depth, properties, patterns


def check_constraint_bounds(so: StructuredOutputsParams, limits: ConstraintLimits) -> int:
    """Refuse a constraint over ``frontend.limits.constraints`` (an ``InvalidRequestError``
    naming its field, before anything parses or compiles it); else its cost, in
    ``FairExecutor``'s unit (about a microsecond), for the queue of the checks."""
    kind = so.kind
    field = f"structured_outputs.{kind}"
    value = getattr(so, kind)
    if kind == "json_object":
        return 1
    if kind == "json":
        try:
            text = value if isinstance(value, str) else json.dumps(value)
            schema = json.loads(value) if isinstance(value, str) else value
        except (ValueError, RecursionError):
            # Not JSON (or nested past Python's recursion limit): the backend's check names why.
            text, schema = str(value), None
    else:
        text = "\0".join(value) if kind == "choice" else value
        schema = None
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limits.max_bytes:
        raise InvalidRequestError(field, f"{size} bytes exceed the limit of {limits.max_bytes} "
                                         "(frontend.limits.constraints.max_bytes)")
    properties, patterns = 0, [text] if kind in ("regex", "grammar") else []
    if schema is not None:
        _, properties, patterns = _schema_shape(schema, field, limits)
        if properties > limits.max_properties:
            raise InvalidRequestError(field, f"{properties} object properties exceed the limit "
                                             f"of {limits.max_properties} "
                                             "(frontend.limits.constraints.max_properties)")
    repetition = sum(repetition_size(p) for p in patterns if isinstance(p, str))
    if repetition > limits.max_repetition:
        what = "its patterns' counted repetitions" if kind == "json" else \
            "its counted repetitions ({m,n})"
        raise InvalidRequestError(field, f"{what} unroll to {repetition} atoms, over the limit "
                                         f"of {limits.max_repetition} "
                                         "(frontend.limits.constraints.max_repetition)")
    return size + repetition * 64 + properties * 256


# --------------------------------------------------------------------------- the check process
# The server's constraint checks run in child processes (corellm.sandbox): each child builds the
# enabled logits processors' checker once, from the server's config.
_checker: Any = None


def init_checker(config: Any) -> None:
    """A check process's initializer: the checker the engine's ``Processor`` has, built again
    (plugins are imported per process)."""
    global _checker
    from corellm.logits_processors import RequestChecker
    from corellm.plugins import load_registry

    _checker = RequestChecker.for_config(config, load_registry(disable=config.plugins.disable))


def check_in_child(params: SamplingParams) -> None:
    """The enabled logits processors' checks of ``params``, in a check process."""
    _checker.check(params)


def checker_imports(entries: Any) -> list[str]:
    """What the check processes' fork server imports ahead: the checker's modules and the
    enabled processors' ``validate_imports`` (``entries``: their registry entries)."""
    mods = ["corellm.logits_processors", "corellm.plugins", __name__]
    for entry in entries:
        mods.extend(entry.spec.validate_imports)
    return list(dict.fromkeys(mods))
