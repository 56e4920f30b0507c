"""guided_json's regex (engine/json_schema_regex.py): instances drawn from each schema match
it as json.dumps writes them (default and compact separators, with and without
ensure_ascii); what it matches parses and validates under the small validator below
(strings drawn from the regex itself, and JSON values of every shape); mutated instances
don't match; integer ranges are exact number by number; the regex keeps to the syntax the
automaton compiler takes; and what is not supported is refused by name and place."""
from __future__ import annotations

import functools
import json
import math
import operator
import random
import re
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.json_schema_regex import ANY_DEPTH, MAX_REGEX_CHARS, schema_to_regex
from engine.json_whitespace import check_whitespace_pattern
from engine.regex_text import MAX_REPEAT
from tests.json_format_oracles import FORMAT_TEXTS, format_ok

SETTINGS = settings(max_examples=30, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SPELLINGS = [dict(), dict(separators=(",", ":")), dict(ensure_ascii=False),
             dict(separators=(",", ":"), ensure_ascii=False)]

ADDRESS = {"title": "Address", "type": "object", "properties": {
    "street": {"title": "Street", "type": "string", "maxLength": 12},
    "zip": {"title": "Zip", "type": "string", "minLength": 5, "maxLength": 5},
    "country": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None}},
    "required": ["street", "zip"]}
# As pydantic's model_json_schema() writes a model with a nested model, an enum, Optional
# fields and a tuple.
USER = {
    "$defs": {"Address": ADDRESS,
              "Role": {"enum": ["admin", "user", "guest"], "title": "Role", "type": "string"}},
    "title": "User", "type": "object", "description": "A user.",
    "properties": {
        "id": {"title": "Id", "type": "integer", "minimum": 1},
        "name": {"title": "Name", "type": "string", "minLength": 1, "maxLength": 20},
        "role": {"$ref": "#/$defs/Role", "default": "user"},
        "age": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 150}, {"type": "null"}],
                "default": None, "title": "Age"},
        "addresses": {"items": {"$ref": "#/$defs/Address"}, "maxItems": 3, "title": "Addresses",
                      "type": "array"},
        "home": {"anyOf": [{"$ref": "#/$defs/Address"}, {"type": "null"}], "default": None},
        "point": {"maxItems": 2, "minItems": 2, "prefixItems": [{"type": "number"},
                                                                {"type": "number"}],
                  "type": "array", "title": "Point"},
        "tags": {"additionalProperties": {"type": "integer"}, "type": "object"},
    },
    "required": ["id", "name", "addresses"], "additionalProperties": False,
}
PET = {"oneOf": [{"$ref": "#/definitions/Cat"}, {"$ref": "#/definitions/Dog"}],
       "discriminator": {"propertyName": "kind"},
       "definitions": {
           "Cat": {"type": "object", "properties": {"kind": {"const": "cat", "type": "string"},
                                                    "lives": {"type": "integer", "minimum": 0,
                                                              "maximum": 9}},
                   "required": ["kind", "lives"]},
           "Dog": {"type": "object", "properties": {"kind": {"const": "dog"},
                                                    "good": {"type": "boolean"}},
                   "required": ["kind"]}}}


def _props(required: str) -> dict:
    """Five properties a..e, the upper-case ones of ``required`` required."""
    return {"type": "object", "additionalProperties": False,
            "properties": {c: {"type": "integer"} if c in "ace" else {"type": "string",
                                                                       "maxLength": 2}
                           for c in "abcde"},
            "required": [c.lower() for c in required if c.isupper()]}


SCHEMAS = {
    "user": USER,
    "pet": PET,
    "scalars": {"type": "object", "additionalProperties": False, "properties": {
        "n": {"type": "null"}, "b": {"type": "boolean"}, "i": {"type": "integer"},
        "x": {"type": "number"}, "s": {"type": "string"}}, "required": ["n", "b", "i", "x", "s"]},
    "ranges": {"type": "array", "prefixItems": [
        {"type": "integer", "minimum": -50, "maximum": 50},
        {"type": "integer", "exclusiveMinimum": -7, "exclusiveMaximum": 3},
        {"type": "integer", "minimum": 1000},
        {"type": "integer", "maximum": -1000},
        {"type": "integer", "minimum": 2.5, "maximum": 1e3},
        {"type": "integer", "exclusiveMinimum": 0, "maximum": 12345678901234567890},
        {"type": "integer", "minimum": -99999, "exclusiveMaximum": -98}],
        "minItems": 7, "items": False},
    "strings": {"type": "object", "properties": {
        "short": {"type": "string", "maxLength": 3},
        "long": {"type": "string", "minLength": 4, "maxLength": 8},
        "date": {"type": "string", "format": "date"},
        "time": {"type": "string", "format": "time"},
        "stamp": {"type": "string", "format": "date-time"},
        "id": {"type": "string", "format": "uuid"}}, "required": ["short", "date", "id"]},
    "formats": {"type": "object", "properties": {
        "v4": {"type": "string", "format": "ipv4"},
        "v6": {"type": "string", "format": "ipv6"},
        "host": {"type": "string", "format": "hostname"},
        "mail": {"type": "string", "format": "email"},
        "url": {"type": "string", "format": "uri", "minLength": 1, "maxLength": 2083},
        "took": {"type": "string", "format": "duration"},
        "day": {"type": "string", "format": "date", "maxLength": 10}},
        "required": ["v4", "v6", "host", "mail", "url", "took"]},
    "none_required": _props(""),
    "first_required": _props("Abcde"),
    "last_required": _props("abcdE"),
    "middle_required": _props("abCde"),
    "alternate": _props("aBcDe"),
    "all_required": _props("ABCDE"),
    "enum_mixed": {"enum": [1, "two", 3.5, None, True, [1, "x"], {"k": "v", "n": [None]},
                            "\u00e9\u4e2d\U0001F600 \"q\"\\", -0.25, 1e100]},
    "const": {"const": {"a": [1, {"b": None}], "c": "d"}},
    "typed_enum": {"type": ["integer", "null"], "enum": [1, "1", None, False, 2.0]},
    "arrays": {"type": "object", "properties": {
        "tuple": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "boolean"}],
                  "items": {"type": "integer"}, "minItems": 1, "maxItems": 4},
        "open_tuple": {"type": "array", "prefixItems": [{"type": "null"}]},
        "short_prefix": {"type": "array", "prefixItems": [{"type": "integer"}] * 3,
                         "maxItems": 2},
        "bounded": {"type": "array", "items": {"type": "boolean"}, "minItems": 2,
                    "maxItems": 3},
        "nested": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
        "none": {"type": "array", "items": False}}},
    "any": {},
    "true": True,
    "any_array": {"type": "array"},
    "any_object": {"type": "object"},
    "map_of_any": {"type": "object", "additionalProperties": True},
    "unique": {"type": "array", "items": {"enum": ["a", 2, None, [1], {"k": True}]},
               "uniqueItems": True, "minItems": 1},
    "counted_map": {"type": "object", "additionalProperties": {"type": "boolean"},
                    "minProperties": 1, "maxProperties": 2},
    "enum_keys": {"type": "object", "additionalProperties": {"type": "integer"},
                  "propertyNames": {"$ref": "#/$defs/Color"},
                  "$defs": {"Color": {"enum": ["red", "green", "blue\u00e9"], "type": "string"}}},
    "literal_keys": {"type": "object", "additionalProperties": {"type": "boolean"},
                     "propertyNames": {"enum": ["a", 1, "b", "a"]}, "minProperties": 1},
    "short_keys": {"type": "object", "additionalProperties": {"type": "null"},
                   "propertyNames": {"maxLength": 2}, "maxProperties": 3},
    "date_keys": {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0},
                  "propertyNames": {"type": "string", "format": "date"}},
    "pattern_keys": {"type": "object", "patternProperties": {"^x-[a-z]{1,3}$": {
        "type": "string", "maxLength": 2}}, "additionalProperties": False},
    "declared_names": {"type": "object", "properties": {
        "ab": {"type": "integer"}, "b": {"type": "boolean"}, "abc": {"type": "null"}},
        "required": ["ab"], "propertyNames": {"pattern": "^a"}},
    "declared_patterns": {"type": "object", "properties": {
        "x-a": {"type": "string"}, "y": {"type": "integer"}}, "required": ["x-a", "y"],
        "patternProperties": {"^x-": {"type": "string"}}},
    # zod-to-json-schema's references to a schema's first use, by its path.
    "pointer_refs": {"type": "object", "properties": {
        "home": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5}},
                 "required": ["city"], "additionalProperties": False},
        "work": {"$ref": "#/properties/home"},
        "pair": {"type": "array", "items": [{"type": "integer", "minimum": 0},
                                            {"$ref": "#/properties/pair/items/0"}],
                 "minItems": 2, "additionalItems": False},
        "a~/b": {"type": "boolean"}, "c": {"$ref": "#/properties/a~0~1b"}},
        "required": ["home", "work", "pair", "c"], "additionalProperties": False},
    "annotated": {"type": "object", "description": "x", "example": {"b": "QQ=="},
                  "externalDocs": {"url": "https://example.com"}, "xml": {"name": "a"},
                  "properties": {"b": {"type": "string", "contentEncoding": "base64",
                                       "contentMediaType": "image/png", "maxLength": 4,
                                       "$anchor": "b", "contentSchema": {"type": "null"}}}},
    # Members that may not be there: false, or zod's never (not {}).
    "never_members": {"type": "object", "properties": {
        "a": {"not": {}}, "b": False, "c": {"type": "integer"}, "d": {"not": True}},
        "additionalProperties": {"not": {"description": "none"}}},
    "never_map": {"type": "object", "additionalProperties": {"not": {}}},
    "draft4_bounds": {"type": "object", "properties": {
        "i": {"type": "integer", "minimum": 0, "exclusiveMinimum": True, "maximum": 10,
              "exclusiveMaximum": False},
        "x": {"type": "number", "minimum": -1, "maximum": 2.5, "exclusiveMaximum": True},
        "j": {"type": "integer", "exclusiveMinimum": False, "maximum": -3,
              "exclusiveMaximum": True}}, "required": ["i", "x", "j"]},
    "draft7_tuples": {"type": "object", "properties": {
        "open": {"type": "array", "items": [{"type": "string"}, {"type": "integer"}],
                 "additionalItems": {"type": "boolean"}, "maxItems": 4},
        "closed": {"type": "array", "items": [{"type": "null"}, {"type": "boolean"}],
                   "additionalItems": False, "minItems": 1}}, "required": ["open", "closed"]},
    "nullable": {"type": "object", "properties": {
        "s": {"type": "string", "nullable": True, "maxLength": 1},
        "e": {"enum": ["a"], "nullable": True}}, "required": ["s", "e"]},
    "type_list": {"type": ["string", "integer", "null"], "maxLength": 2, "minimum": 0},
    "all_of": {"allOf": [{"$ref": "#/$defs/A"}], "$defs": {"A": {"type": "boolean"}}},
    "no_type": {"properties": {"a": {"minLength": 1},
                               "b": {"items": {"type": "boolean"}, "maxItems": 1}}},
}


