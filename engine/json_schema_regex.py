"""JSON Schema to regular expression, for ``guided_json`` (vLLM's): the output is JSON that
the request's schema accepts.

``schema_to_regex(schema)`` gives a regex whose full matches are the JSON texts of the
instances the schema accepts, spelled as ``json.dumps`` spells them: with its default
separators (", ", ": ") or compact ones (",", ":"), each comma and colon on its own, and no
whitespace anywhere else, so a model guided by it cannot ramble in whitespace (unless a
whitespace pattern says what may stand around the punctuation). Another module
compiles the regex into a character automaton, so only a small part of ``re``'s syntax is
used: literals and escaped metacharacters, ``\\uHHHH`` (and ``\\UHHHHHHHH``), classes,
``(?:...)`` groups, alternation and the quantifiers ``* + ? {n} {n,} {n,m}``, no count above
``MAX_REPEAT``.

The regex is built bottom-up, one schema node at a time; the output of a node is one
regex, and nothing about where it sits in the document changes it (so a ``$ref`` is
compiled once). Schemas come from API clients: every keyword outside the supported set is
refused with a ValueError naming it and where it is (a JSON pointer such as
``#/properties/tags/items``), as are unsatisfiable schemas and regexes over
``MAX_REGEX_CHARS``.

What the regex accepts is a subset of what the schema does, by design (the generated text
needs one spelling, not every one):

- objects carry the ``properties`` in their declared order, every required one and any
  of the others, and nothing else, whatever ``additionalProperties`` says, except that an
  object schema without ``properties`` takes any members (values as ``additionalProperties``
  says, any value when it is absent or true);
- a schema without ``type`` is taken for the types its keywords constrain ("integer" for
  the numeric bounds), and for any value when it has none;
- a value of any type (``{}``, ``true``, items or members left open) nests at most
  ``ANY_DEPTH`` arrays or objects deep;
- a recursive ``$ref`` (a tree, a linked list, an expression) is followed at most
  ``RECURSION_DEPTH`` times inside itself; below that, its optional members, the items
  past ``minItems``, its ``anyOf`` branches and nullable values that lead back to it are
  left out;
- integers are written without a fraction or exponent, and never as ``-0``; a bounded
  "number" without an exponent, and never as ``-0``; one with ``multipleOf`` with as many
  digits after the point as the ``multipleOf`` has (0.01: "12.50"); ``enum`` and
  ``const`` values are written as ``json.dumps`` writes them (non-ASCII characters raw or
  as ``\\u`` escapes, as with and without ``ensure_ascii``);
- a ``format`` is one spelling of its RFC's texts (engine/json_formats.py);
- ``oneOf`` is taken as ``anyOf`` (the branches of a tagged union exclude each other anyway).

Supported: ``type`` (one or a list), ``enum``, ``const``, ``properties``, ``required``,
``additionalProperties``, ``minProperties`` and ``maxProperties`` (for an object of any
members: at most a minimum of 1, as a generated name may repeat; beside ``properties``:
bounds the required and declared members meet, or a minimum of 1), ``items``,
``prefixItems``, ``minItems``, ``maxItems``, ``uniqueItems`` (items from an enum, a const,
booleans or null: each at most once, in the set's order),
``minLength``, ``maxLength``, ``format`` (date, time, date-time, duration, uuid, ipv4,
ipv6, hostname, email, uri; lengths beside one only where its every text meets them;
OpenAPI's int32, int64, float, double, password, binary), ``pattern`` (see
engine/json_string_pattern.py: Python ``re`` syntax, matched anywhere in the string unless
anchored; beside lengths, some of its matches of those lengths: engine/pattern_lengths.py;
never beside a format), ``minimum``, ``maximum``, ``exclusiveMinimum``,
``exclusiveMaximum`` (numbers, as in draft 2020-12, compared exactly as decimals, at most
40 digits after the point: engine/json_numbers.py), ``multipleOf`` (one whose multiples
their last digits tell, as 0.01 or 5, or within bounds leaving few: engine/json_multiples.py),
``anyOf``, ``oneOf``, ``allOf`` of one schema, ``$ref`` to ``#`` (the root),
``#/$defs/NAME`` or ``#/definitions/NAME``, and OpenAPI's ``nullable``. Annotations are
ignored (title, description, default, examples, $schema, $id, $comment, deprecated,
readOnly, writeOnly, OpenAPI's discriminator). String lengths count characters as JSON
Schema does: an escape is one, a surrogate pair of escapes one (lone surrogate escapes are
not generated).

Refused: a recursive ``$ref`` whose every instance nests deeper than ``RECURSION_DEPTH``
(a required member leading back to it), keywords beside ``$ref``/``allOf``/``anyOf``/
``oneOf`` and beside ``enum``/``const`` other than ``type`` (their intersection), lengths
beside a ``format`` that some of its texts do not meet, lengths and counts above
``MAX_COUNT``, unsatisfiable schemas (``false``, empty ranges) and every other keyword
(``not``, ``if``, ``patternProperties`` ...).
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from fractions import Fraction
from typing import Any
from urllib.parse import unquote

from engine.json_formats import FORMATS, format_regex, format_type, int_format_bounds
from engine.json_multiples import integer_multiples, multiple_of, number_multiples
from engine.json_numbers import int_bounds, int_range, number_range
from engine.json_string_pattern import pattern_string_regex
from engine.json_text_regex import (CHAR, MAX_SCHEMA_DEPTH, any_value, array_items,
                                     json_types, literal, map_object, object_members)
from engine.json_whitespace import Punctuation
from engine.regex_parse import MAX_PATTERN_LENGTH
from engine.regex_text import alt, repeat

MAX_REGEX_CHARS = MAX_PATTERN_LENGTH  # the automaton compiler's limit
MAX_COUNT = 10_000  # minLength/maxLength/minItems/maxItems above this are refused
ANY_DEPTH = 2  # arrays/objects an unconstrained value may nest
RECURSION_DEPTH = 3  # times a recursive $ref is followed inside itself

_TYPES = ("null", "boolean", "integer", "number", "string", "array", "object")
_IGNORED = {"title", "description", "default", "examples", "$schema", "$id", "$comment",
            "deprecated", "readOnly", "writeOnly", "discriminator", "$defs", "definitions"}
# The keywords that constrain one type, and the type a schema without "type" is taken for.
_TYPE_KEYWORDS = {
    "minLength": "string", "maxLength": "string", "format": "string", "pattern": "string",
    "minimum": "integer", "maximum": "integer",
    "exclusiveMinimum": "integer", "exclusiveMaximum": "integer", "multipleOf": "integer",
    "properties": "object", "required": "object", "additionalProperties": "object",
    "items": "array", "prefixItems": "array", "minItems": "array", "maxItems": "array",
    "minProperties": "object", "maxProperties": "object", "uniqueItems": "array",
}
_COMBINATORS = ("$ref", "allOf", "anyOf", "oneOf", "enum", "const")
_KNOWN = _IGNORED | set(_TYPE_KEYWORDS) | set(_COMBINATORS) | {"type", "nullable"}


def schema_to_regex(schema: dict | bool | str, whitespace: str | None = None) -> str:
    """The regex of the JSON texts ``schema`` accepts (see the module docstring for how
    they are spelled); a str is the schema's JSON text. ``whitespace``: a regex of the
    whitespace allowed around each comma, colon and bracket (vLLM's
    guided_whitespace_pattern, checked in engine/json_whitespace.py) instead of
    json.dumps's separators. ValueError for what is refused."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except RecursionError:
            raise ValueError("the schema nests too deeply") from None
        except ValueError as e:
            raise ValueError(f"the schema is not valid JSON: {e}") from None
    return _Compiler(schema, Punctuation.around(whitespace)).node(schema, "#", 0)


