"""What an output constraint asks for, read from its text before anything parses or compiles
it: its size, how deep its schema nests, how many object properties it has, and what its
regular expressions' counted repetitions unroll to. A server bounds these
(``frontend.limits.constraints``), a backend costs its compile queue by them, and both key
their caches by ``digest``. Also ``without_annotations``: a JSON schema without the keywords
that constrain nothing.

The walk of a JSON schema visits every object and list of it as compiled (without the
annotations ``without_annotations`` drops), whatever the key: a ``$ref`` may point anywhere in
the document (``{"$ref": "#/x", "x": {...}}``), so a subschema is not only where the keywords
put one. It never recurses, and its regular expressions scan a pattern in linear time."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from corellm.sampling_params import StructuredOutputsParams

# Keywords that annotate a schema without constraining it (JSON Schema's meta-data vocabulary).
ANNOTATIONS = frozenset({"description", "title", "examples", "$comment", "default", "deprecated",
                         "readOnly", "writeOnly"})
# Keywords whose value maps names to subschemas (its keys are names, never keywords).
SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                         "dependentSchemas"})

# Keywords whose value is a subschema or a list of them.
SCHEMA_VALUES = frozenset({"items", "additionalProperties", "additionalItems", "contains", "not",
                           "if", "then", "else", "propertyNames", "unevaluatedItems",
                           "unevaluatedProperties", "prefixItems", "allOf", "anyOf", "oneOf"})
# Keywords whose value is data the output must equal, never a schema.
_VALUES = frozenset({"enum", "const"})
# A regular expression's tokens: an escape, a character class, a counted repetition, one of
# ( ) | * + ?, or a run of literal characters.
_TOKENS = re.compile(r"""
    (?P<escape>\\.?)
  | (?P<klass>\[\^?\]?(?:\\.|[^\]\\])*\]?)
  | (?P<count>\{\s*(?P<low>[0-9]+)\s*(?:(?P<comma>,)\s*(?P<high>[0-9]*)\s*)?\})
  | (?P<open>\()
  | (?P<close>\))
  | (?P<other>[|*+?{])
  | (?P<run>[^\\\[(){|*+?]+)
""", re.VERBOSE | re.DOTALL)
# A counted repetition of more than nine digits is counted as this many copies.
_HUGE = 10 ** 9


@dataclass(frozen=True)
class ConstraintShape:
    size: int           # bytes of its JSON or text
    depth: int          # nesting of objects in a JSON schema (0 for other kinds)
    properties: int     # object properties in a JSON schema, over all of it
    repetition: int     # what its regular expressions' counted repetitions unroll to

    @property
    def cost(self) -> int:
        """An estimate of parsing and compiling it, in ``corellm.serving.fair``'s unit (about a
        microsecond): its size, its repetitions and properties weighted by what each costs
        xgrammar."""
        return self.size + 64 * self.repetition + 256 * self.properties


def repetition_size(pattern: str) -> int:
    """How many atoms a regular expression's counted repetitions (``{m,n}``) unroll to, summed
    over its outermost ones, nested ones multiplying (``(a{1,30}){1,30}`` is 900). ``*``, ``+``
    and ``?`` are loops and unroll nothing. A converter that expands ``[a-z]{1,n}`` into n
    copies spends time and memory in proportion to this, or more: xgrammar turning a JSON
    schema's ``pattern`` into a grammar takes 0.4 s at ``{1,3000}`` and minutes at
    ``{1,40000}`` (docs/server.md)."""
    # One frame per open group: [unrolled size, repeated size, last atom's size, its repeated].
    frames = [[0, 0, 0, 0]]
    for m in _TOKENS.finditer(pattern):
        f = frames[-1]
        kind = m.lastgroup
        if kind == "open":
            frames.append([0, 0, 0, 0])
            continue
        if kind == "count":
            high, low = m["high"] or "", m["low"]
            if len(high) > 9 or len(low) > 9:
                copies = _HUGE
            else:
                copies = int(high) if high else int(low) + (1 if m["comma"] else 0)
            f[0] += f[2] * (copies - 1)
            f[1] += f[2] * copies - f[3]
            f[2] = f[3] = 0
            continue
        if kind == "close" and len(frames) > 1:
            size, repeated, _, _ = frames.pop()
            f = frames[-1]
            f[0] += size
            f[1] += repeated
            f[2], f[3] = size, repeated
            continue
        if kind in ("other", "close"):
            f[2] = f[3] = 0                 # a loop or an alternative: nothing to repeat
            continue
        # An atom: an escape or a class is one; a run of literals is its length, and a count
        # after it repeats its last character only.
        f[0] += len(m.group()) if kind == "run" else 1
        f[2], f[3] = 1, 0
    return sum(f[1] for f in frames)


def _walk(schema: Any) -> tuple[int, int, list[str]]:
    """(deepest nesting of objects and lists, properties, regular expressions) of a JSON schema
    (as it is compiled: without its annotations): every ``pattern`` string and
    ``patternProperties`` key wherever it sits, every ``properties`` object's names."""
    depth = properties = 0
    patterns: list[str] = []
    todo: list[tuple[Any, int]] = [(schema, 0)]
    while todo:
        node, level = todo.pop()
        if isinstance(node, list):
            depth = max(depth, level + 1)
            todo.extend((item, level + 1) for item in node)
            continue
        if not isinstance(node, dict):
            continue
        level += 1
        depth = max(depth, level)
        for key, value in node.items():
            if key == "pattern" and isinstance(value, str):
                patterns.append(value)
            elif key == "properties" and isinstance(value, dict):
                properties += len(value)
            elif key == "patternProperties" and isinstance(value, dict):
                patterns.extend(value)
            if isinstance(value, (dict, list)):
                todo.append((value, level))
    return depth, properties, patterns


def json_depth(value: Any) -> int:
    """How deep objects and lists nest in ``value`` (0 for a scalar), without recursion."""
    return _walk(value)[0]


def constraint_shape(so: StructuredOutputsParams) -> ConstraintShape:
    """The shape of a constraint (a JSON schema given as text is read as the object it
    encodes; one that is not JSON is measured by its size alone: parsing it will refuse it)."""
    kind = so.kind
    value = getattr(so, kind)
    if kind == "json_object":
        return ConstraintShape(0, 0, 0, 0)
    if kind == "json":
        schema = value
        if isinstance(value, str):
            try:
                schema = json.loads(value)
            except (ValueError, RecursionError):        # parsing it will refuse it
                return ConstraintShape(len(value.encode("utf-8", "surrogatepass")), 0, 0, 0)
        # What is compiled: the schema without its annotations (walked without recursion, so
        # a nesting too deep to print still has its depth measured, and refused).
        depth, properties, patterns = _walk(without_annotations(schema))
        try:
            text = value if isinstance(value, str) else json.dumps(value)
        except (ValueError, RecursionError):
            text = ""
        repetition = sum(map(repetition_size, patterns))
        return ConstraintShape(len(text.encode("utf-8", "surrogatepass")), depth, properties,
                               repetition)
    text = "\0".join(value) if kind == "choice" else value
    repetition = repetition_size(text) if kind in ("regex", "grammar") else 0
    return ConstraintShape(len(text.encode("utf-8", "surrogatepass")), 0, 0, repetition)


def without_annotations(schema: Any) -> Any:
    """``schema`` without its annotation keywords (``ANNOTATIONS``) where a schema is: at the
    root and under the keywords that hold subschemas (``SCHEMA_MAPS``' values, whose keys are
    names: a property may be named ``description``, and ``SCHEMA_VALUES``). Anything else
    (``enum`` and ``const`` data, keys this does not know, which a ``$ref`` may point into) is
    kept as given. Without recursion."""
    root: list[Any] = [None]
    # (node, where to put its copy, the slot, what it is: "schema", "names" or "data")
    todo: list[tuple[Any, Any, Any, str]] = [(schema, root, 0, "schema")]
    while todo:
        node, parent, slot, what = todo.pop()
        if what == "data" or not isinstance(node, (dict, list)):
            parent[slot] = node
            continue
        if isinstance(node, list):
            out: Any = [None] * len(node)
            todo.extend((item, out, i, "schema") for i, item in enumerate(node))
        elif what == "names":
            out = {}
            for name, sub in node.items():
                out[name] = None
                todo.append((sub, out, name, "schema"))
        else:
            out = {}
            for key, value in node.items():
                if key in ANNOTATIONS:
                    continue
                out[key] = None
                kind = ("names" if key in SCHEMA_MAPS and isinstance(value, dict)
                        else "schema" if key in SCHEMA_VALUES else "data")
                todo.append((value, out, key, kind))
        parent[slot] = out
    return root[0]


def digest(*parts: str) -> bytes:
    """16 bytes that stand for ``parts`` in a cache, whatever their size."""
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(part.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    return h.digest()
