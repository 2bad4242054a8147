"""The bounds an output constraint is held to before anything parses it
(``frontend.limits.constraints``), and the canonical form the xgrammar plugin keys and compiles:
on the constraints' text, in process. The server's behaviour under the attacks these bounds
answer is in tests/test_server_reliability.py."""

from __future__ import annotations

import json

import pytest

from corellm.serving.constraint_shape import repetition_size, without_annotations
from corellm.errors import InvalidRequestError
from corellm.sampling_params import StructuredOutputsParams
from corellm_plugins.frontend_openai.constraints import check_constraint_bounds
from corellm_plugins.frontend_openai.options import ConstraintLimits


@pytest.mark.parametrize("pattern, size", [
    ("abc", 0),                            # literals and loops unroll nothing
    ("a*b+c?(de)*", 0),
    ("[a-z]{1,40000}", 40000),
    (r"\d{4}-\d{2}-\d{2}", 8),
    ("a{2,}", 3),                          # m copies and the loop
    ("(ab|cd){3}", 12),                    # a group's size, times its count
    ("(a{1,30}){1,30}", 900),              # nested counts multiply
    ("a{1,3}b{1,3}", 6),                   # siblings add
    ("[{]{5}", 5),                         # a brace in a class is a character
    ("x{a}", 0),                           # not a quantifier: literal braces
    (r"\{1,999\}", 0),                     # escaped braces
    ("((a{1,5000}", 5000),                 # unbalanced: still counted
    ("abc{3}", 3),                         # a count repeats the last character of a run
    ("a{\u00b2}", 0),                      # a digit Python's int() takes, a regex does not
    ("a{" + "9" * 5000 + "}", 10 ** 9),    # more digits than any repetition: counted huge
    ("{" + "1" * 50_000, 0),               # an unclosed count is literal (and read in one pass)
    ("a{1,", 0),
])
def test_repetition_size(pattern, size):
    assert repetition_size(pattern) == size


LIMITS = ConstraintLimits(max_bytes=4096, max_depth=5, max_properties=8, max_repetition=100)
REF = {"$ref": "#/x", "x": {"type": "string", "pattern": "[a-z]{1,101}"}}


@pytest.mark.parametrize("so, says", [
    ({"json": {"type": "string", "pattern": "[a-z]{1,101}"}}, "max_repetition"),
    ({"json": {"type": "object", "patternProperties": {"^x{1,200}$": {}}}}, "max_repetition"),
    ({"json": {"type": "object", "properties": {"a": {"type": "string", "pattern": "a{60}"},
                                                "b": {"type": "string", "pattern": "b{60}"}}}},
     "max_repetition"),                    # summed over the schema
    ({"regex": "(ab){1,51}"}, "max_repetition"),
    ({"grammar": 'root ::= "a"{1,101}'}, "max_repetition"),
    ({"json": {"type": "object", "properties": {f"p{i}": {} for i in range(9)}}},
     "max_properties"),
    ({"json": {"anyOf": [{"type": "object", "properties": {f"p{i}": {} for i in range(5)}},
                         {"type": "object", "properties": {f"q{i}": {} for i in range(5)}}]}},
     "max_properties"),                    # counted over every subschema
    ({"json": {"type": "array", "items": {"type": "array", "items": {"type": "array", "items": {
        "type": "array", "items": {"type": "array", "items": {}}}}}}}, "max_depth"),
    # a $ref may point anywhere in the document: every object is walked, whatever its key
    ({"json": REF}, "max_repetition"),
    ({"json": {"$ref": "#/a", "a": {"properties": {f"p{i}": {} for i in range(9)}}}},
     "max_properties"),
    ({"json": {"$ref": "#/a", "a": {"b": {"c": {"d": {"e": {}}}}}}}, "max_depth"),
    ({"json": {"type": "array", "enum": [[[[[1]]]]]}}, "max_depth"),    # lists nest too
    ({"json": {"type": "string", "description": "d" * 5000}}, "max_bytes"),
    ({"choice": ["x" * 5000]}, "max_bytes"),
])
def test_over_a_bound_is_an_error_naming_the_field_and_the_key(so, says):
    params = StructuredOutputsParams(**so)
    with pytest.raises(InvalidRequestError) as info:
        check_constraint_bounds(params, LIMITS)
    assert info.value.field == f"structured_outputs.{params.kind}"
    assert f"frontend.limits.constraints.{says}" in info.value.message


def test_annotations_count_nothing():
    """What is dropped before compiling is not counted: a pattern in a default, properties in
    examples."""
    shape = check_constraint_bounds(StructuredOutputsParams(json={
        "type": "string", "default": {"pattern": "[0-9]{1,5000}"},
        "examples": [{"properties": {f"p{i}": {} for i in range(20)}}]}), LIMITS)
    assert shape < 1000


def test_within_the_bounds_is_a_cost():
    small = check_constraint_bounds(StructuredOutputsParams(regex="[0-9]{3}"), LIMITS)
    large = check_constraint_bounds(StructuredOutputsParams(json={
        "type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "a{10}"}
                                         for i in range(8)}}), LIMITS)
    assert 0 < small < large
    # a schema given as JSON text is walked as the object it encodes
    with pytest.raises(InvalidRequestError, match="max_properties"):
        check_constraint_bounds(StructuredOutputsParams(json=json.dumps(
            {"type": "object", "properties": {f"p{i}": {} for i in range(9)}})), LIMITS)


def test_annotations_are_dropped_where_schemas_are_not_where_names_are():
    schema = {"type": "object", "description": "x" * 1000, "title": "T", "$comment": "c",
              "properties": {"description": {"type": "string", "description": "the text",
                                             "default": "none"},
                             "title": {"type": "string", "examples": ["a"]}},
              "items": [{"title": "t", "type": "integer"}], "$defs": {"d": {"title": "x"}},
              "enum": [{"description": "data, kept"}], "const": {"title": "kept"}}
    # keys it does not know are kept whole: a $ref may point into them
    components = {"$ref": "#/components/schemas/default", "components": {"schemas": {
        "default": {"type": "integer", "description": "kept"}}}}
    assert without_annotations(components) == components
    assert without_annotations(schema) == {
        "type": "object", "properties": {"description": {"type": "string"},
                                         "title": {"type": "string"}},
        "items": [{"type": "integer"}], "$defs": {"d": {}},
        "enum": [{"description": "data, kept"}], "const": {"title": "kept"}}
    grammars = pytest.importorskip("corellm_plugins.structured_xgrammar.grammars")
    padded = StructuredOutputsParams(json={**schema, "description": "y" * 900_000})
    plain = StructuredOutputsParams(json=without_annotations(schema))
    assert grammars.source(padded) == grammars.source(plain)