class _Cut(ValueError):
    """A recursive $ref met past RECURSION_DEPTH: no value there. Whatever holds it gives
    it up where the schema lets it (an optional member, an item past minItems, an anyOf
    branch, null for a nullable) and raises it on otherwise; past the root, the schema has
    no instance within the depth."""


class _Compiler:
    def __init__(self, root: Any, punct: Punctuation):
        self.root = root
        self.p = punct
        self.refs: dict[str, str] = {}  # each $ref compiled once, unless it recursed
        self.expanding: list[str] = ["#"]  # the $refs being compiled ("#": the root)
        self.reentries = 0  # $refs met inside their own expansion so far

    def node(self, s: Any, path: str, depth: int) -> str:
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"the schema at {path} nests deeper than {MAX_SCHEMA_DEPTH}")
        if s is True:
            return any_value(ANY_DEPTH, self.p)
        if s is False:
            raise ValueError(f"the schema at {path} is false: no value is valid")
        if not isinstance(s, dict):
            raise ValueError(f"the schema at {path} is a {type(s).__name__}, "
                             "not an object or a boolean")
        for key in s:
            if key not in _KNOWN:
                raise ValueError(f"{key!r} at {path} is not supported")
        nullable = s.get("nullable", False)
        if not isinstance(nullable, bool):
            raise ValueError(f"'nullable' at {path} must be true or false")
        combinators = [k for k in _COMBINATORS if k in s]
        try:
            rx = self.combined(s, combinators, path, depth) if combinators else \
                self.typed(s, path, depth)
        except _Cut:
            if not nullable:
                raise
            return "null"
        if nullable:
            rx = alt([rx, "null"])
        if len(rx) > MAX_REGEX_CHARS:
            raise ValueError(f"the schema at {path} needs a regex longer than "
                             f"{MAX_REGEX_CHARS} characters")
        return rx

    def combined(self, s: dict, combinators: list[str], path: str, depth: int) -> str:
        kw = combinators[0]
        if len(combinators) > 1:
            raise ValueError(f"{kw!r} and {combinators[1]!r} together at {path} "
                             "are not supported")
        # Their intersection with other constraints is out of reach; enum and const may
        # still be narrowed by type.
        allowed = ("type",) if kw in ("enum", "const") else ()
        for key in s:
            if (key in _TYPE_KEYWORDS or key == "type") and key not in allowed:
                raise ValueError(f"{key!r} beside {kw!r} at {path} is not supported")
        where = _at(path, kw)
        if kw in ("enum", "const"):
            values = [s["const"]] if kw == "const" else s["enum"]
            if not isinstance(values, list):
                raise ValueError(f"'enum' at {path} must be an array")
            types = self.types(s, path) if "type" in s else _TYPES
            kept = [v for v in values if json_types(v, where) & set(types)]
            if not kept:
                raise ValueError(f"{kw!r} at {path} leaves no value of the schema's type")
            return alt(_bounded((literal(v, where, depth, self.p) for v in kept), path))
        if kw == "$ref":
            return self.ref(s["$ref"], path, depth)
        branches = s[kw]
        if not isinstance(branches, list) or not branches:
            raise ValueError(f"{kw!r} at {path} must be a non-empty array of schemas")
        if kw == "allOf" and len(branches) != 1:
            raise ValueError(f"'allOf' at {path} has {len(branches)} schemas: "
                             "only one is supported")
        return alt(_bounded(_uncut(lambda i: self.node(branches[i], _at(where, i), depth + 1),
                                   len(branches)), path))

    def ref(self, ref: Any, path: str, depth: int) -> str:
        if not isinstance(ref, str):
            raise ValueError(f"'$ref' at {path} must be a string")
        if ref in self.refs:
            return self.refs[ref]
        target = self.target(ref, path)
        inside = self.expanding.count(ref)
        if inside:
            self.reentries += 1
            if inside > RECURSION_DEPTH:
                raise _Cut(f"'$ref' {ref!r} at {path} is recursive, and no instance of it "
                           f"ends within {RECURSION_DEPTH} levels of itself (a required "
                           "member or item leads back to it at every level)")
        before = self.reentries
        self.expanding.append(ref)
        try:
            rx = self.node(target, ref, depth + 1)
        finally:
            self.expanding.pop()
        if self.reentries == before:  # no recursion below: the same wherever it is met
            self.refs[ref] = rx
        return rx

    def target(self, ref: str, path: str) -> Any:
        """The schema ``ref`` points to: the root ("#"), or one under $defs/definitions."""
        if ref == "#":
            return self.root
        parts = ref.split("/")
        if len(parts) != 3 or parts[0] != "#" or parts[1] not in ("$defs", "definitions"):
            raise ValueError(f"'$ref' {ref!r} at {path} is not supported: only '#', "
                             "'#/$defs/NAME' and '#/definitions/NAME' are")
        name = unquote(parts[2]).replace("~1", "/").replace("~0", "~")
        defs = self.root.get(parts[1]) if isinstance(self.root, dict) else None
        if not isinstance(defs, dict) or name not in defs:
            raise ValueError(f"'$ref' {ref!r} at {path} points to no schema")
        return defs[name]

    def types(self, s: dict, path: str) -> list[str]:
        t = s.get("type")
        if t is None:  # taken from the keywords; none at all: any value
            return list(dict.fromkeys(format_type(s[k], path) if k == "format" else
                                      _TYPE_KEYWORDS[k] for k in s if k in _TYPE_KEYWORDS))
        types = [t] if isinstance(t, str) else t
        if not isinstance(types, list) or not types or \
                any(not isinstance(x, str) or x not in _TYPES for x in types):
            raise ValueError(f"'type' at {path} must be one of {', '.join(_TYPES)} "
                             "or a non-empty array of them")
        return list(dict.fromkeys(types))

    def typed(self, s: dict, path: str, depth: int) -> str:
        if "format" in s:
            format_type(s["format"], path)
        types = self.types(s, path)
        if not types:
            return any_value(ANY_DEPTH, self.p)
        return alt(_uncut(lambda i: self.one_type(types[i], s, path, depth), len(types)))

    def one_type(self, t: str, s: dict, path: str, depth: int) -> str:
        if t == "null":
            return "null"
        if t == "boolean":
            return "(?:true|false)"
        if t == "number":
            if "multipleOf" in s:
                return number_multiples(s, multiple_of(s, path), path)
            return number_range(s, path)
        if t == "integer":
            lo, hi = int_format_bounds(s.get("format"), *int_bounds(s, path), path)
            if "multipleOf" in s:
                return integer_multiples(lo, hi, multiple_of(s, path), path)
            return int_range(lo, hi)
        if t == "string":
            return self.string(s, path)
        if t == "array":
            return self.array(s, path, depth)
        return self.object(s, path, depth)

    def string(self, s: dict, path: str) -> str:
        lo, hi = _count(s, "minLength", path, 0), _count(s, "maxLength", path, None)
        if hi is not None and lo > hi:
            raise ValueError(f"'minLength' at {path} is above 'maxLength'")
        if "pattern" in s:
            if "format" in s:
                raise ValueError(f"'format' beside 'pattern' at {path} is not supported")
            return pattern_string_regex(s["pattern"], CHAR, path, lo, hi)
        if "format" in s and s["format"] in FORMATS:
            return f'"{format_regex(s["format"], lo, hi, path)}"'
        return f'"{repeat(CHAR, lo, hi)}"'

    def array(self, s: dict, path: str, depth: int) -> str:
        prefix, items = s.get("prefixItems", []), s.get("items", True)
        if not isinstance(prefix, list):
            raise ValueError(f"'prefixItems' at {path} must be an array of schemas")
        if isinstance(items, list):
            raise ValueError(f"'items' at {path} is an array: use 'prefixItems' for tuples")
        lo, hi = _count(s, "minItems", path, 0), _count(s, "maxItems", path, None)
        if items is False:  # nothing after the prefix
            hi = len(prefix) if hi is None else min(hi, len(prefix))
        if hi is not None and lo > hi:
            raise ValueError(f"'minItems' at {path} asks for more items than the schema allows")
        unique = s.get("uniqueItems", False)
        if not isinstance(unique, bool):
            raise ValueError(f"'uniqueItems' at {path} must be true or false")
        if unique:
            return self.unique_items(prefix, items, lo, hi, path, depth)
        firsts, rest, total = [], None, 0
        try:  # a recursion cut at an item: the array ends before it, if it may
            for i, p in enumerate(prefix if hi is None else prefix[:hi]):
                firsts.append(self.node(p, _at(_at(path, "prefixItems"), i), depth + 1))
                total = _within(total + len(firsts[-1]), path)
            if items is not False and (hi is None or hi > len(prefix)):
                rest = self.node(items, _at(path, "items"), depth + 1)
        except _Cut:
            if lo > len(firsts):
                raise
            hi = len(firsts)
        return f"{self.p.open_array}{array_items(firsts, rest, lo, hi, self.p.comma)}" \
            f"{self.p.close_array}"

    def unique_items(self, prefix: list, items: Any, lo: int, hi: int | None, path: str,
                     depth: int) -> str:
        """Distinct items from a finite set of values (an enum, a const, booleans, null: as
        pydantic's set of an Enum or a Literal), each at most once, in the set's order."""
        values = None if prefix or items in (True, False) else \
            self.finite_values(items, _at(path, "items"), depth + 1)
        if values is None:
            raise ValueError(f"'uniqueItems' at {path} is supported only for items from an "
                             "enum, a const, booleans or null, and no prefixItems")
        if lo > 1 or (hi is not None and hi < len(values)):
            raise ValueError(f"'minItems' above 1 or 'maxItems' below {len(values)} beside "
                             f"'uniqueItems' at {path} is not supported")
        found = [(literal(v, path, depth, self.p), False) for v in values]
        return self.p.open_array + object_members(found, self.p.comma, nonempty=lo > 0) \
            + self.p.close_array

    def finite_values(self, s: Any, path: str, depth: int) -> list | None:
        """The distinct JSON values ``s`` allows when they are few (an enum or a const with at
        most ``type`` beside, boolean, null, or a $ref to one of those); None otherwise."""
        for _ in range(MAX_SCHEMA_DEPTH):  # a chain of $refs (a cycle of them ends here)
            if not isinstance(s, dict) or set(s) - _IGNORED != {"$ref"}:
                break
            s = self.target(s["$ref"], path)
        if not isinstance(s, dict) or not isinstance(s.get("type", ""), (str, list)):
            return None
        keys = set(s) - _IGNORED
        if keys <= {"enum", "type"} and "enum" in s or keys <= {"const", "type"} and "const" in s:
            values = s["enum"] if "enum" in s else [s["const"]]
            if not isinstance(values, list):
                return None
            types = self.types(s, path) if "type" in s else _TYPES
            values = [v for v in values if json_types(v, path) & set(types)]
        elif keys == {"type"} and s["type"] in ("boolean", "null"):
            values = [True, False] if s["type"] == "boolean" else [None]
        else:
            return None
        distinct, seen = [], set()
        for v in values:
            literal(v, path, depth, self.p)  # what is not JSON (NaN, Infinity) refused first
            key = _equality_key(v)
            if key not in seen:
                seen.add(key)
                distinct.append(v)
        return distinct or None

    def object(self, s: dict, path: str, depth: int) -> str:
        props, required = s.get("properties", {}), s.get("required", [])
        extra = s.get("additionalProperties")
        if not isinstance(props, dict):
            raise ValueError(f"'properties' at {path} must be an object")
        if extra is not None and not isinstance(extra, (bool, dict)):
            raise ValueError(f"'additionalProperties' at {path} must be a schema")
        if not isinstance(required, list) or any(not isinstance(r, str) for r in required):
            raise ValueError(f"'required' at {path} must be an array of strings")
        for name in required:
            if name not in props:
                raise ValueError(f"'required' at {path} names {name!r}, which is not in "
                                 "'properties': such a member is not generated")
        least = _count(s, "minProperties", path, 0)
        most = _count(s, "maxProperties", path, None)
        if most is not None and least > most:
            raise ValueError(f"'minProperties' at {path} is above 'maxProperties'")
        if not props and extra is not False:  # a map: any members, values as extra says
            return self.map_object(extra, least, most, path, depth)
        # Beside properties, additionalProperties changes nothing: none beyond them is
        # generated (absent, the spec's default, already allows them).
        return self.declared_object(props, set(required), least, most, path, depth)

    def map_object(self, extra: Any, least: int, most: int | None, path: str,
                   depth: int) -> str:
        """An object of any members, least..most of them, values as ``extra`` says."""
        if least > 1:
            raise ValueError(f"'minProperties' {least} at {path} is not supported for an "
                             "object of any members: a generated name may repeat, and a "
                             "repeated name counts once")
        empty = self.p.open_object + self.p.close_object
        if most == 0:
            return empty
        try:
            value = any_value(ANY_DEPTH, self.p) if extra in (None, True) else \
                self.node(extra, _at(path, "additionalProperties"), depth + 1)
        except _Cut:  # a recursion cut at the values: no members
            if least:
                raise
            return empty
        return map_object(value, self.p, least, most)

    def declared_object(self, props: dict, required: set[str], least: int, most: int | None,
                        path: str, depth: int) -> str:
        """The declared members in order, each required one present, least..most in all
        (bounds the required and declared members' counts already meet, or a minimum of 1
        where none is required)."""
        members, total, cut = [], 0, None
        for name, sub in props.items():
            try:
                value = self.node(sub, _at(_at(path, "properties"), name), depth + 1)
            except _Cut as e:  # a recursion cut at an optional member: it is left out
                if name in required:
                    raise
                cut = e
                continue
            member = literal(name, path, depth, self.p) + self.p.colon + value
            total = _within(total + len(member), path)
            members.append((member, name in required))
        if least > len(members):
            if cut is not None:
                raise cut
            raise ValueError(f"'minProperties' at {path} asks for more members than the "
                             "schema allows")
        if least > max(len(required), 1):
            raise ValueError(f"'minProperties' {least} at {path} is not supported beside "
                             f"{len(required)} required members (require as many)")
        if most is not None and most < len(members):
            raise ValueError(f"'maxProperties' {most} at {path} is not supported beside "
                             f"{len(members)} properties (declare at most as many)")
        return self.p.open_object + object_members(members, self.p.comma, nonempty=least > 0) \
            + self.p.close_object


