"""guided_json's if/then/else (engine/json_conditional.py): texts the regex generates are
valid (the validator applies then or else by whether if holds), instances match in every
spelling and values that take the wrong branch in none; an alternative no value meets is
left out, and what the compiler cannot negate is refused by name."""
from __future__ import annotations

import json
import re

import pytest

from engine.json_schema_regex import schema_to_regex
from tests.test_json_schema_regex import generates_only_valid_texts, matches_exactly, valid

ADDRESS = {"type": "object", "properties": {
    "country": {"enum": ["US", "CA", "FR"]}, "postal": {"type": "string", "maxLength": 6}},
    "required": ["country", "postal"],
    "if": {"properties": {"country": {"const": "US"}}},
    "then": {"properties": {"postal": {"pattern": "^[0-9]{5}$"}}},
    "else": {"properties": {"postal": {"pattern": "^[A-Z]"}}}}
CASES = {  # schema: (instances, non-instances)
    "tag": (ADDRESS, [{"country": "US", "postal": "12345"}, {"country": "CA", "postal": "K1A"},
                      {"country": "FR", "postal": "A"}],
            [{"country": "US", "postal": "A1"}, {"country": "CA", "postal": "12345"},
             {"country": "US"}]),
    # Without "required" in the condition, a missing member meets it.
    "required_in_if": ({"type": "object", "properties": {"kind": {"enum": ["a", "b"]},
                                                         "x": {"type": "integer"}},
                        "if": {"properties": {"kind": {"const": "a"}}, "required": ["kind"]},
                        "then": {"required": ["x"]}},
                       [{"kind": "a", "x": 1}, {}, {"kind": "b"}, {"x": 2}],
                       [{"kind": "a"}]),
    # Required by both: it is never absent, and only its value can miss the condition.
    "both_require": ({"type": "object", "properties": {"kind": {"enum": ["a", "b"]},
                                                       "x": {"type": "integer"}},
                      "required": ["kind"],
                      "if": {"properties": {"kind": {"const": "a"}}, "required": ["kind"]},
                      "then": {"required": ["x"]}},
                     [{"kind": "a", "x": 1}, {"kind": "b"}], [{"kind": "a"}, {}]),
    # A recursive tree whose nodes hold a condition: a way through it cut by the recursion
    # depth is left out as anyOf leaves out a cut branch, not refused.
    "recursive": ({"$defs": {"T": {"type": "object", "properties": {
        "k": {"enum": ["a", "b"]}, "kids": {"type": "array", "items": {"$ref": "#/$defs/T"}}},
        "required": ["k"], "if": {"properties": {"k": {"const": "a"}}},
        "then": {"required": ["kids"], "properties": {"kids": {"minItems": 1}}}}},
                   "$ref": "#/$defs/T"},
                  [{"k": "b"}, {"k": "a", "kids": [{"k": "b"}]},
                   {"k": "a", "kids": [{"k": "a", "kids": [{"k": "b"}]}]}],
                  [{"k": "a"}, {"k": "a", "kids": []}, {"k": "a", "kids": [{"k": "a"}]}]),
    "absent_meets_it": ({"type": "object", "properties": {"kind": {"enum": ["a", "b"]}},
                         "if": {"properties": {"kind": {"const": "a"}}},
                         "then": {"minProperties": 1}, "else": False},
                        [{"kind": "a"}], [{}, {"kind": "b"}]),
    "types": ({"type": ["string", "integer"], "if": {"type": "string"},
               "then": {"maxLength": 2}, "else": {"minimum": 0}},
              ["ab", "", 0, 7], ["abc", -1]),
    "values": ({"enum": [1, 2, 3], "if": {"const": 1}, "then": {"type": "integer"},
                "else": {"enum": [3]}}, [1, 3], [2]),
    # The condition always holds where the rest is: the other branch is left out.
    "one_way": ({"type": "object", "properties": {"c": {"const": "US"}}, "required": ["c"],
                 "if": {"properties": {"c": {"const": "US"}}},
                 "then": {"properties": {"z": {"type": "integer"}}, "required": ["z"]}},
                [{"c": "US", "z": 1}], [{"c": "US"}]),
    # then and else without if say nothing.
    "no_if": ({"type": "integer", "then": {"minimum": 5}, "else": False}, [1, 7], ["a"]),
    "nullable": ({"type": "string", "nullable": True, "if": {"type": "string"},
                  "then": {"maxLength": 1}}, [None, "a"], ["ab", 1]),
    # Bounds as the condition (engine/json_not_bounds.py): its other way turns them over.
    "bound": ({"type": "integer", "if": {"minimum": 0}, "then": {"multipleOf": 5},
               "else": {"maximum": -10}}, [0, 5, 100, -10, -11], [3, -5, -9]),
    "member_bound": ({"type": "object", "properties": {"age": {"type": "integer"},
                                                       "guardian": {"type": "string"}},
                      "required": ["age"],
                      "if": {"properties": {"age": {"minimum": 18}}},
                      "then": {"properties": {"guardian": False}},
                      "else": {"required": ["guardian"]}},
                     [{"age": 20}, {"age": 18}, {"age": 3, "guardian": "Mum"}],
                     [{"age": 3}, {"age": 20, "guardian": "x"}, {"age": 17}]),
    "length_bound": ({"type": "string", "if": {"maxLength": 2}, "then": {"pattern": "^[a-z]*$"},
                      "else": {"pattern": "^[A-Z]"}}, ["", "ab", "ABC", "Abcd"],
                     ["AB", "abc", "a1"]),
}


