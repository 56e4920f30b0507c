"""guided_json's allOf of several schemas, and keywords beside $ref, anyOf and oneOf
(engine/json_all_of.py): what the regex generates is valid under every schema joined, and
the instances of all of them match; schemas that exclude each other, and keywords that
cannot be merged exactly, are refused by name."""
from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.json_all_of import MAX_ALTERNATIVES
from engine.json_schema_regex import schema_to_regex
from tests.test_json_schema_regex import (SPELLINGS, bounded_calls, generates_only_valid_texts,
                                          valid)

BASE = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1},
                                         "name": {"type": "string", "maxLength": 8}},
        "required": ["id"]}
SCHEMAS = {
    # OpenAPI's inheritance: a base by $ref, the subtype's own members beside.
    "inherit": {"$defs": {"Base": BASE}, "allOf": [
        {"$ref": "#/$defs/Base"},
        {"type": "object", "properties": {"kind": {"const": "cat"},
                                          "lives": {"type": "integer", "maximum": 9}},
         "required": ["kind"]}]},
    # One of two members required: an anyOf of required sets beside the properties.
    "one_of_two": {"type": "object", "properties": {"email": {"type": "string",
                                                              "format": "email"},
                                                    "phone": {"type": "string",
                                                              "pattern": "^[0-9]{3,6}$"}},
                   "anyOf": [{"required": ["email"]}, {"required": ["phone"]}],
                   "additionalProperties": False},
    "bounds": {"allOf": [{"type": "integer", "minimum": -5, "maximum": 50},
                         {"exclusiveMaximum": 20}, {"minimum": 3}, {"multipleOf": 2}]},
    "multiples": {"allOf": [{"type": "integer", "multipleOf": 4, "minimum": 0, "maximum": 40},
                            {"multipleOf": 6}]},
    "decimal_multiples": {"allOf": [{"type": "number", "multipleOf": 0.25}, {"multipleOf": 0.1},
                                    {"minimum": 0, "maximum": 2}]},
    "types": {"allOf": [{"type": ["number", "string", "null"]},
                        {"type": ["integer", "boolean", "null"], "maximum": 3}]},
    "enums": {"allOf": [{"enum": [1, 2, "a", None, 1.0]}, {"enum": [2, "a", "b", 1]}]},
    "ref_beside": {"$defs": {"Size": {"type": "string", "enum": ["s", "m", "l", "xl"]}},
                   "type": "object", "properties": {"size": {
                       "$ref": "#/$defs/Size", "enum": ["m", "xl", "xxl"]}},
                   "required": ["size"]},
    "closed": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}},
                          "additionalProperties": False},
                         {"properties": {"a": {"minimum": 0}, "b": {"type": "boolean"}}}]},
    "never": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}},
                          "additionalProperties": {"not": {}}},
                         {"properties": {"b": {"type": "boolean"}}}]},
    "maps": {"allOf": [{"type": "object", "additionalProperties": {"type": "integer"}},
                       {"additionalProperties": {"minimum": 0}, "maxProperties": 2}]},
    "items": {"allOf": [{"type": "array", "items": {"type": "integer"}, "maxItems": 4},
                        {"items": {"maximum": 9}, "minItems": 1}]},
    "nested": {"type": "object", "properties": {"p": {"allOf": [
        {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
        {"anyOf": [{"properties": {"y": {"type": "null"}}, "required": ["y"]},
                   {"properties": {"z": {"type": "boolean"}}}]}]}},
        "required": ["p"]},
}


@pytest.mark.parametrize("name", SCHEMAS)
def test_every_text_the_regex_generates_is_valid_under_every_schema_joined(name):
    generates_only_valid_texts(SCHEMAS[name])


MATCHED = {
    "inherit": ([{"id": 1, "kind": "cat"}, {"id": 7, "name": "tom", "kind": "cat", "lives": 9}],
                [{"id": 1}, {"kind": "cat"}, {"id": 0, "kind": "cat"},
                 {"id": 1, "kind": "cat", "lives": 10}]),
    "one_of_two": ([{"email": "a@b.co"}, {"phone": "12345"}, {"email": "a@b.co", "phone": "123"}],
                   [{}, {"phone": "12"}, {"email": "x"}]),
    "bounds": ([4, 6, 18], [2, 5, 20, 22, -4]),
    "multiples": ([0, 12, 24, 36], [4, 6, 18, 48]),
    "decimal_multiples": ([0.5, 1.5, 2.0], [0.25, 0.1, 0.75]),
    "types": ([None, 0, -7, 3], [True, 3.5, "a", 4]),
    "enums": ([1, 2, "a"], [None, "b", 1.5]),
    "ref_beside": ([{"size": "m"}, {"size": "xl"}], [{"size": "s"}, {"size": "xxl"}]),
    "closed": ([{}, {"a": 0}, {"a": 12}], [{"a": -1}, {"b": True}, {"a": 1, "b": False}]),
    "never": ([{}, {"a": 0}], [{"b": True}, {"a": 1, "b": False}]),
    "maps": ([{}, {"a": 0, "b": 7}], [{"a": -1}, {"a": "x"}, {"a": 1, "b": 2, "c": 3}]),
    "items": ([[0], [9, 1, 2, 3]], [[], [10], [1, 2, 3, 4, 5], ["a"]]),
    "nested": ([{"p": {"x": 1, "y": None}}, {"p": {"x": 1}}, {"p": {"x": 1, "z": True}}],
               [{"p": {"y": None}}, {"p": {"x": 1, "y": 2}}]),
}


