"""guided_json's ``contains`` and ``minContains`` (engine/json_contains.py): texts the regex
generates are valid (the validator counts the items meeting ``contains``), arrays with
enough such items match in every spelling, arrays with too few or of the wrong length match
in none; what is not supported is refused by name."""
from __future__ import annotations

import re

import pytest

from engine.json_schema_regex import schema_to_regex
from tests.test_json_schema_regex import matches_exactly

ROLES = {"type": "array", "items": {"type": "string", "maxLength": 5},
         "contains": {"const": "admin"}}
CASES = {  # schema: (instances, non-instances)
    "const": (ROLES, [["admin"], ["x", "admin"], ["admin", "admin", "y"], ["a", "b", "admin"]],
              [[], ["x"], ["adm", "min"], ["admins"]]),
    # The contained item meets items' schema too: a number that is both an integer and >= 5.
    "merged": ({"type": "array", "items": {"type": "integer"}, "contains": {"minimum": 5}},
               [[5], [1, 7], [9, 1, 2]], [[1, 2], [], [4]]),
    "min_contains": ({"type": "array", "contains": {"type": "null"}, "minContains": 2},
                     [[None, None], [1, None, "a", None], [None, None, None]],
                     [[None], [1, 2], [None, 1]]),
    "zero": ({"type": "array", "items": {"type": "boolean"}, "contains": {"const": True},
              "minContains": 0, "maxItems": 1}, [[], [False], [True]], [[1], [True, True]]),
    "bounded": ({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                 "contains": {"minimum": 5}, "minItems": 3, "maxItems": 4},
                [[1, 2, 5], [6, 1, 2], [1, 9, 2, 3], [1, 2, 3, 5]],
                [[5], [5, 6], [1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4, 5]]),
    "at_least": ({"type": "array", "items": {"type": "string"}, "contains": {"const": "a"},
                  "minItems": 3}, [["a", "b", "c"], ["b", "c", "a"], ["b", "a", "c", "d"],
                                            ["b", "c", "d", "e", "a"]],
                 [["a"], ["a", "b"], ["b", "c", "d"]]),
    "member": ({"type": "object", "properties": {"tags": ROLES}, "required": ["tags"]},
               [{"tags": ["admin"]}], [{"tags": ["user"]}, {"tags": []}]),
}


@pytest.mark.parametrize("name", CASES)
def test_contains_takes_the_arrays_with_enough_items_meeting_it(name):
    schema, good, bad = CASES[name]
    matches_exactly(schema, good, bad)


def test_each_count_of_items_before_the_contained_one_is_an_alternative():
    rx = re.compile(schema_to_regex(CASES["bounded"][0]))
    for before in range(4):  # the contained item at each place of a 4-item array
        items = [1, 2, 3]
        items.insert(before, 7)
        assert rx.fullmatch(str(items).replace(" ", ""))


@pytest.mark.parametrize("schema, match", [
    ({"type": "array", "contains": {"const": 1}, "maxContains": 2}, "'maxContains' at #"),
    ({"type": "array", "prefixItems": [{}], "contains": {"const": 1}},
     "'contains' beside a tuple's items at #"),
    ({"type": "array", "items": [{}], "contains": {"const": 1}}, "beside a tuple's items"),
    ({"type": "array", "contains": {"const": 1}, "uniqueItems": True},
     "'contains' beside 'uniqueItems' at #"),
    ({"type": "array", "contains": {"const": 1}, "minContains": 9}, "'minContains' at # is "
                                                                    "above 8"),
    ({"type": "array", "contains": {"const": 1}, "minContains": 2, "maxItems": 1},
     "'maxItems' at # leaves no room"),
    ({"type": "array", "contains": {"const": 1}, "minContains": 2, "maxItems": 3},
     "beside 'minContains' 2"),
    ({"type": "array", "contains": {"const": 1}, "maxItems": 33}, "above 32 beside"),
    ({"type": "array", "items": {"type": "string"}, "contains": {"type": "integer"}},
     "no item can meet both 'items' and 'contains' at #"),
    ({"type": "array", "contains": {"const": 1}, "minContains": -1}, "'minContains' at #"),
])
def test_what_contains_cannot_spell_is_refused(schema, match):
    with pytest.raises(ValueError, match=re.escape(match) if "'" in match else match):
        schema_to_regex(schema)