# --- a validator for the supported subset, by the spec (draft 2020-12) ---

def _same(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _multiple(x, m) -> bool:
    """Exactly, on the numbers' decimal texts (0.3 is a multiple of 0.1 though 0.3 / 0.1 is
    2.9999999999999996 in floats)."""
    if not math.isfinite(x):
        return False
    return (Fraction(repr(x)) / Fraction(repr(m))).denominator == 1


def _is_type(x, t: str) -> bool:
    number = isinstance(x, (int, float)) and not isinstance(x, bool)
    return {"null": x is None, "boolean": isinstance(x, bool), "number": number,
            "integer": number and float(x).is_integer(), "string": isinstance(x, str),
            "array": isinstance(x, list), "object": isinstance(x, dict)}[t]


def _target(ref: str, root):
    found = root
    for key in ref.split("/")[1:]:
        key = key.replace("~1", "/").replace("~0", "~")
        found = found[int(key)] if isinstance(found, list) else found[key]
    return found


def valid(x, s, root) -> bool:
    if isinstance(s, bool):
        return s
    if s.get("nullable") and x is None:  # OpenAPI's: null besides, wherever it stands
        return True
    if "$ref" in s and not valid(x, _target(s["$ref"], root), root):
        return False
    if "not" in s and valid(x, s["not"], root):
        return False
    if "allOf" in s and not all(valid(x, b, root) for b in s["allOf"]):
        return False
    if "if" in s and not valid(x, s.get("then", True) if valid(x, s["if"], root)
                               else s.get("else", True), root):
        return False
    if "anyOf" in s and not any(valid(x, b, root) for b in s["anyOf"]):
        return False
    if "oneOf" in s and sum(valid(x, b, root) for b in s["oneOf"]) != 1:
        return False
    if "enum" in s and not any(_same(x, v) for v in s["enum"]):
        return False
    if "const" in s and not _same(x, s["const"]):
        return False
    types = s.get("type", [])
    if types and not any(_is_type(x, t) for t in ([types] if isinstance(types, str) else types)):
        return False
    if isinstance(x, str):
        return s.get("minLength", 0) <= len(x) <= s.get("maxLength", math.inf) and \
            ("format" not in s or format_ok(s["format"], x)) and \
            ("pattern" not in s or re.search(_python_pattern(s["pattern"]), x) is not None)
    if _is_type(x, "number"):
        s = _draft4_bounds(s)
        # Not a chain through infinities: 1E400 is a JSON number Python reads as inf.
        return all(kw not in s or op(x, s[kw]) for kw, op in (
            ("minimum", operator.ge), ("maximum", operator.le),
            ("exclusiveMinimum", operator.gt), ("exclusiveMaximum", operator.lt))) and \
            ("multipleOf" not in s or _multiple(x, s["multipleOf"]))
    if isinstance(x, list):
        prefix, items = s.get("prefixItems", []), s.get("items", True)
        if isinstance(items, list):  # draft 7's tuple
            prefix, items = items, s.get("additionalItems", True)
        if s.get("uniqueItems") and any(_same(a, b) for i, a in enumerate(x) for b in x[:i]):
            return False
        if "contains" in s:
            found = sum(valid(v, s["contains"], root) for v in x)
            if not s.get("minContains", 1) <= found <= s.get("maxContains", math.inf):
                return False
        return s.get("minItems", 0) <= len(x) <= s.get("maxItems", math.inf) and \
            all(valid(v, prefix[i] if i < len(prefix) else items, root) for i, v in enumerate(x))
    if isinstance(x, dict):
        props, extra = s.get("properties", {}), s.get("additionalProperties", True)
        if not s.get("minProperties", 0) <= len(x) <= s.get("maxProperties", math.inf):
            return False
        if not all(valid(k, s.get("propertyNames", True), root) for k in x):
            return False
        for kw in ("dependentRequired", "dependentSchemas", "dependencies"):
            for name, needs in s.get(kw, {}).items():
                if name in x and not (all(n in x for n in needs) if isinstance(needs, list)
                                      else valid(x, needs, root)):
                    return False
        for k, v in x.items():
            named = [sub for pattern, sub in s.get("patternProperties", {}).items()
                     if re.search(_python_pattern(pattern), k)]
            if not all(valid(v, sub, root) for sub in named):
                return False
            if not valid(v, props[k] if k in props else True if named else extra, root):
                return False
        return all(k in x for k in s.get("required", []))
    return True


def generates_only_valid_texts(schema, examples: int = 40) -> re.Pattern:
    """Draws ``examples`` texts from ``schema``'s regex and checks each is a valid instance
    under the validator above; returns the compiled regex."""
    rx = re.compile(schema_to_regex(schema))

    @settings(max_examples=examples, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(text=st.from_regex(rx, fullmatch=True))
    def check(text):
        assert valid(json.loads(text), schema, schema), text

    check()
    return rx


def bounded_calls(monkeypatch, module, name: str, limit: int = 500) -> list:
    """Counts the calls of ``module.name`` into the returned list, failing the limit-th: a
    compile that walks a schema again and again fails at once instead of running for hours."""
    calls: list = []
    real = getattr(module, name)

    def counted(*args):
        calls.append(1)
        assert len(calls) < limit, f"{name} called {limit} times: a walk repeats itself"
        return real(*args)
    monkeypatch.setattr(module, name, counted)
    return calls


def matches_exactly(schema, good: list, bad: list, valid_bad=lambda value: False,
                    draw: bool = True) -> None:
    """The ``good`` values are valid and ``schema``'s regex takes them in every spelling;
    the ``bad`` ones are invalid (unless ``valid_bad``) and it takes them in none; and what
    it generates is valid (unless not ``draw``)."""
    rx = generates_only_valid_texts(schema) if draw else re.compile(schema_to_regex(schema))
    for value in good:
        assert valid(value, schema, schema), value
        assert all(rx.fullmatch(json.dumps(value, **kw)) for kw in SPELLINGS), value
    for value in bad:
        assert valid_bad(value) or not valid(value, schema, schema), value
        assert not any(rx.fullmatch(json.dumps(value, **kw)) for kw in SPELLINGS), value


# --- instances drawn from a schema ---

_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(),
                     st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=6))


