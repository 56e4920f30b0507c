"""guided_json's oneOf (engine/json_one_of.py): compiled as alternatives only where its
schemas are shown to exclude each other, so that every text generated is valid under exactly
one of them (the validator counts); a oneOf whose schemas may overlap is refused, naming the
pair."""
from __future__ import annotations

import json
import re
from typing import Annotated, Literal, Union

import pytest

from engine.json_one_of import MAX_ONE_OF
from engine.json_schema_regex import schema_to_regex
from tests.test_json_schema_regex import bounded_calls, generates_only_valid_texts

CAT = {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer"}},
       "required": ["kind"]}
DOG = {"type": "object", "properties": {"kind": {"enum": ["dog", "puppy"]},
                                        "good": {"type": "boolean"}}, "required": ["kind"]}
EXCLUSIVE = {
    "by_type": {"oneOf": [{"type": "string", "maxLength": 3}, {"type": ["integer", "null"]},
                          {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}]},
    "by_values": {"oneOf": [{"enum": [1, "a", None]}, {"const": 2}, {"enum": [True, "b"]}]},
    "by_tag": {"oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
               "$defs": {"Cat": CAT, "Dog": DOG}},
    "by_required_name": {"oneOf": [
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}]},
    "by_closed_object": {"oneOf": [
        {"type": "object", "properties": {"a": {}}, "required": ["a"],
         "additionalProperties": False},
        {"type": "object", "properties": {"b": {}}, "additionalProperties": False}]},
    "beside_members": {"type": "object", "properties": {"kind": {"type": "string"},
                                                        "n": {"type": "integer"}},
                       "required": ["n"],
                       "oneOf": [{"properties": {"kind": {"const": "x"}}, "required": ["kind"]},
                                 {"properties": {"kind": {"const": "y"}}, "required": ["kind"]}]},
}


@pytest.mark.parametrize("name", EXCLUSIVE)
def test_every_text_is_valid_under_exactly_one_schema(name):
    generates_only_valid_texts(EXCLUSIVE[name])  # the validator's oneOf counts: exactly one


OVERLAPPING = [
    {"oneOf": [{"type": "integer"}, {"type": "number"}]},  # 1 is both
    {"oneOf": [{"type": "string"}, {"minLength": 2}]},  # any string is valid under the second
    {"oneOf": [{"enum": [1, 2]}, {"enum": [2.0, 3]}]},
    {"oneOf": [{"type": "object", "properties": {"a": {}}},
               {"type": "object", "properties": {"b": {}}}]},  # {} is both
    {"oneOf": [CAT, {"type": "object", "properties": {"kind": {"enum": ["dog", "cat"]}}}]},
    {"oneOf": [{"type": "object"}, {"type": "object", "required": ["a"]}]},  # maps: any name
    {"type": "object", "properties": {"a": {}, "b": {}},
     "oneOf": [{"required": ["a"]}, {"required": ["b"]}]},  # both members may be present
    {"oneOf": [{"type": "string"}, {"anyOf": [{"type": "integer"}, {"maxLength": 1}]}]},
]


@pytest.mark.parametrize("schema", OVERLAPPING)
def test_a_one_of_whose_schemas_may_overlap_is_refused(schema):
    with pytest.raises(ValueError, match=r"'oneOf' at #: a value valid under its schema \d may "
                                         r"be valid under its schema \d too"):
        schema_to_regex(schema)


def test_a_one_of_is_refused_past_its_size_limit():
    schema = {"oneOf": [{"const": i} for i in range(MAX_ONE_OF + 1)]}
    with pytest.raises(ValueError, match=f"at most {MAX_ONE_OF} are supported"):
        schema_to_regex(schema)
    assert re.fullmatch(schema_to_regex({"oneOf": schema["oneOf"][:-1]}), str(MAX_ONE_OF - 1))