# Cases whose texts hypothesis takes ~6 s to start drawing (it builds a class of all string
# characters one character at a time, when the class stands beside escapes in a group): the
# draws are the slow tier's, the instances are checked in both.
SLOW_DRAWS = {"tag", "length_bound"}


@pytest.mark.parametrize("name", CASES)
def test_a_value_takes_then_or_else_by_whether_it_meets_if(name):
    schema, good, bad = CASES[name]
    matches_exactly(schema, good, bad, draw=name not in SLOW_DRAWS)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SLOW_DRAWS))
def test_what_the_slowly_drawn_cases_generate_is_valid(name):
    generates_only_valid_texts(CASES[name][0])


def test_a_free_strings_tag_takes_the_other_way_for_any_other_string():
    """Its other way is any string but "US" (engine/json_not_strings.py). Checked on
    instances, not drawn texts: hypothesis takes ~16 s to draw one from that regex."""
    schema = {"type": "object", "properties": {"country": {"type": "string"},
                                                "postal": {"type": "string"}},
              "required": ["country", "postal"],
              "if": {"properties": {"country": {"const": "US"}}},
              "then": {"properties": {"postal": {"pattern": "^[0-9]{5}$"}}}}
    rx = re.compile(schema_to_regex(schema))
    for value in [{"country": "US", "postal": "12345"}, {"country": "USA", "postal": "x"},
                  {"country": "", "postal": ""}, {"country": "U", "postal": "ab"}]:
        assert valid(value, schema, schema) and rx.fullmatch(json.dumps(value)), value
    for value in [{"country": "US", "postal": "1234"}, {"country": "US", "postal": "abcde"}]:
        assert not valid(value, schema, schema), value
        assert not rx.fullmatch(json.dumps(value)), value
        assert not rx.fullmatch(json.dumps(value).replace("US", "\\u0055S")), value


@pytest.mark.parametrize("schema, match", [
    ({"type": "integer", "if": {"multipleOf": 5}, "then": {"minimum": 2}},
     "'if' at #: 'not' at # is supported for types"),
    ({"if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["a"]}},
     "an object condition at #/if needs \"type\": \"object\""),
    ({"type": "object", "if": {"minProperties": 1}, "then": {}}, "'if' at #: 'not' at #"),
    ({"type": "object", "if": {"properties": {"a": {"const": 1}}, "minProperties": 1},
      "then": {}}, "the schema at #/if is supported as a type, values, or an object's"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "^x"}},
      "if": {"properties": {"a": {"const": "x"}}}, "then": {}}, "'if' at #: 'not'"),
    ({"type": "object", "properties": {"c": {"const": "US"}}, "required": ["c"],
      "if": {"properties": {"c": {"const": "US"}}}, "then": False},
     "no value meets the schema at # whether or not it meets 'if'"),
    ({"type": "object", "if": 3}, "the schema at #/if is a int"),
    ({"type": "integer", "nullable": 0, "if": {"type": "integer"}}, "'nullable' at # must be"),
])
def test_a_condition_the_compiler_cannot_negate_is_refused(schema, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        schema_to_regex(schema)


def test_a_refusal_inside_a_condition_is_named_by_the_innermost_if_alone():
    inner = {"type": "integer", "if": {"multipleOf": 5}, "then": {"minimum": 2}}
    schema = {"type": "object", "properties": {"a": inner},
              "if": {"properties": {"b": {"const": 1}}}, "then": {}}
    with pytest.raises(ValueError) as refused:
        schema_to_regex(schema)
    assert str(refused.value).startswith("'if' at #/properties/a: 'not' at #/properties/a")


def test_conditions_compile_within_a_budget_not_twice_per_link_of_a_chain():
    """A condition's variants are compiled whole, so a chain of $refs to conditions doubled
    its work at each link (2^30 compiles for this schema): refused past MAX_CONDITIONS; many
    conditions side by side, each compiled once, are not."""
    chain = {"$defs": {f"d{i}": {"if": {"type": "string"}, "then": {"$ref": f"#/$defs/d{i + 1}"},
                                 "else": {"$ref": f"#/$defs/d{i + 1}"}} for i in range(30)},
             "$ref": "#/$defs/d0"}
    chain["$defs"]["d30"] = {"type": ["integer", "string"]}
    # Raised inside 30 conditions, and named by none of them.
    with pytest.raises(ValueError, match="^the schema compiles more than 128 if/then/else"):
        schema_to_regex(chain)
    members = {f"m{i}": {"type": ["integer", "string"], "if": {"type": "string"},
                         "then": {"maxLength": 3}, "else": {"minimum": i}} for i in range(40)}
    matches_exactly({"type": "object", "properties": members, "required": ["m0", "m39"]},
                    [{"m0": "abc", "m39": 39}], [{"m0": "abcd", "m39": 39}, {"m0": 1, "m39": 0}])
