"""Random schemas from a grammar of every keyword guided_json follows (formats, multipleOf,
patterns beside lengths, property counts, member names, dependencies, allOf, oneOf and not,
keywords beside anyOf, recursion to the root, nullable): the regex compiles or the schema is
refused with a ValueError, never another error; every text drawn from a compiled regex is
valid under the schema. Slow (300 schemas, ~90 s): ``-m slow``; PDSERVE_FUZZ_EXAMPLES sets
how many."""
from __future__ import annotations

import json
import os
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.json_schema_regex import schema_to_regex
from engine.regex_dfa import compile_regex
from tests.test_json_schema_regex import valid

pytestmark = pytest.mark.slow


_NUMBERS = st.integers(-50, 50) | st.sampled_from([0.5, 0.25, 2.5, 0.01, 1e3, -7.5])
_FORMATS = ["date", "time", "date-time", "uuid", "ipv4", "ipv6", "hostname", "email", "uri",
            "duration", "password"]
_PATTERNS = ["^[a-z]+$", "[0-9]{2}", "^a|b$", "^(?:ab|c)+$", "x*", "^[A-Z][a-z]*$"]
# Member names: an enum of them, a string's rules, or one pattern with its values' schema.
_NAME_RULES = {
    "propertyNames": st.sampled_from([{"enum": ["a", "x-a", 3]}, {"maxLength": 1},
                                      {"pattern": "^x-"}, {"const": "b"}, {"format": "date"}]),
    "patternProperties": st.sampled_from([{"^x-": {"type": "integer"}}, {"b$": {}},
                                          {"^[ab]+$": {"enum": [1, "a"]}}]),
}
_DEPENDENCIES = {
    "dependentRequired": st.sampled_from([{"a": ["b"]}, {"ab": ["x-a", "a"]}, {"x-bc": []}]),
    "dependentSchemas": st.sampled_from([{"a": {"required": ["b"]}}, {"b": False},
                                         {"ab": {"properties": {"a": {"type": "null"}}}}]),
}
_SCALAR_KINDS = ["integer", "number", "string", "format", "pattern", "enum", "null"]


def _some(draw, s: dict, options: dict) -> dict:
    """``s`` with each of ``options`` (keyword: strategy) drawn in, or not."""
    for kw, values in options.items():
        if draw(st.booleans()):
            s[kw] = draw(values)
    return s


