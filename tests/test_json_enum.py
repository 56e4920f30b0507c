"""guided_json's enum and const beside other keywords (engine/json_enum.py): the values the
keywords allow are kept, each keyword constraining only its own type; texts the regex
generates are valid (the validator checks every keyword), kept values match in every
spelling and left-out ones in none."""
from __future__ import annotations

import pytest

from engine.json_schema_regex import schema_to_regex
from tests.test_json_schema_regex import matches_exactly

CASES = {  # schema: (values kept, values left out)
    "max_length": ({"type": "string", "enum": ["a", "bb", "\u00e9", "\U0001f600"],
                    "maxLength": 1}, ["a", "\u00e9", "\U0001f600"], ["bb"]),
    "pattern": ({"enum": ["x1", "y2", "ax"], "pattern": "^x"}, ["x1"], ["y2", "ax"]),
    "format": ({"type": "string", "enum": ["2024-02-29", "2023-02-29", "today"],
                "format": "date"}, ["2024-02-29"], ["2023-02-29", "today"]),
    "bounds": ({"enum": [1, 2.5, 10, -3], "minimum": 2, "exclusiveMaximum": 10}, [2.5],
               [1, 10, -3]),
    "integral_float": ({"type": "integer", "enum": [1, 2.0, 3, 7], "maximum": 3},
                       [1, 2.0, 3], [7]),
    "multiple_of": ({"enum": [3, 4.25, 6, 7.5], "multipleOf": 0.5}, [3, 6, 7.5], [4.25]),
    # A fraction's multiples spell 3 as 3.0; the integer 3 is one all the same.
    "number_multiple_of": ({"type": "number", "enum": [3, 4.25], "multipleOf": 0.5}, [3],
                           [4.25]),
    # maxLength says nothing of numbers, booleans and null: kept.
    "other_types": ({"enum": ["ab", "a", 5, 1.5, True, None], "maxLength": 1},
                    ["a", 5, 1.5, True, None], ["ab"]),
    # Unless a type beside them leaves them out.
    "typed": ({"type": ["string", "null"], "enum": ["ab", "a", 5, None], "maxLength": 1},
              ["a", None], ["ab", 5]),
    "const": ({"const": "abc", "minLength": 2}, ["abc"], ["ab"]),
    "all_of": ({"allOf": [{"enum": ["a", "bb", "ccc"]}, {"type": "string", "maxLength": 2},
                          {"minLength": 2}]}, ["bb"], ["a", "ccc"]),
    "member": ({"type": "object", "properties": {
        "code": {"type": "string", "enum": ["US", "USA", "FR"], "minLength": 2,
                 "maxLength": 2}}, "required": ["code"]},
               [{"code": "US"}, {"code": "FR"}], [{"code": "USA"}]),
}


@pytest.mark.parametrize("name", CASES)
def test_an_enum_keeps_the_values_its_keywords_allow(name):
    schema, good, bad = CASES[name]
    matches_exactly(schema, good, bad)


@pytest.mark.parametrize("schema, match", [
    ({"enum": ["abc", "de"], "maxLength": 1}, "no value of 'enum' at # meets the keywords"),
    ({"const": 1, "minimum": 2}, "no value of 'const' at # meets the keywords"),
    ({"enum": [[1], "a"], "maxItems": 0}, "'maxItems' beside 'enum' at # is supported for "
                                          "string, number, boolean and null values only"),
    ({"enum": ["a"], "pattern": "(a"}, "bad regex"),
])
def test_an_enum_that_its_keywords_leave_empty_or_check_nothing_of_is_refused(schema, match):
    with pytest.raises(ValueError, match=match):
        schema_to_regex(schema)