def _equality_key(value: Any) -> Any:
    """A key equal for JSON values JSON Schema takes for equal: 1 and 1.0 one number, true
    and 1 two values, objects whatever their members' order."""
    if isinstance(value, bool) or value is None:
        return ("literal", value)
    if isinstance(value, (int, float)):
        return ("number", Fraction(value))
    if isinstance(value, list):
        return ("array", tuple(_equality_key(v) for v in value))
    if isinstance(value, dict):
        return ("object", frozenset((k, _equality_key(v)) for k, v in value.items()))
    return ("string", value)


def _uncut(compile_one, n: int) -> Iterable[str]:
    """``compile_one(i)`` for i in 0..n-1, leaving out those a recursion cut (alternatives:
    one left is enough); the first cut again when every one was."""
    first_cut, kept = None, 0
    for i in range(n):
        try:
            rx = compile_one(i)
        except _Cut as e:
            first_cut = first_cut or e
            continue
        kept += 1
        yield rx
    if not kept:
        raise first_cut


def _bounded(parts: Iterable[str], path: str) -> list[str]:
    """``parts``, stopping as soon as they are too long together: a schema repeating a
    big $ref a thousand times is refused before it takes memory."""
    out, total = [], 0
    for part in parts:
        total = _within(total + len(part), path)
        out.append(part)
    return out


def _within(total: int, path: str) -> int:
    """``total`` characters of regex so far, refused past MAX_REGEX_CHARS."""
    if total > MAX_REGEX_CHARS:
        raise ValueError(f"the schema at {path} needs a regex longer than "
                         f"{MAX_REGEX_CHARS} characters")
    return total


def _count(s: dict, kw: str, path: str, default: int | None) -> int | None:
    if kw not in s:
        return default
    v = s[kw]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or \
            isinstance(v, float) and not v.is_integer():
        raise ValueError(f"{kw!r} at {path} must be a non-negative integer")
    if v > MAX_COUNT:
        raise ValueError(f"{kw!r} at {path} is above {MAX_COUNT}, the most supported")
    return int(v)


def _at(path: str, key: str | int) -> str:
    """``path`` one step down, as a JSON pointer."""
    return f"{path}/{str(key).replace('~', '~0').replace('/', '~1')}"