@functools.cache
def json_values(depth: int = ANY_DEPTH):
    if not depth:
        return _SCALARS
    inner = json_values(depth - 1)
    return st.one_of(_SCALARS, st.lists(inner, max_size=3),
                     st.dictionaries(st.text(max_size=4), inner, max_size=3))


def _python_pattern(pattern: str) -> str:
    """A schema's pattern for re.search: JSON Schema's trailing $ is the end of the string
    (re's also matches before a final newline)."""
    return re.sub(r"(?<!\\)\$$", r"\\Z", pattern)


def _draft4_bounds(s: dict) -> dict:
    """``s`` with draft 4's boolean exclusiveMinimum/Maximum as draft 2020-12's numbers."""
    s = dict(s)
    for flag, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(s.get(flag), bool):
            if s.pop(flag) and bound in s:
                s[flag] = s.pop(bound)
    return s


def _int_limits(s):
    s = _draft4_bounds(s)
    lo, hi = s.get("minimum"), s.get("maximum")
    lo = None if lo is None else math.ceil(lo)
    hi = None if hi is None else math.floor(hi)
    if "exclusiveMinimum" in s:
        lo = math.floor(s["exclusiveMinimum"]) + 1
    if "exclusiveMaximum" in s:
        hi = math.ceil(s["exclusiveMaximum"]) - 1
    return lo, hi


def instances(s, root):
    if s is True or not s.keys() - {"title", "description", "default"}:
        return json_values()
    if "$ref" in s:
        return instances(_target(s["$ref"], root), root)
    for kw in ("anyOf", "oneOf", "allOf"):
        if kw in s:
            return st.one_of([instances(b, root) for b in s[kw]])
    if "enum" in s or "const" in s:
        values = s["enum"] if "enum" in s else [s["const"]]
        values = [v for v in values if valid(v, {"type": s["type"]} if "type" in s else {}, root)]
        base = st.sampled_from(values)
    else:
        inferred = {"minLength": "string", "properties": "object", "maxItems": "array"}
        types = s.get("type") or [t for kw, t in inferred.items() if kw in s]
        types = [types] if isinstance(types, str) else types
        base = st.one_of([_typed(t, s, root) for t in types])
    return st.one_of(st.none(), base) if s.get("nullable") else base


def _typed(t, s, root):
    if t == "null":
        return st.none()
    if t == "boolean":
        return st.booleans()
    if t == "integer":
        return st.integers(*_int_limits(s))
    if t == "number":
        if any(kw in s for kw in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")):
            # Hundredths within the bounds: json.dumps writes them without an exponent, the
            # only spelling a bounded number's regex has.
            lo, hi = _int_limits({k: v * 100 for k, v in s.items() if "imum" in k})
            lo = -10 ** 6 if lo is None else lo
            return st.integers(lo, lo + 10 ** 6 if hi is None else hi).map(lambda n: n / 100)
        return st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    if t == "string":
        if "format" in s:
            return FORMAT_TEXTS[s["format"]]
        if "pattern" in s:
            return st.from_regex(_python_pattern(s["pattern"]))
        return st.text(min_size=s.get("minLength", 0), max_size=s.get("maxLength"))
    if t == "array":
        prefix, items = s.get("prefixItems", []), s.get("items", True)
        if isinstance(items, list):
            prefix, items = items, s.get("additionalItems", True)
        if s.get("uniqueItems"):  # the enum's values, some of them, in the enum's order
            values = items["enum"]
            return st.lists(st.booleans(), min_size=len(values), max_size=len(values)).map(
                lambda keep: [v for v, k in zip(values, keep) if k]).filter(
                lambda x: len(x) >= s.get("minItems", 0))
        lo = s.get("minItems", 0)
        hi = min(s.get("maxItems", lo + 4), lo + 4, len(prefix) if items is False else math.inf)
        return st.integers(lo, hi).flatmap(lambda n: st.tuples(*[
            instances(prefix[i] if i < len(prefix) else items, root) for i in range(n)
        ]).map(list))
    props, names = s.get("properties", {}), s.get("propertyNames", {})
    props = {k: v for k, v in props.items() if v is not False and "not" not in v}
    if not props:
        keys, extra = st.text(max_size=4), s.get("additionalProperties", True)
        if isinstance(extra, dict) and "not" in extra:  # no member may be there
            return st.just({})
        if "patternProperties" in s:  # the one pattern's names, valued by its schema
            (pattern, extra), = s["patternProperties"].items()
            keys = st.from_regex(_python_pattern(pattern))
        elif "$ref" in names or "enum" in names:  # an enum's names, some, in its order
            listed = _target(names["$ref"], root)["enum"] if "$ref" in names else names["enum"]
            listed = list(dict.fromkeys(k for k in listed if isinstance(k, str)))
            return st.tuples(*[st.tuples(st.booleans(), instances(extra, root))
                               for _ in listed]).map(
                lambda kept: {k: v for k, (keep, v) in zip(listed, kept) if keep}).filter(
                lambda x: len(x) >= s.get("minProperties", 0))
        elif names:
            keys = _typed("string", names, root)
        return st.dictionaries(keys, instances(extra, root), min_size=s.get("minProperties", 0),
                               max_size=min(3, s.get("maxProperties", 3)))
    required = s.get("required", [])
    return st.tuples(*[st.tuples(st.just(k), st.booleans() if k not in required else st.just(True),
                                 instances(sub, root)) for k, sub in props.items()]).map(
        lambda members: {k: v for k, keep, v in members if keep}).filter(
        lambda x: valid(x, s, root))  # propertyNames may leave declared names out


@functools.cache
def regex(name: str) -> re.Pattern:
    return re.compile(schema_to_regex(SCHEMAS[name]))


@functools.cache
def regex_texts(name: str):
    """The texts the regex matches (a strategy: built once, as building one takes a while)."""
    return st.from_regex(regex(name), fullmatch=True)


def _matches(rx: re.Pattern, value) -> list[bool]:
    return [bool(rx.fullmatch(json.dumps(value, **kw))) for kw in SPELLINGS]


# --- instances match ---

@pytest.mark.parametrize("name", SCHEMAS)
@SETTINGS
@given(data=st.data())
def test_every_drawn_instance_matches_in_every_spelling(name, data):
    schema = SCHEMAS[name]
    value = data.draw(instances(schema, schema))
    assert valid(value, schema, schema)  # the strategies draw what the validator accepts
    assert _matches(regex(name), value) == [True] * 4, json.dumps(value)


# --- what matches is valid ---

# Regexes with values of any type are slow to draw from: those whose every text is valid
# once it is JSON of the right shape are left to "any" ("true" has the same regex).
@pytest.mark.parametrize("name", [n for n in SCHEMAS if n not in {"true", "any_array",
                                                                  "any_object", "map_of_any"}])
@settings(SETTINGS, max_examples=15)
@given(data=st.data())
def test_every_text_the_regex_matches_is_a_valid_instance(name, data):
    schema = SCHEMAS[name]
    text = data.draw(regex_texts(name))
    assert valid(json.loads(text), schema, schema), text


@settings(max_examples=120, deadline=None, derandomize=True)
@given(value=json_values())
def test_a_json_value_of_any_shape_matches_only_where_it_is_valid(value):
    for name, schema in SCHEMAS.items():
        if any(_matches(regex(name), value)):
            assert valid(value, schema, schema), (name, value)


# --- what is invalid does not match ---

ORDER = {"type": "object", "additionalProperties": False, "properties": {
    "id": {"type": "integer", "minimum": 1, "maximum": 999},
    "code": {"type": "string", "minLength": 2, "maxLength": 4},
    "status": {"enum": ["new", "paid", 3]},
    "note": {"type": "string"},
    "lines": {"type": "array", "items": {"type": "integer", "exclusiveMinimum": -3,
                                         "exclusiveMaximum": 3}, "maxItems": 3},
    "when": {"type": "string", "format": "date"}}, "required": ["id", "code", "status", "lines"]}


def _mutations(order: dict) -> list[tuple[str, object]]:
    def change(**kw):
        return {**order, **kw}

    without = [{k: v for k, v in order.items() if k != r} for r in ORDER["required"]]
    return [
        ("wrong type", list(order.values())), ("wrong type", json.dumps(order)),
        ("wrong type", None), ("wrong type", change(id=str(order["id"]))),
        ("wrong type", change(id=order["id"] + 0.5)), ("wrong type", change(note=5)),
        ("wrong type", change(lines="[]")), ("wrong type", change(lines=[*order["lines"], "1"])),
        *[("missing required", m) for m in without],
        ("extra property", change(extra=1)), ("extra property", {"x": None, **order}),
        ("out of range", change(id=0)), ("out of range", change(id=1000)),
        ("out of range", change(id=-order["id"])), ("out of range", change(lines=[3])),
        ("out of range", change(lines=[0, -3])), ("too many", change(lines=[0, 1, 2, -1])),
        ("too long", change(code="abcde")), ("too short", change(code="a")),
        ("wrong enum", change(status="old")), ("wrong enum", change(status=4)),
        ("wrong enum", change(status=None)), ("wrong enum", change(status="NEW")),
        ("bad date", change(when="2023-02-29")), ("bad date", change(when="2024-13-01")),
    ]


@SETTINGS
@given(order=instances(ORDER, ORDER))
def test_mutated_instances_do_not_match(order):
    rx = re.compile(schema_to_regex(ORDER))
    assert _matches(rx, order) == [True] * 4
    for what, bad in _mutations(order):
        assert not valid(bad, ORDER, ORDER), what
        assert _matches(rx, bad) == [False] * 4, (what, bad)


def test_the_whitespace_is_one_optional_space_after_each_comma_and_colon():
    rx = re.compile(schema_to_regex({"type": "object", "properties": {
        "a": {"type": "array"}, "b": {"type": "object"}}}))
    for text in ['{"a": [1, 2], "b": {"c": {}}}', '{"a":[1,2],"b":{"c":{}}}',
                 '{"a": [1,2], "b":{"c": []}}', "{}", '{"b": {}}']:
        assert rx.fullmatch(text), text
    for text in ['{"a" : []}', '{ "a": []}', '{"a": [] }', '{"a":  []}', '{"a": [ ]}',
                 '{"a": []} ', ' {"a": []}', '{"a":\n[]}', '{"a":\t[]}', '{"a": [1 ,2]}',
                 '{"b": { }}', '{"b": [], "a": []}', '{"a": [1,  2]}']:
        assert not rx.fullmatch(text), text


@pytest.mark.parametrize("schema,good,bad", [
    ({"type": "object", "minProperties": 1, "additionalProperties": {"type": "integer"}},
     ['{"a": 1}', '{"a": 1, "b": 2}'], ["{}", '{"a": "x"}']),
    ({"type": "object", "maxProperties": 2}, ["{}", '{"a": 1, "b": [2]}'],
     ['{"a": 1, "b": 2, "c": 3}']),
    ({"type": "object", "minProperties": 1, "maxProperties": 1}, ['{"x": null}'],
     ["{}", '{"a": 1, "b": 2}']),
    ({"type": "object", "maxProperties": 0}, ["{}"], ['{"a": 1}']),
    # Declared members: bounds the required ones meet, or at least one where none is.
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "null"}},
      "minProperties": 1, "maxProperties": 2}, ['{"a": 1}', '{"b": null}', '{"a": 1, "b": null}'],
     ["{}"]),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
      "minProperties": 1}, ['{"a": 1}'], ["{}"]),
])
def test_property_counts_bound_the_members(schema, good, bad):
    rx = re.compile(schema_to_regex(schema))
    for text in good:
        assert rx.fullmatch(text) and valid(json.loads(text), schema, schema), text
    for text in bad:
        assert not rx.fullmatch(text), text


