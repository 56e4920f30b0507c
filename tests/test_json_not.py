"""guided_json's ``not`` (engine/json_not.py): types or few values left out, folded into
the schema; texts the regex generates are valid (the validator checks ``not``), instances
match and what ``not`` names does not; any other ``not`` is refused by name."""
from __future__ import annotations

import re

import pytest

from engine.json_schema_regex import schema_to_regex
from tests.test_json_schema_regex import matches_exactly

CASES = {  # schema: (instances, values left out)
    "not_null": ({"not": {"type": "null"}}, [0, 1.5, "a", True, [], {"k": None}], [None]),
    "nullable_not_null": ({"type": "string", "nullable": True, "maxLength": 2,
                           "not": {"type": "null"}}, ["", "ab"], [None]),
    "types": ({"type": ["integer", "string", "array"], "not": {"type": ["array", "number"]}},
              ["x"], [1, [1], 2.5]),
    "values": ({"enum": ["a", "b", 1, None], "not": {"enum": ["b", 1.0]}}, ["a", None],
               ["b", 1]),
    "booleans": ({"type": "boolean", "not": {"const": False}}, [True], [False]),
    "ref": ({"$defs": {"N": {"type": "null"}}, "type": "object",
             "properties": {"v": {"anyOf": [{"type": "integer"}, {"type": "null"}],
                                  "not": {"$ref": "#/$defs/N"}}}, "required": ["v"]},
            [{"v": 3}], [{"v": None}]),
    "implied": ({"maxLength": 2, "not": {"type": "null"}}, ["ab"], [None, "abc"]),
    "implied_left_out": ({"maxLength": 2, "not": {"type": "string"}}, [None, 3, [], {}],
                         ["a"]),
    "not_false": ({"type": "integer", "maximum": 3, "not": False}, [3, -1], [4]),
}


@pytest.mark.parametrize("name", CASES)
def test_not_leaves_out_what_it_names_and_keeps_the_rest(name):
    schema, good, bad = CASES[name]
    # OpenAPI's nullable takes null whatever else the schema says, in the test's reading;
    # leaving null out is valid in both.
    matches_exactly(schema, good, bad, lambda value: schema.get("nullable") and value is None)


@pytest.mark.parametrize("schema, message", [
    ({"type": "string", "not": {"pattern": "a"}}, "'not' at # is supported for types to leave "
                                                  "out, or values of a schema whose values"),
    ({"type": "string", "not": {"const": "a"}}, "'not' at # is supported for types"),
    ({"not": {"type": "integer"}}, "'not' at # leaves out integers but not numbers"),
    ({"type": "integer", "not": {"type": "number"}}, "the schema at # leaves no value once its "
                                                     "'not'"),
    ({"type": "string", "not": {}}, "the schema at # leaves no value"),
    ({"enum": [1, 2], "not": {"enum": [2, 1.0]}}, "the schema at # leaves no value"),
    ({"not": {"type": "nil"}}, "'type' at #/not must be one of"),
])
def test_a_not_that_cannot_be_folded_is_refused_by_name(schema, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        schema_to_regex(schema)