def test_a_pydantic_discriminated_union_takes_what_the_regex_generates():
    pydantic = pytest.importorskip("pydantic")
    from tests.json_format_oracles import model_takes_what_its_regex_generates

    class Circle(pydantic.BaseModel):
        shape: Literal["circle"]
        radius: float = pydantic.Field(gt=0, le=10)

    class Square(pydantic.BaseModel):
        shape: Literal["square"]
        side: int = pydantic.Field(ge=1, le=9)

    class Drawing(pydantic.BaseModel):
        parts: list[Annotated[Union[Circle, Square], pydantic.Field(discriminator="shape")]]

    assert "oneOf" in json.dumps(Drawing.model_json_schema())
    rx = model_takes_what_its_regex_generates(Drawing, 30)
    assert rx.fullmatch('{"parts": [{"shape": "square", "side": 3}]}')
    assert not rx.fullmatch('{"parts": [{"shape": "square", "radius": 3}]}')


MAP = {"type": "object", "additionalProperties": {"type": "string"}}
CLOSED = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"],
          "additionalProperties": False}
PAIRS = [  # (a, b, whether no text generated for a is valid under b): each way on its own
    ({"type": "integer"}, {"type": "number"}, False),
    ({"type": "number"}, {"type": "integer"}, False),
    ({"type": "integer"}, {"type": "string"}, True),
    ({"type": "string"}, {"minimum": 1}, False),  # minimum leaves strings alone
    ({"minimum": 1}, {"type": "string"}, True),  # generated as an integer
    ({"type": "string", "nullable": True}, {"type": "null"}, False),
    ({"type": "null"}, {"type": "string", "nullable": True}, False),
    ({"enum": ["a", 1]}, {"type": "string"}, False),
    ({"enum": [1, 2]}, {"type": "string"}, True),
    ({"maxLength": 2, "not": {"type": "string"}}, {"type": "null"}, False),  # all but strings
    (MAP, CLOSED, False),  # a map may write {"a": "x"}
    (CLOSED, MAP, False),
    ({"type": "object", "properties": {"b": {}}}, CLOSED, True),  # never writes "a"
    (CLOSED, {"type": "object", "properties": {"b": {}}, "additionalProperties": False}, True),
    (CAT, DOG, True),
    (DOG, CAT, True),
    ({"anyOf": [{"type": "string"}, {"type": "null"}]}, {"type": "null"}, False),
    ({"allOf": [{"type": ["string", "null"]}, {"type": "string"}]}, {"type": "null"}, True),
]


@pytest.mark.parametrize("a,b,excludes", PAIRS)
def test_each_way_of_a_pair_is_told_on_its_own(a, b, excludes):
    from engine.json_one_of import _excludes
    from engine.json_schema_regex import _Compiler
    from engine.json_whitespace import Punctuation

    assert _excludes(_Compiler({}, Punctuation.around(None)), a, b, "#") is excludes


def test_the_kinds_of_a_ref_are_found_once_however_often_it_is_met(monkeypatch):
    """Two branches of {"$ref": "#"} beside each other: the exclusivity check walked 2^depth
    schemas (minutes for this 100-byte schema); now each $ref's kinds once per compile."""
    import engine.json_one_of as one_of

    calls = bounded_calls(monkeypatch, one_of, "_generated")
    chain = {"$defs": {f"d{i}": {"oneOf": [{"$ref": f"#/$defs/d{i + 1}"},
                                           {"$ref": f"#/$defs/d{i + 1}", "nullable": True}]}
                       for i in range(40)}, "$ref": "#/$defs/d0"}
    chain["$defs"]["d40"] = {"type": "integer"}
    for schema in ({"oneOf": [{"$ref": "#", "nullable": True}, {"$ref": "#", "nullable": True}],
                    "nullable": True}, chain):
        calls.clear()
        with pytest.raises(ValueError, match="may be valid under its schema 1 too"):
            schema_to_regex(schema)