def test_unique_items_are_distinct_values_of_the_set_in_its_order():
    rx = re.compile(schema_to_regex({"type": "array", "uniqueItems": True, "items": {
        "enum": [1, 1.0, True, "1", None]}}))
    for text in ["[]", "[1]", '[1, true, "1", null]', '[true, "1"]', "[null]"]:
        assert rx.fullmatch(text), text
    for text in ["[1, 1]", "[1, 1.0]", "[true, 1]", '["1", true]', "[null, null]", "[2]"]:
        assert not rx.fullmatch(text), text


def test_pydantics_sets_of_an_enum_or_a_literal_take_what_the_regex_generates():
    pydantic = pytest.importorskip("pydantic")
    import enum
    from typing import Literal

    from tests.json_format_oracles import model_takes_what_its_regex_generates

    class Color(enum.Enum):
        RED = "red"
        GREEN = "green"
        BLUE = "blue"

    class Palette(pydantic.BaseModel):
        colors: set[Color] = pydantic.Field(min_length=1)
        flags: frozenset[Literal["a", "b"]] = frozenset()

    assert Palette.model_json_schema()["properties"]["colors"]["uniqueItems"] is True
    model_takes_what_its_regex_generates(Palette, 25)


def test_unique_items_of_any_kind_hold_in_an_array_of_one_item_at_most():
    schema = {"type": "array", "items": {"type": "string"}, "uniqueItems": True, "maxItems": 1}
    rx = generates_only_valid_texts(schema)
    assert rx.fullmatch('["a"]') and rx.fullmatch("[]") and not rx.fullmatch('["a", "b"]')
    with pytest.raises(ValueError, match="'uniqueItems' at # is supported only"):
        schema_to_regex({**schema, "maxItems": 2})


