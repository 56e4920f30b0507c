"""Recursive schemas under guided_json (engine/json_schema_regex.py): a $ref inside its own
expansion is followed RECURSION_DEPTH times, so instances nested that deep match, in every
spelling, and one level deeper do not; what the regex matches is valid under the schema
(drawn texts); optional members, items, anyOf branches and nullable values give way at the
cut; a schema with no instance within the depth is refused; pydantic's self-referencing
models accept what their regex generates; the engine's sampled outputs are valid."""
from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.json_schema_regex import RECURSION_DEPTH, schema_to_regex
from engine.regex_dfa import compile_regex
from tests.json_format_oracles import model_takes_what_its_regex_generates
from tests.test_json_schema_regex import SPELLINGS, valid

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
LEVELS = RECURSION_DEPTH + 1  # the outermost and RECURSION_DEPTH more inside it


def _nest(outer, innermost, levels: int):
    value = innermost
    for _ in range(levels - 1):
        value = outer(value)
    return value


# name: (schema, instance nested so many levels deep)
CASES = {
    "linked_list": ({"$defs": {"Node": {"type": "object", "required": ["v"], "properties": {
        "v": {"type": "integer"}, "next": {"$ref": "#/$defs/Node"}}}},
        "$ref": "#/$defs/Node"},
        lambda n: _nest(lambda x: {"v": 1, "next": x}, {"v": 2}, n)),
    "tree_at_the_root": ({"type": "object", "required": ["name", "children"], "properties": {
        "name": {"type": "string", "maxLength": 3},
        "children": {"type": "array", "items": {"$ref": "#"}}}},
        lambda n: _nest(lambda x: {"name": "a", "children": [x, {"name": "b", "children": []}]},
                        {"name": "c", "children": []}, n)),
    "expression": ({"$defs": {"E": {"anyOf": [{"type": "integer"}, {
        "type": "object", "required": ["op", "l", "r"], "properties": {
            "op": {"enum": ["+", "*"]}, "l": {"$ref": "#/$defs/E"}, "r": {"$ref": "#/$defs/E"}}}]}},
        "$ref": "#/$defs/E"},
        lambda n: _nest(lambda x: {"op": "+", "l": x, "r": 7}, 3, n)),
    "nullable_link": ({"$defs": {"N": {"type": "object", "required": ["n"], "properties": {
        "n": {"anyOf": [{"$ref": "#/$defs/N"}, {"type": "null"}]}}}}, "$ref": "#/$defs/N"},
        lambda n: _nest(lambda x: {"n": x}, {"n": None}, n)),
    "openapi_nullable": ({"definitions": {"N": {"type": "object", "required": ["n"],
                                                "properties": {"n": {"$ref": "#/definitions/M"}}},
                                          "M": {"anyOf": [{"$ref": "#/definitions/N"}],
                                                "nullable": True}},
                          "$ref": "#/definitions/N"},
                         lambda n: _nest(lambda x: {"n": x}, {"n": None}, n)),
    "mutual": ({"$defs": {
        "A": {"type": "object", "properties": {"b": {"$ref": "#/$defs/B"}}},
        "B": {"type": "array", "prefixItems": [{"type": "boolean"}, {"$ref": "#/$defs/A"}],
              "minItems": 1, "items": False}}, "$ref": "#/$defs/A"},
        lambda n: _nest(lambda x: {"b": [True, x]}, {}, n)),
    "map": ({"type": "object", "additionalProperties": {"$ref": "#"}},
            lambda n: _nest(lambda x: {"k": x, "j": {}}, {}, n)),
}


@pytest.mark.parametrize("name", CASES)
def test_instances_nest_to_the_depth_and_no_deeper(name):
    schema, make = CASES[name]
    rx = re.compile(schema_to_regex(schema))
    dfa = compile_regex(rx.pattern)
    for levels in range(1, LEVELS + 1):
        value = make(levels)
        assert valid(value, schema, schema)
        for kw in SPELLINGS:
            assert rx.fullmatch(json.dumps(value, **kw)), (levels, value)
        assert dfa.fullmatch(json.dumps(value))
    deeper = make(LEVELS + 1)
    assert valid(deeper, schema, schema)  # valid, and past the depth generated
    assert not rx.fullmatch(json.dumps(deeper)) and not dfa.fullmatch(json.dumps(deeper))


