"""guided_json's member names (engine/json_objects.py): ``propertyNames`` and
``patternProperties``, as pydantic writes them for a ``dict`` keyed by an Enum, a Literal, a
constrained string, a UUID, a date or a pattern. Texts the regex generates are valid under the
schema and taken by the model; an enum's names come at most once, in its order; declared
members are kept or left out by the name rule; a client's pattern checks declared names in
linear time."""
from __future__ import annotations

import datetime
import enum
import json
import re
import uuid
from typing import Annotated, Literal

import pytest

from engine.json_schema_regex import schema_to_regex
from tests.json_format_oracles import model_takes_what_its_regex_generates
from tests.test_json_schema_regex import SPELLINGS, generates_only_valid_texts


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


def _model(key_type, value_type=int):
    pydantic = pytest.importorskip("pydantic")
    return pydantic.create_model("Keyed", counts=(dict[key_type, value_type], ...))


def _keyed_types():
    pydantic = pytest.importorskip("pydantic")
    return [Color, Literal["a", "b", "c"], pydantic.constr(max_length=3), uuid.UUID,
            datetime.date, Annotated[str, pydantic.Field(pattern="^x-[a-z]+$")]]


@pytest.mark.parametrize("index", range(6))
def test_a_pydantic_dict_keyed_by_a_constrained_type_takes_what_the_regex_generates(index):
    model = _model(_keyed_types()[index])
    model_takes_what_its_regex_generates(model, 25)
    rx = generates_only_valid_texts(model.model_json_schema(), 25)
    assert not rx.fullmatch('{"counts": {"\\u0000\\u0000\\u0000\\u0000": 1}}')  # no name


def test_an_enums_names_come_at_most_once_in_its_order():
    schema = _model(Color, bool).model_json_schema()
    rx = re.compile(schema_to_regex(schema))
    good = [{}, {"red": True}, {"green": False, "blue": True},
            {"red": True, "green": True, "blue": False}]
    for counts in good:
        assert all(rx.fullmatch(json.dumps({"counts": counts}, **kw)) for kw in SPELLINGS)
    for text in ['{"counts": {"green": true, "red": true}}',  # out of the enum's order
                 '{"counts": {"red": true, "red": false}}',  # repeated
                 '{"counts": {"RED": true}}', '{"counts": {"purple": true}}']:
        assert not rx.fullmatch(text), text


def test_declared_members_the_name_rule_rules_out_are_left_out():
    schema = {"type": "object", "propertyNames": {"maxLength": 3},
              "properties": {"id": {"type": "integer"}, "label": {"type": "string"},
                             "tag": {"type": "string"}}, "required": ["id"]}
    rx = re.compile(schema_to_regex(schema))
    assert rx.fullmatch('{"id": 1, "tag": "x"}')
    assert not rx.fullmatch('{"id": 1, "label": "x"}')  # five characters: never generated
    schema["required"].append("label")
    with pytest.raises(ValueError, match="names 'label', which 'propertyNames' does not"):
        schema_to_regex(schema)


def test_declared_members_beside_a_pattern_keep_their_own_schema_where_it_does_not_match():
    schema = {"type": "object", "patternProperties": {"^n_": {"type": "integer"}},
              "properties": {"name": {"type": "string"}, "n_a": {"type": "integer"}},
              "required": ["name"]}
    rx = re.compile(schema_to_regex(schema))
    assert rx.fullmatch('{"name": "x", "n_a": 3}')
    assert not rx.fullmatch('{"name": "x", "n_a": "3"}')
    assert not rx.fullmatch('{"name": "x", "n_b": 3}')  # only declared members beside them
    schema["properties"]["n_a"] = {"type": "number"}  # both schemas: not supported
    with pytest.raises(ValueError, match="'n_a' at # is also named by the pattern"):
        schema_to_regex(schema)


def test_a_pattern_map_carries_only_names_the_pattern_matches():
    schema = {"type": "object", "patternProperties": {"^[a-c]+$": {"type": "integer"}},
              "additionalProperties": {"type": "string"}}
    rx = re.compile(schema_to_regex(schema))
    assert rx.fullmatch('{"ab": 1, "c": 2}')
    assert not rx.fullmatch('{"ab": "1"}') and not rx.fullmatch('{"d": "x"}')


def test_a_declared_name_is_checked_in_linear_time_whatever_the_pattern():
    # re.search backtracks through ~10^12 ways to split the a's here; the automaton takes a
    # step per character.
    name = "a" * 60 + "!"
    schema = {"type": "object", "propertyNames": {"pattern": "^(?:a|aa)+$"},
              "properties": {name: {"type": "integer"}, "aaa": {"type": "integer"}}}
    rx = re.compile(schema_to_regex(schema))
    assert rx.fullmatch('{"aaa": 1}') and not rx.fullmatch(f'{{"{name}": 1}}')