def test_only_the_declared_properties_are_generated_in_order():
    rx = re.compile(schema_to_regex({"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}}, "additionalProperties": True}))
    assert rx.fullmatch('{"a": 1, "b": 2}') and rx.fullmatch('{"b": 2}')
    assert not rx.fullmatch('{"b": 2, "a": 1}')  # valid, but not in the declared order
    assert not rx.fullmatch('{"a": 1, "c": 2}')  # valid, but c is not declared


def test_an_unconstrained_value_nests_any_depth_levels():
    rx = re.compile(schema_to_regex({}))
    for inner in [0, None, "x"]:
        nested, deeper = inner, [inner]
        for level in range(ANY_DEPTH):
            nested, deeper = ([nested], [deeper]) if level % 2 else ({"k": nested}, {"k": deeper})
        assert rx.fullmatch(json.dumps(nested)) and not rx.fullmatch(json.dumps(deeper))


def test_literal_strings_take_either_spelling_of_a_non_ascii_character():
    rx = re.compile(schema_to_regex({"const": "\u00e9\U0001F600"}))
    for text in ['"\u00e9\U0001F600"', '"\\u00e9\\ud83d\\ude00"', '"\u00e9\\ud83d\\ude00"']:
        assert rx.fullmatch(text), text
    assert not rx.fullmatch('"e\U0001F600"')


def test_string_lengths_count_characters_not_escape_text():
    rx = re.compile(schema_to_regex({"type": "string", "minLength": 2, "maxLength": 2}))
    for text in ['"ab"', '"\\n\\u00e9"', '"\\ud83d\\ude00x"', '"\U0001F600x"']:
        assert rx.fullmatch(text), text
    # A surrogate pair is one character; lone surrogate escapes are not generated.
    for text in ['"\\ud83d\\ude00"', '"\\ud83dx"', '"\\ude00x"', '"a"', '"abc"', '"\nb"']:
        assert not rx.fullmatch(text), text


def test_a_wide_model_compiles_past_the_length_a_clients_regex_may_have():
    # Two hundred members: a regex longer than a guided_regex may be, small in states.
    from engine.regex_dfa import compile_regex
    from engine.sampling_params import MAX_GUIDED_REGEX_CHARS

    props = {f"field_{i}": {"type": "string"} if i % 3 else {"type": "integer", "minimum": 0}
             for i in range(200)}
    rx = schema_to_regex({"type": "object", "properties": props, "required": list(props)})
    assert len(rx) > MAX_GUIDED_REGEX_CHARS
    value = {k: (i if i % 3 == 0 else f"v{i}") for i, k in enumerate(props)}
    assert compile_regex(rx).fullmatch(json.dumps(value))


def test_dates_know_month_lengths_and_leap_years():
    rx = re.compile(schema_to_regex({"type": "string", "format": "date"}))
    for day in ["2024-02-29", "2000-02-29", "0400-02-29", "1996-02-29", "2023-01-31",
                "2023-04-30", "2023-12-31", "2023-02-28"]:
        assert rx.fullmatch(f'"{day}"'), day
    for day in ["2023-02-29", "1900-02-29", "2100-02-29", "2023-04-31", "2023-00-10",
                "2023-13-01", "2023-01-00", "2023-1-01", "20230101", "0000-01-01",
                "0000-02-29"]:
        assert not rx.fullmatch(f'"{day}"'), day


def test_integers_are_written_one_way():
    rx = re.compile(schema_to_regex({"type": "integer"}))
    assert all(rx.fullmatch(t) for t in ["0", "7", "-7", "1234567890123456789012"])
    assert not any(rx.fullmatch(t) for t in ["-0", "07", "+7", "1.0", "1e3", " 7", "7 "])


def _window_check(lo, hi, numbers, **bounds):
    rx = re.compile(schema_to_regex({"type": "integer", **bounds}))
    for n in numbers:
        inside = (lo is None or lo <= n) and (hi is None or n <= hi)
        assert bool(rx.fullmatch(str(n))) == inside, (bounds, n)


def test_integer_ranges_are_exact_number_by_number():
    rng = random.Random(7)
    for _ in range(150):
        scale = rng.choice([10, 100, 1000, 5000])
        a, b = sorted(rng.randint(-scale, scale) for _ in range(2))
        lo, hi = rng.choice([a, None]), rng.choice([b, None])
        bounds = {}
        if lo is not None:
            bounds.update(rng.choice([{"minimum": lo}, {"exclusiveMinimum": lo - 1},
                                      {"minimum": lo - 0.5}, {"exclusiveMinimum": lo - 0.5}]))
        if hi is not None:
            bounds.update(rng.choice([{"maximum": hi}, {"exclusiveMaximum": hi + 1},
                                      {"maximum": hi + 0.5}, {"exclusiveMaximum": hi + 0.5}]))
        edges = [v for v in (a, b, 0, 10, 100, 1000) for v in (v, -v)]
        numbers = set(range(min(a, -scale // 10) - 40, max(b, scale // 10) + 40))
        numbers |= {e + d for e in edges for d in range(-12, 13)}
        _window_check(lo, hi, sorted(numbers), **bounds)


def test_huge_integer_bounds_are_exact_at_their_edges():
    lo, hi = -(10 ** 20) + 7, 10 ** 25 - 3
    edges = [lo, hi, 0, -(10 ** 20), 10 ** 25, 10 ** 24, -(10 ** 19), 9 * 10 ** 24]
    numbers = {e + d for e in edges for d in range(-15, 16)}
    _window_check(lo, hi, sorted(numbers), minimum=lo, maximum=hi)
    _window_check(lo, None, sorted(numbers), minimum=lo)
    big = 10 ** 1200  # more digits than one counted repeat may take
    _window_check(big, None, [big - 1, big, big + 1, 10 * big], minimum=big)


@pytest.mark.parametrize("lo,hi", [(0, 2500), (1001, 1001), (999, 3001), (2000, None),
                                   (0, 1000), (1500, 2000), (0, 2000), (3000, 3000)])
def test_long_strings_and_arrays_count_past_one_repeat(lo, hi):
    bounds = {"minLength": lo} | ({} if hi is None else {"maxLength": hi})
    rx = re.compile(schema_to_regex({"type": "string", **bounds}))
    items = {"minItems": lo} | ({} if hi is None else {"maxItems": hi})
    rx_items = re.compile(schema_to_regex({"type": "array", "items": {"const": 0}, **items}))
    edges = {0, 1, 999, 1000, 1001, 1999, 2000, 2001, 2999, 3000, 3001, 3002, lo - 1, lo,
             lo + 1} | (set() if hi is None else {hi - 1, hi, hi + 1})
    for n in sorted(e for e in edges if e >= 0):
        expected = lo <= n and (hi is None or n <= hi)
        assert bool(rx.fullmatch('"' + "a" * n + '"')) == expected, n
        assert bool(rx_items.fullmatch(json.dumps([0] * n))) == expected, n


# --- the regex keeps to the automaton compiler's syntax ---

_ESCAPES = set(".^$*+?{}[]\\|()\"/-ntrdws")


def _check_syntax(rx: str) -> None:
    """Only literals, the escapes above, \\uHHHH and \\UHHHHHHHH, classes, (...) and (?:...)
    groups, |, and * + ? {n} {n,} {n,m} quantifiers with no count above MAX_REPEAT."""
    i, open_groups = 0, 0
    while i < len(rx):
        c = rx[i]
        if c == "\\":
            if rx[i + 1] in "uU":
                n = 4 if rx[i + 1] == "u" else 8
                assert re.fullmatch(f"[0-9a-fA-F]{{{n}}}", rx[i + 2:i + 2 + n]), rx[i:i + 2 + n]
                i += 2 + n
                continue
            assert rx[i + 1] in _ESCAPES, rx[i:i + 2]
            i += 2
        elif c == "[":
            j = i + 1 + (rx[i + 1] == "^")
            while rx[j] != "]":
                if rx[j] == "\\":
                    assert rx[j + 1] in _ESCAPES | {"u", "U"}, rx[j:j + 2]
                    j += {"u": 6, "U": 10}.get(rx[j + 1], 2)
                else:
                    j += 1
            i = j + 1
        elif c == "(":
            assert rx[i + 1] != "?" or rx[i + 2] == ":", rx[i:i + 3]
            open_groups += 1
            i += 3 if rx[i + 1] == "?" else 1
        elif c == ")":
            open_groups -= 1
            assert open_groups >= 0
            i += 1
        elif c == "{":
            m = re.compile(r"\{([0-9]+)(,([0-9]*))?\}").match(rx, i)
            assert m, rx[i:i + 10]
            assert int(m[1]) <= MAX_REPEAT and (not m[3] or int(m[1]) <= int(m[3]) <= MAX_REPEAT)
            i = m.end()
        else:
            assert c not in "^$}]", (c, rx[max(0, i - 20):i + 5])
            i += 1
    assert open_groups == 0


@pytest.mark.parametrize("name", SCHEMAS)
def test_the_regex_keeps_to_the_supported_syntax(name):
    _check_syntax(regex(name).pattern)
    assert len(regex(name).pattern) <= MAX_REGEX_CHARS


def test_the_syntax_check_catches_what_is_outside_the_subset():
    for rx in ["^a", "(?=a)", "\\x41", "\\b", "a{1001}", "(a)\\1", "(?i)a"]:
        with pytest.raises(AssertionError):
            _check_syntax(rx)
    for big in [{"type": "string", "maxLength": 9999}, {"type": "integer", "minimum": 10 ** 1200}]:
        _check_syntax(schema_to_regex(big))


# --- pydantic, if installed ---

def test_a_pydantic_models_schema_and_its_validation_agree_with_the_regex():
    pydantic = pytest.importorskip("pydantic")
    from typing import Literal, Optional

    class Item(pydantic.BaseModel):
        sku: str = pydantic.Field(min_length=2, max_length=6)
        qty: int = pydantic.Field(gt=0, le=500)
        kind: Literal["a", "b"] = "a"

    class Cart(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        owner: Optional[str] = None
        items: list[Item] = pydantic.Field(max_length=3)
        pair: tuple[int, bool]
        notes: dict[str, int] = {}
        total: float
        score: float = pydantic.Field(ge=0, lt=1)
        code: str = pydantic.Field(pattern="^[a-f0-9]{2}(?:-[a-f0-9]{2})?$")

    schema = Cart.model_json_schema()
    rx = re.compile(schema_to_regex(schema))
    _check_syntax(rx.pattern)

    @settings(max_examples=25, deadline=None, derandomize=True)
    @given(text=st.from_regex(rx, fullmatch=True), value=instances(schema, schema))
    def check(text, value):
        Cart.model_validate_json(text)
        assert _matches(rx, Cart.model_validate(value).model_dump(mode="json")) == [True] * 4

    check()


# --- number bounds ---

_BOUND = st.one_of(st.none(), st.integers(-25, 25),
                   st.sampled_from([-2.5, -0.25, -0.05, 0.0, 0.1, 0.5, 0.75, 1.05, 2.5, 3.125,
                                    0.0501, 10.999]))


@st.composite
def number_texts(draw):
    """Decimal texts near small bounds: JSON's form and a few that are not (-0, leading
    zeros, exponents)."""
    sign = draw(st.sampled_from(["", "-"]))
    whole = draw(st.sampled_from(["0", "00", "01"]) | st.integers(0, 30).map(str))
    frac = draw(st.sampled_from(["", ".0", ".00", ".5", ".05", ".999", ".", ".1", ".10", ".25",
                                 ".125", ".051", ".049", ".0501", ".05009", ".75", ".7501"]))
    exp = draw(st.sampled_from([""] * 6 + ["e1", "E-1"]))
    return sign + whole + frac + exp


def _number_allowed(text: str, lo, lo_open, hi, hi_open) -> bool:
    """What a bounded number's regex must match: JSON's form without an exponent, not a
    negative zero, within the bounds (exactly, as fractions)."""
    from fractions import Fraction

    if not re.fullmatch(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?", text):
        return False
    v = Fraction(text)
    if text.startswith("-") and v == 0:
        return False
    lo, hi = (None if b is None else Fraction(repr(b)) for b in (lo, hi))
    return ((lo is None or (v > lo if lo_open else v >= lo))
            and (hi is None or (v < hi if hi_open else v <= hi)))


@settings(max_examples=150, deadline=None, derandomize=True)
@given(lo=_BOUND, hi=_BOUND, lo_open=st.booleans(), hi_open=st.booleans(),
       texts=st.lists(number_texts(), min_size=10, max_size=10))
def test_number_bounds_are_exact(lo, hi, lo_open, hi_open, texts):
    if isinstance(hi, int):
        hi = float(hi)  # 3.0 as well as 3
    schema = {"type": "number"}
    if lo is not None:
        schema["exclusiveMinimum" if lo_open else "minimum"] = lo
    if hi is not None:
        schema["exclusiveMaximum" if hi_open else "maximum"] = hi
    if lo is None and hi is None:
        return  # unbounded: NUMBER, exponents included (the schemas above)
    empty = lo is not None and hi is not None and (lo > hi or lo == hi and (lo_open or hi_open))
    if empty:
        with pytest.raises(ValueError, match="leave no number"):
            schema_to_regex(schema)
        return
    rx = re.compile(schema_to_regex(schema))
    _check_syntax(rx.pattern)
    edges = [t for b in (lo, hi) if b is not None
             for t in (repr(b), repr(b) + "0", repr(b) + "01", repr(b) + "9")
             if re.fullmatch(r"-?[0-9]+(?:\.[0-9]+)?", t)]
    for text in texts + edges + ["-" + e for e in edges]:
        assert bool(rx.fullmatch(text)) == _number_allowed(text, lo, lo_open, hi, hi_open), \
            (schema, text)


_GRID_BOUNDS = [0, 0.05, 0.0501, 0.1, 0.5, 0.75, 0.7501, 1, 1.05, 2.5]
_GRID_FRACTIONS = ["", ".0", ".00", ".04", ".049", ".05", ".050", ".0500", ".05009", ".0501",
                   ".05010", ".0502", ".051", ".1", ".10", ".1001", ".4999", ".5", ".50",
                   ".5001", ".7", ".75", ".750", ".7500", ".75009", ".7501", ".75011", ".76",
                   ".9", ".99"]


@pytest.mark.parametrize("lo_open", [False, True])
@pytest.mark.parametrize("hi_open", [False, True])
def test_decimal_bounds_hold_digit_by_digit(lo_open, hi_open):
    """Every pair of bounds (one integer part or two), against fractions on either side of
    each bound by one digit, equal to it in more or fewer digits, and far from it."""
    texts = [sign + whole + frac for sign in ("", "-") for whole in "0123"
             for frac in _GRID_FRACTIONS]
    for i, lo in enumerate(_GRID_BOUNDS):
        for hi in _GRID_BOUNDS[i:]:
            for a, b in [(lo, hi), (-hi, -lo)]:
                schema = {"type": "number", ("exclusiveMinimum" if lo_open else "minimum"): a,
                          ("exclusiveMaximum" if hi_open else "maximum"): b}
                if a == b and (lo_open or hi_open):
                    continue
                rx = re.compile(schema_to_regex(schema))
                for text in texts:
                    assert bool(rx.fullmatch(text)) == \
                        _number_allowed(text, a, lo_open, b, hi_open), (schema, text)


def test_the_tighter_of_two_bounds_on_one_side_holds():
    rx = schema_to_regex({"type": "number", "minimum": 2, "exclusiveMinimum": 2,
                          "maximum": 5, "exclusiveMaximum": 5.0})
    assert [bool(re.fullmatch(rx, t)) for t in ["2", "2.0", "2.01", "4.99", "5", "5.0"]] == \
        [False, False, True, True, False, False]
    rx = schema_to_regex({"type": "number", "minimum": 3, "exclusiveMinimum": 1})
    assert not re.fullmatch(rx, "2.5") and re.fullmatch(rx, "3")


def test_a_bounded_number_drawn_from_its_regex_is_within_its_bounds():
    schema = {"type": "number", "exclusiveMinimum": -3, "maximum": 120}
    rx = re.compile(schema_to_regex(schema))

    @settings(max_examples=80, deadline=None, derandomize=True)
    @given(text=st.from_regex(rx, fullmatch=True))
    def check(text):
        v = json.loads(text)
        assert -3 < v <= 120 and not (text.startswith("-") and v == 0), text

    check()


# --- pattern ---

# (pattern, what re.search finds in the decoded string: JSON Schema's $ is the end of the
# string, re's is before a final newline too, so the oracle writes \Z)
PATTERNS = [("ab", "ab"), ("^a[0-9]{2}$", "^a[0-9]{2}\\Z"), ("^a|b$", "^a|b\\Z"),
            ('"\\\\', '"\\\\'), ("^[^a]*$", "^[^a]*\\Z"), ("\\n\\t", "\\n\\t"),
            ("^(?:x|\\d+)?é$", "^(?:x|\\d+)?é\\Z"), ("[]a]b", "[]a]b"), ("^$", "^\\Z"),
            ("a\\|b|^x", "a\\|b|^x"), ("[|(]|\\)$", "[|(]|\\)\\Z"), ("^\\x01.$", "^\\x01.\\Z"),
            ("\\Ax|(a|b)\\Z", "\\Ax|(a|b)\\Z"), ("a\\$", "a\\$"), ("x\\\\$", "x\\\\\\Z")]
ALPHABET = ["a", "b", "x", "0", "1", '"', "\\", "\n", "\t", "é", " ", "\x01", "|", "(", ")",
            "\U0001f600"]


@pytest.mark.parametrize("pattern, search", PATTERNS, ids=[p for p, _ in PATTERNS])
@settings(max_examples=60, deadline=None, derandomize=True)
@given(value=st.lists(st.sampled_from(ALPHABET), max_size=6).map("".join))
def test_a_pattern_matches_the_strings_it_finds_a_match_in(pattern, search, value):
    """Spelled as json.dumps spells it without ensure_ascii, a string matches the regex
    exactly when the pattern matches somewhere in it (anchors tying it to the ends)."""
    rx = schema_to_regex({"type": "string", "pattern": pattern})
    assert bool(re.fullmatch(rx, json.dumps(value, ensure_ascii=False))) == \
        bool(re.search(search, value))


# Not the two whose classes span every code point (. and [^a]): hypothesis takes ~7 s apiece
# to draw from their regexes; the test above checks them both ways on its strings.
_DRAWN = [(p, q) for p, q in PATTERNS if p not in ("^[^a]*$", "^\\x01.$")]


@pytest.mark.parametrize("pattern, search", _DRAWN, ids=[p for p, _ in _DRAWN])
@settings(max_examples=20, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(data=st.data())
def test_every_text_a_pattern_regex_matches_is_a_string_the_pattern_finds(pattern, search,
                                                                          data):
    """Its other spellings too (escapes where the pattern leaves the ends open): each is a
    JSON string, and the pattern matches its value."""
    rx = schema_to_regex({"type": "string", "pattern": pattern})
    _check_syntax(rx)
    text = data.draw(st.from_regex(rx, fullmatch=True))
    assert re.search(search, json.loads(text))


def test_a_pattern_in_a_schema_constrains_only_its_string():
    rx = schema_to_regex({"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{2}-\\d{3}$"},
        "n": {"type": "integer"}}, "required": ["code", "n"]})
    assert re.fullmatch(rx, '{"code": "AB-123", "n": 4}')
    assert not re.fullmatch(rx, '{"code": "AB-1234", "n": 4}')
    assert not re.fullmatch(rx, '{"code": "ab-123", "n": 4}')
    # Without "type", the pattern makes it a string.
    assert re.fullmatch(schema_to_regex({"pattern": "^x$"}), '"x"')


# --- refusals ---

REFUSED = [
    ({"type": "string", "pattern": "(a"}, "'pattern' at #: bad regex at position 0"),
    ({"type": "string", "pattern": 3}, "'pattern' at # must be a string"),
    ({"type": "string", "pattern": "^a", "format": "date"}, "'format' beside 'pattern'"),
    ({"type": "string", "pattern": "^a{5}$", "maxLength": 4},
     "'pattern' at # has no match 0..4 characters long"),
    ({"type": "string", "pattern": "^(?:abc)+$", "minLength": 4, "maxLength": 5},
     "'pattern' at # has no match 4..5 characters long"),
    ({"type": "string", "pattern": "\\ud800"}, "a surrogate code point"),
    ({"patternProperties": {"a": {}, "b": {}}}, "'patternProperties' at # has 2 patterns"),
    ({"patternProperties": []}, "'patternProperties' at # must be an object"),
    ({"patternProperties": {"(": {}}}, "'pattern' at #/patternProperties: bad regex"),
    ({"patternProperties": {"a": {}}, "propertyNames": {}}, "'patternProperties' beside "
                                                            "'propertyNames' at #"),
    ({"properties": {"xa": {"type": "integer"}}, "patternProperties": {"a$": {"maxLength": 1}}},
     "the member 'xa' at # is also named by the pattern at #/patternProperties/a$"),
    ({"patternProperties": {"a": {"not": {"const": 1}}}}, "'not' at #/patternProperties/a"),
    ({"propertyNames": False}, "'propertyNames' at #/propertyNames accepts no name"),
    ({"propertyNames": {"not": {}}}, "'propertyNames' at #/propertyNames accepts no name"),
    ({"propertyNames": {"$ref": "#/$defs/E"}, "$defs": {"E": {"enum": [1], "type": "integer"}}},
     "'propertyNames' at #/propertyNames allows no string"),
    ({"propertyNames": {"type": "integer"}}, "'propertyNames' at #/propertyNames allows no"),
    ({"propertyNames": {"anyOf": [{"maxLength": 1}]}}, "'propertyNames' at #/propertyNames is "
                                                       "supported as an enum"),
    ({"propertyNames": {"maxLength": 2, "minimum": 1}}, "is supported as an enum, a const"),
    ({"propertyNames": {"pattern": "^(a"}}, "'pattern' at #/propertyNames: bad regex"),
    ({"propertyNames": {"enum": ["a", "b"]}, "maxProperties": 1},
     "'minProperties' above 1 or 'maxProperties' below 2 beside the names"),
    ({"propertyNames": {"enum": ["a", "b"]}, "minProperties": 2}, "'minProperties' above 1"),
    ({"propertyNames": {"maxLength": 2}, "minProperties": 2}, "'minProperties' 2 at # is not "
                                                              "supported for an object of any"),
    ({"properties": {"abc": {}}, "required": ["abc"], "propertyNames": {"maxLength": 2}},
     "'required' at # names 'abc', which 'propertyNames' does not allow"),
    ({"properties": {"a": {}}, "propertyNames": {"const": "b"}, "minProperties": 1},
     "'minProperties' at # asks for more members"),
    ({"type": "number", "multipleOf": 3}, "'multipleOf' at # is not supported"),
    ({"type": "array", "uniqueItems": True}, "'uniqueItems' at # is supported only for items "
                                             "from an enum"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "'uniqueItems' at #"),
    ({"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True, "minItems": 2},
     "'minItems' above 1 or 'maxItems' below 2 beside 'uniqueItems' at #"),
    ({"type": "array", "items": {"enum": [1]}, "uniqueItems": "yes"}, "'uniqueItems' at # must"),
    ('{"type": "array", "items": {"enum": [Infinity]}, "uniqueItems": true}',
     "the value inf at #/items is not a JSON number"),
    ('{"type": "array", "items": {"enum": [[NaN]]}, "uniqueItems": true}', "nan at #/items"),
    ({"type": "array", "items": {"$ref": "#/$defs/A"}, "uniqueItems": True,
      "$defs": {"A": {"$ref": "#/$defs/A"}}}, "'uniqueItems' at # is supported only"),
    ({"if": {"pattern": "a"}, "then": {}}, "'if' at #"),
    ({"not": {"multipleOf": 2}}, "'not' at # is supported for types"),
    ({"type": "array", "contains": {}, "maxContains": 1}, "'maxContains' at #"),
    ({"type": "object", "minProperties": 2}, "'minProperties' 2 at # is not supported for an "
                                             "object of any members"),
    ({"type": "object", "minProperties": 3, "maxProperties": 2}, "'minProperties' at # is "
                                                                 "above 'maxProperties'"),
    ({"type": "object", "properties": {"a": {}, "b": {}}, "minProperties": 2},
     "'minProperties' 2 at # is not supported beside 0 required members"),
    ({"type": "object", "properties": {"a": {}}, "minProperties": 2},
     "'minProperties' at # asks for more members"),
    ({"type": "object", "properties": {"a": {}, "b": {}}, "maxProperties": 1},
     "'maxProperties' 1 at # is not supported beside 2 properties"),
    ({"type": "object", "maxProperties": -1}, "'maxProperties' at # must be"),
    ({"properties": {"a": {"items": {"pattern": "(?=x)"}}}},
     "'pattern' at #/properties/a/items: bad regex"),
    ({"$defs": {"A": {"properties": {"x/y": {"not": {"pattern": "a"}}}}},
      "$ref": "#/$defs/A"},
     "'not' at #/$defs/A/properties/x~1y"),
    ({"anyOf": [{"type": "null"}, {"format": "iri"}]}, "'format' 'iri' at #/anyOf/1"),
    ({"type": "number", "minimum": 1e-50}, "'minimum' at # has more than 40 digits after"),
    ({"type": "number", "minimum": 2, "exclusiveMaximum": 2}, "bounds at # leave no number"),
    ({"type": "number", "exclusiveMinimum": -1, "exclusiveMaximum": -1},
     "bounds at # leave no number"),
    ({"type": "number", "maximum": "1"}, "'maximum' at # must be a number"),
    ({"type": "integer", "exclusiveMinimum": True}, "'exclusiveMinimum' true at # needs "
                                                    "'minimum' beside it"),
    ({"type": "integer", "exclusiveMinimum": "yes"}, "'exclusiveMinimum' at # must be a number"),
    ({"type": "number", "minimum": 1, "maximum": 1, "exclusiveMaximum": True},
     "bounds at # leave no number"),
    ({"type": "integer", "maximum": "9"}, "'maximum'"),
    ({"type": "integer", "minimum": 5, "maximum": 4}, "bounds at # leave no integer"),
    ({"type": "integer", "exclusiveMinimum": 4, "exclusiveMaximum": 5}, "leave no integer"),
    (False, "is false"),
    ({"not": {}}, "the schema at # is false"),
    ({"not": {"required": ["a"]}}, "'not' at # is supported for types to leave out"),
    ({"properties": {"a": {"not": {}}}, "required": ["a"]},
     "'required' at # names 'a', whose schema is false"),
    ({"items": False, "type": "array", "minItems": 1}, "'minItems'"),
    ({"$defs": {"Node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/Node"}},
                         "required": ["next"]}},
      "$ref": "#/$defs/Node"}, "'$ref' '#/$defs/Node' at #/$defs/Node/properties/next is "
                               "recursive, and no instance of it ends within 3 levels"),
    ({"$ref": "#"}, "'$ref' '#' at # is recursive"),
    ({"$ref": "#/properties/a"}, "'$ref' '#/properties/a' at # points to no schema"),
    ({"$ref": "#/items/01", "items": [{}]}, "'$ref' '#/items/01' at # points to no schema"),
    ({"$ref": "s.json#/a"}, "only references into the schema itself"),
    ({"$ref": "http://example.com/s.json"}, "'$ref'"),
    ({"$ref": "#/$defs/A/properties/b", "$defs": {"A": {}}}, "'$ref'"),
    ({"$ref": "#/$defs/Missing"}, "'$ref' '#/$defs/Missing' at # points to no schema"),
    ({"$ref": 3}, "'$ref' at # must be a string"),
    ({"allOf": [{"maxLength": 1}, {"maxLength": 2, "pattern": "a"}, {"pattern": "b"}]},
     "'pattern' has different values in the schemas 'allOf' joins at #"),
    ({"anyOf": []}, "'anyOf' at #"),
    ({"oneOf": {"type": "null"}}, "'oneOf' at #"),
    ({"type": "strnig"}, "'type' at #"),
    ({"type": []}, "'type' at #"),
    ({"type": "string", "format": "regex"}, "'format' 'regex'"),
    ({"type": "string", "format": 3}, "'format' 3 at # is not supported"),
    ({"type": "string", "format": "date", "maxLength": 9},
     "'maxLength' beside 'format' at # is not supported: date texts may be up to 10"),
    ({"type": "string", "format": "date-time", "maxLength": 9999},
     "date-time texts may be of any length"),
    ({"type": "string", "format": "uri", "maxLength": 1500}, "uri texts may be up to 1508"),
    ({"type": "string", "format": "ipv4", "minLength": 8},
     "'minLength' beside 'format' at # is not supported: ipv4 texts may be 7 characters"),
    ({"type": "string", "minLength": 5, "maxLength": 2}, "'minLength' at # is above"),
    ({"type": "string", "maxLength": 10 ** 6}, "'maxLength' at # is above"),
    ({"type": "string", "maxLength": -1}, "'maxLength' at # must be"),
    ({"type": "string", "minLength": 1.5}, "'minLength' at # must be"),
    ({"type": "string", "minLength": None}, "'minLength' at # must be"),
    ({"type": "array", "maxItems": "3"}, "'maxItems' at # must be"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "'required' at # names 'b'"),
    ({"type": "object", "required": "a"}, "'required' at #"),
    ({"type": "object", "properties": []}, "'properties' at #"),
    ({"type": "object", "properties": {"a": {}}, "additionalProperties": 1},
     "'additionalProperties' at #"),
    ({"type": "array", "items": [{}], "prefixItems": [{}]}, "'items' at # is an array beside "
                                                             "'prefixItems'"),
    ({"type": "array", "items": [{}], "additionalItems": 3},
     "schema at #/additionalItems is a int"),
    ({"type": "array", "prefixItems": {}}, "'prefixItems' at #"),
    ({"enum": []}, "'enum' at #"),
    ({"enum": "a"}, "'enum' at # must be an array"),
    ({"type": "string", "enum": [1, 2]}, "'enum' at # leaves no value"),
    ({"enum": [1], "const": 1}, "'enum' and 'const' together"),
    ({"$ref": "#/$defs/A", "type": "object", "$defs": {"A": {"type": "array"}}},
     "the schemas joined at # exclude each other"),
    ({"anyOf": [{"type": "integer", "maximum": 0}], "minimum": 1}, "bounds at # leave no"),
    ({"enum": ["ab", "cd"], "maxLength": 1}, "no value of 'enum' at # meets the keywords"),
    ({"nullable": "yes"}, "'nullable' at #"),
    ({"const": float("inf")}, "not a JSON number"),
    ({"const": {1: 2}}, "not JSON"),
    ([{"type": "null"}], "a list, not an object"),
    ({"properties": {"a": 3}}, "schema at #/properties/a is a int"),
    ("{not json", "not valid JSON"),
    ("[" * 100_000, "nests too deeply"),
    (functools.reduce(lambda s, _: {"items": s}, range(100), {}), "nests deeper than"),
    ({"enum": ["x" * 1000] * 300}, "longer than"),
    ({"$defs": {f"A{i + 1}": {"type": "array", "prefixItems": [{"$ref": f"#/$defs/A{i}"}] * 8}
                for i in range(20)} | {"A0": {"type": "null"}}, "$ref": "#/$defs/A20"},
     "longer than"),
]


@pytest.mark.parametrize("schema,message", REFUSED, ids=[m for _, m in REFUSED])
def test_what_is_not_supported_is_refused_by_name_and_place(schema, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        schema_to_regex(schema)


def test_a_schema_may_come_as_json_text():
    rx = schema_to_regex(json.dumps({"type": "array", "items": {"type": "integer", "minimum": 3},
                                     "maxItems": 2}))
    assert re.fullmatch(rx, "[3, 40]") and not re.fullmatch(rx, "[2]")
    assert not re.fullmatch(rx, "[3, 4, 5]")


# --- guided_whitespace_pattern ---

@functools.cache
def spaced_regex(name: str, whitespace: str) -> re.Pattern:
    return re.compile(schema_to_regex(SCHEMAS[name], whitespace))


@pytest.mark.parametrize("name", SCHEMAS)
@settings(SETTINGS, max_examples=15)
@given(data=st.data())
def test_a_whitespace_pattern_admits_the_spacing_it_allows_and_no_other(name, data):
    schema = SCHEMAS[name]
    value = data.draw(instances(schema, schema))
    rx = spaced_regex(name, "[ \\n]*")
    for kw in [*SPELLINGS, dict(indent=2), dict(indent=0, ensure_ascii=False),
               dict(separators=(" , ", " : "))]:
        assert rx.fullmatch(json.dumps(value, **kw)), (kw, json.dumps(value, **kw))
    tabbed = json.dumps(value, indent="\t")  # a raw tab is only ever indentation
    assert bool(rx.fullmatch(tabbed)) == ("\t" not in tabbed), tabbed
    # One newline exactly on both sides of each punctuation: json.dumps's own spellings
    # match only where there is none.
    forced = spaced_regex(name, "\\n")
    assert bool(forced.fullmatch(json.dumps(value))) == (_punctuated(value) == 0)


def _punctuated(value) -> int:
    """Brackets, commas and colons in ``value``'s JSON text, outside its strings."""
    if isinstance(value, list):
        return 2 + max(len(value) - 1, 0) + sum(_punctuated(v) for v in value)
    if isinstance(value, dict):
        return 2 + max(len(value) - 1, 0) + len(value) + sum(_punctuated(v)
                                                             for v in value.values())
    return 0


@pytest.mark.parametrize("name", ["user", "pet", "enum_mixed"])
@settings(SETTINGS, max_examples=15)
@given(data=st.data())
def test_every_text_a_spaced_regex_matches_is_a_valid_instance(name, data):
    text = data.draw(st.from_regex(spaced_regex(name, "[ \\t\\n\\r]{0,3}"), fullmatch=True))
    assert valid(json.loads(text), SCHEMAS[name], SCHEMAS[name]), text


@pytest.mark.parametrize("whitespace, match", [
    ("\\s*", "other than JSON's whitespace"), ("[ x]*", "other than JSON's whitespace"),
    (".", "other than JSON's whitespace"), ("^ *", "no anchors"), (" *$", "no anchors"),
    ("(", "bad regex"), ("", "non-empty string"), (3, "non-empty string"),
    (" " * 257, "more than 256"),
])
def test_bad_whitespace_patterns_are_refused(whitespace, match):
    with pytest.raises(ValueError, match=match):
        check_whitespace_pattern(whitespace)
