"""guided_json's ``not`` (engine/json_not.py): types or few values left out, folded into
the schema; texts the regex generates are valid (the validator checks ``not``), instances
match and what ``not`` names does not; any other ``not`` is refused by name."""
from __future__ import annotations

import itertools
import json
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
    "nullable_left": ({"type": "integer", "nullable": True, "not": {"type": "integer"}}, [None],
                      [0, 5]),
    # Bounds (engine/json_not_bounds.py): the bound turned over, in its own type.
    "below_a_minimum": ({"not": {"minimum": 18}}, [17, -3, 17.5], [18, 18.0, 19, "x", None,
                                                                 True, [], {}]),
    "integer_below": ({"type": "integer", "not": {"minimum": 18}}, [17, -3, 0], [18, 100]),
    "outside_a_range": ({"type": "integer", "minimum": 10, "not": {"minimum": 15,
                                                                    "maximum": 30}},
                        [10, 14, 31, 400], [15, 22, 30, 9]),
    "exclusive_turned": ({"type": "number", "not": {"exclusiveMinimum": 2,
                                                    "exclusiveMaximum": 4}},
                         [2, 4, 1.5, 4.25, -7], [2.5, 3, 3.999]),
    "draft4_flag": ({"type": "number", "not": {"minimum": 3, "exclusiveMinimum": True}},
                    [3, 2.5, -1], [3.5, 4]),
    "long_strings": ({"type": "string", "not": {"maxLength": 2}}, ["abc", "abcd"],
                     ["", "ab", None]),
    "short_strings": ({"type": "string", "maxLength": 5, "not": {"minLength": 3}},
                      ["", "ab"], ["abc", "abcdef"]),
    "typed_bound": ({"type": ["string", "null"], "not": {"type": "string", "minLength": 1}},
                    ["", None], ["a", "ab"]),
    "items": ({"type": "array", "items": {"type": "integer"}, "not": {"minItems": 2}},
              [[], [1]], [[1, 2], [1, 2, 3]]),
    "few_items": ({"type": "array", "items": {"type": "integer"}, "maxItems": 4,
                   "not": {"maxItems": 1}}, [[1, 2], [1, 2, 3]], [[], [1], [1, 2, 3, 4, 5]]),
    "a_way_left_empty": ({"type": "integer", "minimum": 10, "maximum": 20,
                          "not": {"minimum": 15, "maximum": 30}}, [10, 14], [15, 20, 21]),
    "a_length_way_left_empty": ({"type": "string", "maxLength": 3,
                                 "not": {"minLength": 1, "maxLength": 3}}, [""], ["a", "abcd"]),
    "nullable_bound": ({"type": "integer", "nullable": True, "not": {"minimum": 5}}, [4, -2],
                       [5, None]),
    "nullable_typed_bound": ({"type": "integer", "nullable": True,
                              "not": {"type": "integer", "minimum": 5}}, [4, None], [5, 9]),
}


@pytest.mark.parametrize("name", CASES)
def test_not_leaves_out_what_it_names_and_keeps_the_rest(name):
    schema, good, bad = CASES[name]
    # OpenAPI's nullable takes null whatever else the schema says, in the test's reading;
    # leaving null out is valid in both.
    matches_exactly(schema, good, bad, lambda value: schema.get("nullable") and value is None)


@pytest.mark.parametrize("schema, message", [
    ({"type": "string", "not": {"pattern": "a"}}, "'not' at # is supported for types to leave "
                                                  "out, bounds (minimum, maxLength, minItems"),
    ({"type": "number", "not": {"minimum": 1, "multipleOf": 2}}, "'not' at # is supported"),
    ({"not": {"minimum": "1"}}, "'minimum' at #/not must be a finite number"),
    ({"type": "string", "not": {"minLength": 1.5}}, "'minLength' at #/not must be a "
                                                    "non-negative integer"),
    ({"type": "number", "not": {"type": "integer", "minimum": 3}},
     "'not' at # leaves out integers but not numbers"),
    ({"type": "integer", "minimum": 5, "not": {"minimum": 3}}, "the schema at # leaves no "
                                                               "value"),
    ({"type": "number", "minimum": 5, "not": {"minimum": 3}}, "the schema at # leaves no "
                                                              "value"),
    ({"type": "string", "not": {"minLength": 0}}, "the schema at # leaves no value"),
    ({"type": "string", "not": {"maxLength": 0}, "maxLength": 0}, "the schema at # leaves no "
                                                                  "value"),
    ({"type": "string", "pattern": "^a", "not": {"const": "ab"}}, "'not' at # is supported "
                                                                  "for types"),
    ({"type": "string", "not": {"enum": [str(i) for i in range(65)]}}, "more than 64 strings"),
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


@pytest.mark.parametrize("schema, words, lengths", [
    ({"type": "string", "maxLength": 4, "not": {"enum": ["US", "USA", "", "a]b", "\u00e9", 3]}},
     {"US", "USA", "", "a]b", "\u00e9"}, range(0, 5)),
    ({"minLength": 1, "not": {"const": "-"}}, {"-"}, range(1, 99)),
])
def test_a_free_string_leaves_out_exactly_the_words(schema, words, lengths):
    """Every string of up to 4 characters over the words' alphabet and two more: a word, or
    one of a length not allowed, is taken in no spelling; any other is taken as written
    (drawing texts from this regex, as the cases above do, takes hypothesis ~16 s a text).
    An escape spells a word too."""
    rx = re.compile(schema_to_regex(schema))
    alphabet = "USAa]b\u00e9-x"
    for n in range(5):
        for chars in itertools.product(alphabet, repeat=n):
            text = "".join(chars)
            raw, escaped = json.dumps(text, ensure_ascii=False), json.dumps(text)
            if text not in words and len(text) in lengths:
                assert rx.fullmatch(raw), raw
            else:
                assert not rx.fullmatch(raw) and not rx.fullmatch(escaped), raw
    for word in words:
        spelled = "".join(f"\\u{ord(c):04x}" for c in word)
        assert not rx.fullmatch(f'"{spelled}"'), spelled