# "map" left out: drawing from its regex (any keys, four levels) takes seconds.
@pytest.mark.parametrize("name", [name for name in CASES if name != "map"])
@settings(SETTINGS, max_examples=20)
@given(data=st.data())
def test_every_text_the_regex_matches_is_valid(name, data):
    schema, _ = CASES[name]
    text = data.draw(st.from_regex(schema_to_regex(schema), fullmatch=True))
    assert valid(json.loads(text), schema, schema), text


class _NoCache(dict):
    def __setitem__(self, key, value):
        pass


INDIRECT = {"$defs": {"N": {"type": "object", "properties": {
    "a": {"$ref": "#/$defs/M"}, "b": {"$ref": "#/$defs/N"}, "d": {"$ref": "#/$defs/D"}}},
    "M": {"type": "object", "properties": {"c": {"$ref": "#/$defs/N"},
                                           "d": {"$ref": "#/$defs/D"}}},
    "D": {"enum": [1, 2]}}, "$ref": "#/$defs/N"}


# X's regex depends on how deep in Y it is met: met first at Y's deepest level, it must not
# be reused at a shallower one.
CROSS = {"$defs": {"Y": {"type": "object", "properties": {
    "y": {"$ref": "#/$defs/Y"}, "x": {"$ref": "#/$defs/X"}}},
    "X": {"type": "object", "properties": {"x": {"$ref": "#/$defs/X"},
                                           "back": {"$ref": "#/$defs/Y"}}}},
    "$ref": "#/$defs/Y"}


@pytest.mark.parametrize("schema", [s for s, _ in CASES.values()] + [INDIRECT, CROSS])
def test_a_ref_is_reused_only_where_it_compiles_the_same(schema):
    # A $ref whose expansion met a recursion depends on where it is met; one that did not
    # is compiled once. Compiled afresh at every use, every regex comes out the same.
    from engine.json_schema_regex import _Compiler
    from engine.json_whitespace import Punctuation

    fresh = _Compiler(schema, Punctuation.around(None))
    fresh.refs = _NoCache()
    assert schema_to_regex(schema) == fresh.node(schema, "#", 0)


def test_a_required_path_back_everywhere_has_no_instance_within_the_depth():
    for schema in [{"$ref": "#"}, {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
                   {"anyOf": [{"$ref": "#/$defs/A"}], "$defs": {"A": {"$ref": "#"}}},
                   {"type": "object", "required": ["a"], "properties": {"a": {"$ref": "#"}}}]:
        with pytest.raises(ValueError, match=f"no instance of it ends within {RECURSION_DEPTH}"):
            schema_to_regex(schema)


def test_a_wide_recursion_stays_within_the_regex_limits():
    # Two recursive members a level: 2^4 innermost copies, each compiled where it is met.
    schema = CASES["expression"][0]
    rx = schema_to_regex(schema)
    assert len(rx) < 5000
    assert compile_regex(rx).fullmatch(json.dumps({"op": "*", "l": {"op": "+", "l": 1, "r": 2},
                                                   "r": {"op": "+", "l": 3, "r": -4}}))


def test_pydantics_self_referencing_models_accept_what_the_regex_generates():
    pydantic = pytest.importorskip("pydantic")
    from typing import Optional

    class Comment(pydantic.BaseModel):
        author: str = pydantic.Field(max_length=4)
        replies: list["Comment"] = pydantic.Field(default_factory=list, max_length=2)
        parent: Optional["Comment"] = None

    rx = model_takes_what_its_regex_generates(Comment, 30)
    thread = Comment(author="a", replies=[Comment(author="b", replies=[Comment(author="c")])])
    assert rx.fullmatch(thread.model_dump_json())