@st.composite
def schemas(draw, depth: int = 3) -> dict:
    nested = ["array", "object", "map", "any", "root", "anyOf", "allOf", "oneOf"]
    kinds = _SCALAR_KINDS + (nested if depth else [])
    kind = draw(st.sampled_from(kinds))
    counts = st.integers(0, 3)
    if kind == "integer":
        s = _some(draw, {"type": "integer"}, {
            "minimum": _NUMBERS, "maximum": _NUMBERS,
            "multipleOf": st.sampled_from([1, 2, 5, 10, 0.5, 3, 25, 8]),
            "format": st.sampled_from(["int32", "int64"]),
            "exclusiveMaximum": st.booleans()})  # draft 4's flag
    elif kind == "number":
        s = _some(draw, {"type": "number"}, {
            "exclusiveMinimum": _NUMBERS, "maximum": _NUMBERS,
            "multipleOf": st.sampled_from([0.01, 0.5, 0.25, 2.5, 5, 0.3])})
    elif kind == "string":
        s = _some(draw, {"type": "string"}, {"minLength": counts, "maxLength": st.integers(0, 8)})
    elif kind == "format":
        s = _some(draw, {"type": "string", "format": draw(st.sampled_from(_FORMATS))},
                  {"maxLength": st.sampled_from([10, 50, 300, 3000])})
    elif kind == "pattern":
        s = _some(draw, {"type": "string", "pattern": draw(st.sampled_from(_PATTERNS))},
                  {"minLength": st.integers(0, 5), "maxLength": st.integers(0, 9)})
    elif kind == "enum":
        s = _some(draw, {"enum": draw(st.lists(st.none() | st.booleans() | st.integers(-3, 3)
                                               | st.sampled_from([0.5, 1.0, 2.25])
                                               | st.text(max_size=2), min_size=1, max_size=3))},
                  {"maxLength": st.integers(0, 2), "minimum": st.integers(-2, 2),
                   "multipleOf": st.sampled_from([0.5, 2]), "pattern": st.sampled_from(_PATTERNS),
                   "type": st.sampled_from(["string", "integer", ["number", "null"]])})
    elif kind == "null":
        s = {"type": "null"}
    elif kind == "array":
        s = _some(draw, {"type": "array", "items": draw(schemas(depth - 1))}, {
            "minItems": st.integers(0, 2), "maxItems": counts,
            "prefixItems": st.lists(schemas(depth - 1), max_size=1),
            "contains": schemas(depth - 1), "minContains": st.integers(0, 2)})
    elif kind == "object":
        names = draw(st.lists(st.sampled_from(["a", "b", "ab", "x-a", "x-bc"]), unique=True,
                              max_size=3))
        s = _some(draw, {"type": "object",
                         "properties": {n: draw(schemas(depth - 1)) for n in names},
                         "required": [n for n in names if draw(st.booleans())]},
                  {"minProperties": st.integers(0, 2), "maxProperties": counts,
                   **_NAME_RULES, **_DEPENDENCIES})
    elif kind == "map":
        s = _some(draw, {"type": "object", "additionalProperties": draw(schemas(depth - 1))},
                  {"minProperties": st.integers(0, 2), "maxProperties": st.integers(0, 2),
                   **_NAME_RULES})
    elif kind == "root":
        s = {"$ref": "#"}
    elif kind == "anyOf":
        s = {"anyOf": draw(st.lists(schemas(depth - 1), min_size=1, max_size=3))}
        if draw(st.booleans()):  # keywords beside: joined with each schema
            s.update(draw(schemas(depth - 1)))
    elif kind in ("allOf", "oneOf"):
        s = {kind: draw(st.lists(schemas(depth - 1), min_size=1, max_size=3))}
    else:
        s = {}
    if draw(st.integers(0, 5)) == 0:
        s["nullable"] = True
    if draw(st.integers(0, 9)) == 0:  # a condition: a type, or a member's value
        s["if"] = draw(st.sampled_from([{"type": "string"}, {"const": 1}, {"minimum": 0},
                                        {"maxLength": 2},
                                        {"properties": {"a": {"const": 1}}},
                                        {"properties": {"a": {"minimum": 2}}},
                                        {"properties": {"b": {"enum": ["a", None]}},
                                         "required": ["b"]}]))
        s.update(_some(draw, {}, {"then": schemas(0), "else": schemas(0)}))
    if draw(st.integers(0, 7)) == 0:  # types, values or bounds left out
        s["not"] = draw(st.sampled_from([{"type": "null"}, {"type": ["string", "array"]},
                                         {"type": "number"}, {"enum": [1, "a", None]},
                                         {"const": True}, {}, {"minimum": 1},
                                         {"type": "integer", "maximum": -1, "minimum": -9},
                                         {"minLength": 2, "maxItems": 1},
                                         {"exclusiveMaximum": 2.5, "maxLength": 0}]))
    return s


@settings(max_examples=int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "300")), deadline=None,
          derandomize=True, suppress_health_check=list(HealthCheck))
@given(schema=schemas(), data=st.data())
def test_random_schemas_compile_or_are_refused_and_match_only_valid_texts(schema, data):
    try:
        rx = schema_to_regex(schema)
        dfa = compile_regex(rx)
    except ValueError:
        return
    if len(rx) > 3000:  # drawing from a long regex takes seconds
        return
    for _ in range(3):
        text = data.draw(st.from_regex(re.compile(rx), fullmatch=True))
        assert dfa.fullmatch(text), (schema, text)
        try:
            ok = valid(json.loads(text), schema, schema)
        except RecursionError:  # the test's validator on a schema that is all $ref
            return
        assert ok, (json.dumps(schema), text)
