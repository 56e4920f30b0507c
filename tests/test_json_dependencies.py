"""guided_json's dependentRequired, dependentSchemas and draft 7's dependencies
(engine/json_dependencies.py): the object is the anyOf of variants with the member present
and what it needs, or absent; texts the regex generates are valid (the validator checks each
dependency), instances match, and objects missing what a present member needs do not."""
from __future__ import annotations

import re

import pytest

from engine.json_dependencies import MAX_VARIANTS
from engine.json_schema_regex import schema_to_regex
from tests.test_json_schema_regex import matches_exactly

PAY = {"card": {"type": "integer", "minimum": 0}, "address": {"type": "string", "maxLength": 4},
       "zip": {"type": "string", "pattern": "^[0-9]{2}$"}, "note": {"type": "boolean"}}
CASES = {  # schema: (instances, objects that break a dependency)
    "required": ({"type": "object", "properties": PAY, "required": ["note"],
                  "dependentRequired": {"card": ["address", "zip"], "address": ["zip"]}},
                 [{"note": True}, {"zip": "12", "note": False},
                  {"card": 1, "address": "a", "zip": "12", "note": True}],
                 [{"card": 1, "note": True}, {"address": "a", "note": True},
                  {"card": 1, "zip": "12", "note": True}]),
    "schemas": ({"type": "object", "properties": PAY,
                 "dependentSchemas": {"card": {"properties": {"note": {"const": True}},
                                               "required": ["note"]}}},
                [{}, {"note": False}, {"card": 3, "note": True}],
                [{"card": 3}, {"card": 3, "note": False}]),
    "draft7": ({"type": "object", "properties": PAY, "required": ["card"],
                "dependencies": {"card": ["zip"], "note": {"required": ["address"]}}},
               [{"card": 0, "zip": "00"}, {"card": 0, "address": "x", "zip": "00", "note": True}],
               [{"card": 0}, {"card": 0, "zip": "00", "note": True}]),
    "undeclared": ({"type": "object", "properties": {"a": {"type": "null"}},
                    "dependentRequired": {"b": ["c"]}}, [{}, {"a": None}], []),
    "forbidden": ({"type": "object", "properties": {"a": {"type": "null"}},
                   "dependentSchemas": {"a": False}}, [{}], [{"a": None}]),
    # y needs x, and x's own dependency leaves it out of one variant: y is absent there.
    "chained": ({"type": "object", "properties": {"x": {"type": "null"}, "y": {"type": "null"},
                                                 "z": {"type": "boolean"}},
                 "dependentRequired": {"x": ["z"], "y": ["x"]}},
                [{}, {"z": True}, {"x": None, "z": False}, {"x": None, "y": None, "z": True}],
                [{"x": None}, {"y": None}, {"y": None, "z": True}]),
    "needs_undeclared": ({"type": "object", "properties": {"a": {"type": "null"},
                                                          "b": {"type": "boolean"}},
                          "dependentRequired": {"a": ["z"]}}, [{}, {"b": True}],
                         [{"a": None}, {"a": None, "b": True}]),
}


@pytest.mark.parametrize("name", CASES)
def test_a_member_present_brings_what_it_needs(name):
    matches_exactly(*CASES[name])


@pytest.mark.parametrize("schema, message", [
    ({"type": "object", "additionalProperties": {"type": "integer"},
      "dependentRequired": {"a": ["b"]}}, "dependencies at # are supported beside 'properties'"),
    ({"properties": {"a": {}}, "dependentRequired": {"a": "b"}},
     "'dependentRequired' at #/dependentRequired/a must be an array of names"),
    ({"properties": {"a": {}}, "dependentSchemas": {"a": ["b"]}}, "must be a schema"),
    ({"properties": {"a": {}}, "dependencies": {"a": 3}}, "must be a schema or an array"),
    ({"properties": {"a": {}}, "dependentRequired": []}, "'dependentRequired' at # must be an "
                                                         "object"),
    ({"properties": {"a": {}}, "required": ["a"], "dependentSchemas": {"a": False}},
     "the member 'a' at # is required, and what it depends on is false"),
    ({"properties": {"a": {}}, "required": ["a"], "dependentRequired": {"a": ["z"]}},
     "or names members not in 'properties'"),
    ({"properties": {c: {} for c in "abcdefgh"},
      "dependentRequired": {c: ["a"] for c in "bcdefgh"}}, f"more than {MAX_VARIANTS} variants"),
])
def test_dependencies_that_cannot_be_followed_are_refused_by_name(schema, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        schema_to_regex(schema)
