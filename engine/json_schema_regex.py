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
  says, any value when it is absent or true) of the names ``propertyNames`` or
  ``patternProperties`` allow (engine/json_objects.py: an enum's names at most once each, in
  its order);
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
- ``oneOf`` is compiled as ``anyOf`` where its schemas are shown to exclude each other
  (engine/json_one_of.py: by type, by values, by a tag member, by required names), and
  refused otherwise.

Supported: ``type`` (one or a list), ``enum`` and ``const`` (beside other keywords, their
scalar values those keywords allow: engine/json_enum.py), ``properties``, ``required``,
``additionalProperties``, ``minProperties`` and ``maxProperties`` (for an object of any
members: at most a minimum of 1, as a generated name may repeat; beside ``properties``:
bounds the required and declared members meet, or a minimum of 1), ``propertyNames`` (an
enum, a const, or a string's lengths, pattern and format), ``patternProperties`` of one
pattern (beside ``properties``, a declared name it matches only where the two schemas are
one), ``dependentRequired``, ``dependentSchemas`` and draft 7's ``dependencies`` beside
``properties`` (engine/json_dependencies.py), ``items``, ``prefixItems`` (or draft 7's
array ``items`` with ``additionalItems``), ``minItems``, ``maxItems``, ``contains`` and
``minContains`` (engine/json_contains.py), ``uniqueItems``
(items from an enum, a const, booleans or null: each at most once, in the set's order; any
items where ``maxItems`` is at most 1),
``minLength``, ``maxLength``, ``format`` (date, time, date-time, duration, uuid, ipv4,
ipv6, hostname, email, uri; lengths beside one only where its every text meets them;
OpenAPI's int32, int64, float, double, password, binary), ``pattern`` (see
engine/json_string_pattern.py: Python ``re`` syntax, matched anywhere in the string unless
anchored; beside lengths, some of its matches of those lengths: engine/pattern_lengths.py;
never beside a format), ``minimum``, ``maximum``, ``exclusiveMinimum``,
``exclusiveMaximum`` (numbers, as in draft 2020-12, or draft 4's and OpenAPI 3.0's booleans
beside ``minimum`` and ``maximum``; compared exactly as decimals, at most
40 digits after the point: engine/json_numbers.py), ``multipleOf`` (one whose multiples
their last digits tell, as 0.01 or 5, or within bounds leaving few: engine/json_multiples.py),
``if``, ``then`` and ``else`` (a condition of types, values, bounds, or an object's members:
engine/json_conditional.py), ``anyOf``, ``oneOf``, ``allOf`` (its schemas merged:
engine/json_all_of.py, which also reads keywords beside ``$ref``, ``anyOf`` and ``oneOf``
as one more), ``$ref`` as a JSON
pointer into the schema (``#``, ``#/$defs/NAME``, ``#/properties/a/items``), and OpenAPI's
``nullable``. Annotations are ignored (title, description, default, examples, $schema,
$id, $anchor, $comment, deprecated, readOnly, writeOnly, contentEncoding, contentMediaType,
contentSchema, OpenAPI's discriminator, example, externalDocs and xml). String lengths
count characters as JSON Schema does: an escape is one, a surrogate pair of escapes one
(lone surrogate escapes are not generated).

A schema that accepts nothing (``false``, or ``{"not": {}}`` as zod writes for never and
undefined) leaves out an optional member it values. ``not`` of types, of values where the
schema's are few, or of bounds (a number below a minimum, a string longer than a
maxLength), is folded into them (engine/json_not.py); any other is refused.

Refused: a recursive ``$ref`` whose every instance nests deeper than ``RECURSION_DEPTH``
(a required member leading back to it), schemas joined that cannot be merged exactly, a
``oneOf`` whose schemas may overlap, keywords beside ``enum``/``const`` other than ``type``
(their intersection), lengths beside a ``format`` that some of its texts do not meet,
lengths and counts above ``MAX_COUNT``, unsatisfiable schemas (``false``, empty ranges)
and every other keyword (``unevaluatedProperties`` ...), and a schema whose compile passes
its work budget (engine/compile_budget.py: its nodes, the regex they write and the automata
built on the way, counted). A recursive $ref's regex depends on nothing but how many times
each $ref is open around it, so it is compiled once per such state (``_Compiler.expansions``).
"""
from __future__ import annotations

import json
from collections import Counter
from typing import Any
from urllib.parse import unquote

from engine.compile_budget import CompileBudget
from engine.json_all_of import merge_all_of
from engine.json_formats import FORMATS, format_regex, format_type, int_format_bounds
from engine.json_conditional import conditional
from engine.json_contains import contains_items
from engine.json_enum import values_meeting
from engine.json_multiples import integer_multiples, multiple_of, number_multiples
from engine.json_not import without_not
from engine.json_numbers import int_bounds, int_range, number_range
from engine.json_objects import ObjectRules
from engine.json_one_of import check_exclusive
from engine.json_schema_checks import (IGNORED, MAX_REGEX_CHARS, TYPES, Cut, Unsatisfiable, at,
                                       bounded, count, equality_key, never, uncut, within)
from engine.json_string_pattern import pattern_string_regex
from engine.json_text_regex import (CHAR, MAX_SCHEMA_DEPTH, any_value, array_items, json_types,
                                     literal, object_members)
from engine.json_whitespace import Punctuation
from engine.regex_dfa import MAX_BUILD_STEPS, RegexDfa, TooManySteps, build_nfa
from engine.regex_parse import parse
from engine.regex_text import alt, repeat

ANY_DEPTH = 2  # arrays/objects an unconstrained value may nest
RECURSION_DEPTH = 3  # times a recursive $ref is followed inside itself

# The keywords that constrain one type, and the type a schema without "type" is taken for.
_TYPE_KEYWORDS = {
    "minLength": "string", "maxLength": "string", "format": "string", "pattern": "string",
    "minimum": "integer", "maximum": "integer",
    "exclusiveMinimum": "integer", "exclusiveMaximum": "integer", "multipleOf": "integer",
    "properties": "object", "required": "object", "additionalProperties": "object",
    "items": "array", "prefixItems": "array", "additionalItems": "array", "minItems": "array",
    "maxItems": "array",
    "minProperties": "object", "maxProperties": "object", "uniqueItems": "array",
    "propertyNames": "object", "patternProperties": "object", "dependentRequired": "object",
    "dependentSchemas": "object", "dependencies": "object", "contains": "array",
    "minContains": "array", "maxContains": "array",
}
_COMBINATORS = ("$ref", "allOf", "anyOf", "oneOf", "enum", "const")
_KNOWN = IGNORED | set(_TYPE_KEYWORDS) | set(_COMBINATORS) | {"type", "nullable"}


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


class _Compiler(ObjectRules):
    any_depth = ANY_DEPTH

    def __init__(self, root: Any, punct: Punctuation):
        self.root = root
        self.p = punct
        self.refs: dict[str, str] = {}  # each $ref compiled once, unless it recursed
        self.expanding: list[str] = ["#"]  # the $refs being compiled ("#": the root)
        self.reentries = 0  # $refs met inside their own expansion so far
        # A $ref that recursed, by how many times each $ref is open around it: all its regex
        # depends on. Without this, {"anyOf": [{"$ref": "#"}, ...40 times]} was expanded
        # 40^4 times.
        self.expansions: dict[tuple, str | Cut] = {}
        self.budget = CompileBudget()  # engine/compile_budget.py
        self.automata: dict[str, RegexDfa] = {}  # built while compiling (enums, names)
        # The kinds of value each $ref's schema generates and accepts (engine/json_one_of.py).
        self.kinds_memo: dict = {}
        self.conditions = 0  # if/then/else compiled so far (engine/json_conditional.py)

    def node(self, s: Any, path: str, depth: int) -> str:
        self.budget.enter(path)
        rx = self.compile_node(s, path, depth)
        self.budget.produced(rx, path)
        return rx

    def compile_node(self, s: Any, path: str, depth: int) -> str:
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"the schema at {path} nests deeper than {MAX_SCHEMA_DEPTH}")
        if s is True:
            return any_value(ANY_DEPTH, self.p)
        if never(s):
            raise ValueError(f"the schema at {path} is false: no value is valid")
        if not isinstance(s, dict):
            raise ValueError(f"the schema at {path} is a {type(s).__name__}, "
                             "not an object or a boolean")
        if "if" in s or "then" in s or "else" in s:  # engine/json_conditional.py
            return conditional(self, s, path, depth)
        if "not" in s:
            s = without_not(self, s, path)
            if s is False:
                raise Unsatisfiable(f"the schema at {path} leaves no value once its 'not' "
                                    "leaves its values out")
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
        except Cut:
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
        constrained = any(k in _TYPE_KEYWORDS or k == "type" for k in s)
        joins = kw in ("$ref", "allOf", "anyOf", "oneOf") and (
            len(combinators) > 1 or constrained
            or isinstance(s.get("allOf"), list) and len(s["allOf"]) > 1)
        if joins:  # several schemas at once: merged into one (nullable stays the caller's)
            merged = merge_all_of([{k: v for k, v in s.items() if k != "nullable"}], path,
                                  self.target)
            if merged is False:
                raise Unsatisfiable(f"the schemas joined at {path} exclude each other: no "
                                    "value is valid")
            return self.node(merged, path, depth + 1)
        if len(combinators) > 1:
            raise ValueError(f"{kw!r} and {combinators[1]!r} together at {path} "
                             "are not supported")
        where = at(path, kw)
        if kw in ("enum", "const"):  # narrowed by the keywords beside it (engine/json_enum.py)
            values = [s["const"]] if kw == "const" else s["enum"]
            if not isinstance(values, list):
                raise ValueError(f"'enum' at {path} must be an array")
            types = self.types(s, path) if "type" in s else TYPES
            kept = [v for v in values if json_types(v, where) & set(types)]
            if not kept:
                raise ValueError(f"{kw!r} at {path} leaves no value of the schema's type")
            keywords = {k: v for k, v in s.items() if k in _TYPE_KEYWORDS or k == "type"}
            kept = values_meeting(self, kw, kept, keywords, path, depth)
            if not kept:
                raise ValueError(f"no value of {kw!r} at {path} meets the keywords beside it")
            return alt(bounded((literal(v, where, depth, self.p) for v in kept), path))
        if kw == "$ref":
            return self.ref(s["$ref"], path, depth)
        branches = s[kw]
        if not isinstance(branches, list) or not branches:
            raise ValueError(f"{kw!r} at {path} must be a non-empty array of schemas")
        if kw == "oneOf":
            check_exclusive(branches, path, self)
        return alt(bounded(uncut(lambda i: self.node(branches[i], at(where, i), depth + 1),
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
                raise Cut(f"'$ref' {ref!r} at {path} is recursive, and no instance of it "
                          f"ends within {RECURSION_DEPTH} levels of itself (a required "
                          "member or item leads back to it at every level)")
        key = (ref, tuple(sorted(Counter(self.expanding).items())))
        if key in self.expansions:
            # It recursed: what holds it depends on the stack too (as when it was compiled).
            self.reentries += 1
            found = self.expansions[key]
            if isinstance(found, Cut):  # (its traceback dropped: it would grow each raise)
                raise found.with_traceback(None)
            return found
        before = self.reentries
        self.expanding.append(ref)
        try:
            rx = self.node(target, ref, depth + 1)
        except Cut as e:  # (always after a reentry)
            self.expansions[key] = e
            raise
        finally:
            self.expanding.pop()
        if self.reentries == before:  # no recursion below: the same wherever it is met
            self.refs[ref] = rx
        else:
            self.expansions[key] = rx
        return rx

    def automaton(self, regex: str, path: str) -> RegexDfa:
        """``regex``'s automaton, its build paid from the compile's budget."""
        dfa = self.automata.get(regex)
        if dfa is None:
            left = self.budget.left
            try:
                dfa = RegexDfa(build_nfa(parse(regex)), min(left, MAX_BUILD_STEPS))
            except TooManySteps:
                if left < MAX_BUILD_STEPS:  # the compile's budget ran out, not the build's
                    self.budget.refuse(path)
                raise
            self.budget.spend(dfa.build_steps, path)
            self.automata[regex] = dfa
        return dfa

    def target(self, ref: str, path: str) -> Any:
        """The schema ``ref`` points to: a JSON pointer into this schema ("#" the root,
        "#/$defs/NAME", or any path, as zod-to-json-schema writes for a schema used twice)."""
        if ref == "#":
            return self.root
        if not ref.startswith("#/"):
            raise ValueError(f"'$ref' {ref!r} at {path} is not supported: only references "
                             "into the schema itself ('#', '#/$defs/NAME', '#/...') are")
        found = self.root
        for part in ref[2:].split("/"):
            key = unquote(part).replace("~1", "/").replace("~0", "~")
            if isinstance(found, dict) and key in found:
                found = found[key]
            elif isinstance(found, list) and key.isdecimal() and key == str(int(key)) and \
                    int(key) < len(found):
                found = found[int(key)]
            else:
                raise ValueError(f"'$ref' {ref!r} at {path} points to no schema")
        return found

    def resolved(self, s: Any, path: str) -> Any:
        """``s``, or the schema its chain of bare $refs ends at (a cycle of them ends at the
        depth limit)."""
        for _ in range(MAX_SCHEMA_DEPTH):
            if not isinstance(s, dict) or set(s) - IGNORED != {"$ref"}:
                break
            s = self.target(s["$ref"], path)
        return s

    def types(self, s: dict, path: str) -> list[str]:
        t = s.get("type")
        if t is None:  # taken from the keywords; none at all: any value
            return list(dict.fromkeys(format_type(s[k], path) if k == "format" else
                                      _TYPE_KEYWORDS[k] for k in s if k in _TYPE_KEYWORDS))
        types = [t] if isinstance(t, str) else t
        if not isinstance(types, list) or not types or \
                any(not isinstance(x, str) or x not in TYPES for x in types):
            raise ValueError(f"'type' at {path} must be one of {', '.join(TYPES)} "
                             "or a non-empty array of them")
        return list(dict.fromkeys(types))

    def typed(self, s: dict, path: str, depth: int) -> str:
        if "format" in s:
            format_type(s["format"], path)
        types = self.types(s, path)
        if not types:
            return any_value(ANY_DEPTH, self.p)
        return alt(uncut(lambda i: self.one_type(types[i], s, path, depth), len(types)))

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
        lo, hi = count(s, "minLength", path, 0), count(s, "maxLength", path, None)
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
        prefix_kw, items_kw = "prefixItems", "items"
        if not isinstance(prefix, list):
            raise ValueError(f"'prefixItems' at {path} must be an array of schemas")
        if isinstance(items, list):  # draft 7's tuple: the items after it are additionalItems
            if "prefixItems" in s:
                raise ValueError(f"'items' at {path} is an array beside 'prefixItems'")
            prefix, items = items, s.get("additionalItems", True)
            prefix_kw, items_kw = "items", "additionalItems"
        lo, hi = count(s, "minItems", path, 0), count(s, "maxItems", path, None)
        if items is False:  # nothing after the prefix
            hi = len(prefix) if hi is None else min(hi, len(prefix))
        if hi is not None and lo > hi:
            raise ValueError(f"'minItems' at {path} asks for more items than the schema allows")
        if "contains" in s:  # engine/json_contains.py
            run = contains_items(self, s, prefix, items, lo, hi, path, depth)
            if run is not None:
                return f"{self.p.open_array}{run}{self.p.close_array}"
        unique = s.get("uniqueItems", False)
        if not isinstance(unique, bool):
            raise ValueError(f"'uniqueItems' at {path} must be true or false")
        if unique and (hi is None or hi > 1):  # (one item at most is always unique)
            return self.unique_items(prefix, items, lo, hi, path, depth)
        firsts, rest, total = [], None, 0
        try:  # a recursion cut at an item: the array ends before it, if it may
            for i, p in enumerate(prefix if hi is None else prefix[:hi]):
                firsts.append(self.node(p, at(at(path, prefix_kw), i), depth + 1))
                total = within(total + len(firsts[-1]), path)
            if items is not False and (hi is None or hi > len(prefix)):
                rest = self.node(items, at(path, items_kw), depth + 1)
        except Cut:
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
            self.finite_values(items, at(path, "items"), depth + 1)
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
        s = self.resolved(s, path)
        if not isinstance(s, dict) or not isinstance(s.get("type", ""), (str, list)):
            return None
        keys = set(s) - IGNORED
        if keys <= {"enum", "type"} and "enum" in s or keys <= {"const", "type"} and "const" in s:
            values = s["enum"] if "enum" in s else [s["const"]]
            if not isinstance(values, list):
                return None
            types = self.types(s, path) if "type" in s else TYPES
            values = [v for v in values if json_types(v, path) & set(types)]
        elif keys == {"type"} and s["type"] in ("boolean", "null"):
            values = [True, False] if s["type"] == "boolean" else [None]
        else:
            return None
        distinct, seen = [], set()
        for v in values:
            literal(v, path, depth, self.p)  # what is not JSON (NaN, Infinity) refused first
            key = equality_key(v)
            if key not in seen:
                seen.add(key)
                distinct.append(v)
        return distinct or None