@pytest.mark.parametrize("name", MATCHED)
def test_instances_of_every_schema_match_and_others_do_not(name):
    schema, (good, bad) = SCHEMAS[name], MATCHED[name]
    rx = re.compile(schema_to_regex(schema))
    for value in good:
        assert valid(value, schema, schema), value
        assert all(rx.fullmatch(json.dumps(value, **kw)) for kw in SPELLINGS), value
    for value in bad:
        assert not rx.fullmatch(json.dumps(value)), value


REFUSED = [
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "the schemas joined at # exclude"),
    ({"allOf": [{"enum": [1, 2]}, {"const": 3}]}, "exclude each other"),
    ({"allOf": [{"properties": {"a": {}}, "additionalProperties": False},
                {"properties": {"b": {}}, "required": ["b"]}]}, "exclude each other"),
    ({"allOf": [{"type": "integer"}, False]}, "exclude each other"),
    ({"allOf": [{"pattern": "a"}, {"pattern": "b"}]},
     "'pattern' has different values in the schemas 'allOf' joins at #"),
    ({"allOf": [{"format": "date"}, {"format": "time"}]}, "'format' has different values"),
    ({"allOf": [{"type": "array", "prefixItems": [{}]}, {"items": {}}]},
     "a tuple ('prefixItems', or an array 'items') beside another array schema"),
    ({"allOf": [{"patternProperties": {"a": {}}}, {"properties": {"b": {}}}]},
     "'patternProperties' beside another object schema"),
    ({"allOf": [{"$ref": "#"}, {"type": "object"}]}, "leads back to itself"),
    ({"allOf": [{"anyOf": [{"type": "integer", "minimum": i} for i in range(9)]}] * 2},
     f"more than {MAX_ALTERNATIVES}"),
    ({"allOf": [{"type": "object"}, {"anyOf": [{"$ref": "#"}, {"type": "null"}]}]},
     f"more than {MAX_ALTERNATIVES} alternatives"),
    ({"allOf": [{"type": "integer"}, 3]}, "the schema at #/allOf/1 is a int"),
    ({"allOf": [{"anyOf": []}, {}]}, "'anyOf' at #/allOf/0 must be a "
                                                     "non-empty array"),
    ({"allOf": [{"$ref": 3}, {}]}, "'$ref' at #/allOf/0 must be a string"),
    ({"allOf": [{"not": {"pattern": "a"}}, {"type": "string"}]}, "'not' at # is supported for"),
    ({"allOf": [{"minLength": 2, "maxLength": 5}, {"maxLength": 1}]}, "'minLength' at # is "
                                                                      "above 'maxLength'"),
]


@pytest.mark.parametrize("schema,message", REFUSED, ids=[m for _, m in REFUSED])
def test_what_cannot_be_joined_exactly_is_refused_by_name(schema, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        schema_to_regex(schema)


def test_nullable_beside_a_joined_schema_is_the_callers():
    schema = {"nullable": True, "allOf": [{"type": "integer"}, {"minimum": 5}]}
    rx = re.compile(schema_to_regex(schema))
    assert rx.fullmatch("null") and rx.fullmatch("5") and not rx.fullmatch("4")
    # Inside, null only where every schema joined takes it.
    inner = {"allOf": [{"type": "integer", "nullable": True}, {"minimum": 5}]}
    assert not re.fullmatch(schema_to_regex(inner), "null")
    both = {"allOf": [{"type": "integer", "nullable": True}, {"minimum": 5, "nullable": True}]}
    assert re.fullmatch(schema_to_regex(both), "null")


def test_a_pydantic_model_inheriting_by_allof_takes_what_the_regex_generates():
    pydantic = pytest.importorskip("pydantic")
    from tests.json_format_oracles import model_takes_what_its_regex_generates

    class Pet(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=10)
        age: int = pydantic.Field(ge=0, le=30)

    # What an OpenAPI generator writes for a subtype: the base by allOf, its own members.
    schema = {"$defs": {"Pet": Pet.model_json_schema()}, "allOf": [
        {"$ref": "#/$defs/Pet"},
        {"type": "object", "properties": {"age": {"maximum": 12}}}]}

    class Kitten(Pet):
        age: int = pydantic.Field(ge=0, le=12)

    rx = re.compile(schema_to_regex(schema))
    assert rx.fullmatch('{"name": "tom", "age": 12}') and not rx.fullmatch(
        '{"name": "tom", "age": 13}')
    model_takes_what_its_regex_generates(Kitten, 5)

    @settings(max_examples=25, deadline=None, derandomize=True)
    @given(text=st.from_regex(rx, fullmatch=True))
    def check(text):
        Kitten.model_validate_json(text)

    check()


def test_a_ref_joined_twice_is_flattened_once(monkeypatch):
    """allOf of two $refs to one schema, 25 links deep: flattening walked 2^25 schemas
    (a thread held for good); a $ref already flattened adds nothing again (A and A is A),
    and one that leads back to itself is still refused."""
    import engine.json_all_of as all_of

    bounded_calls(monkeypatch, all_of, "_flatten")
    chain = {"$defs": {f"d{i}": {"allOf": [{"$ref": f"#/$defs/d{i + 1}"},
                                           {"$ref": f"#/$defs/d{i + 1}", "minimum": i}]}
                       for i in range(25)}, "$ref": "#/$defs/d0"}
    chain["$defs"]["d25"] = {"type": "integer", "maximum": 100}
    assert schema_to_regex(chain) == schema_to_regex({"type": "integer", "minimum": 24,
                                                      "maximum": 100})
    with pytest.raises(ValueError, match="leads back to itself"):
        schema_to_regex({"allOf": [{"$ref": "#"}, {"type": "integer"}]})
