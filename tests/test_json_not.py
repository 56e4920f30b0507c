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
