"""What every node of engine/json_schema_regex.py's compiler shares: where it is (a JSON
pointer), a count keyword's value, the regex size budget, and the cut a recursion past its
depth raises."""
from __future__ import annotations

import math
from collections.abc import Iterable
from fractions import Fraction
from typing import Any

from engine.regex_parse import MAX_PATTERN_LENGTH

MAX_REGEX_CHARS = MAX_PATTERN_LENGTH  # the automaton compiler's limit
MAX_COUNT = 10_000  # minLength/maxLength/minItems/maxItems above this are refused
TYPES = ("null", "boolean", "integer", "number", "string", "array", "object")
# The keywords that constrain nothing (annotations, and where definitions are kept): the
# content* keywords are annotations since draft 2019-09 (zod writes contentEncoding for
# base64); example, externalDocs and xml are OpenAPI's.
IGNORED = frozenset({"title", "description", "default", "examples", "$schema", "$id",
                     "$comment", "deprecated", "readOnly", "writeOnly", "discriminator",
                     "$defs", "definitions", "$anchor", "contentEncoding", "contentMediaType",
                     "contentSchema", "example", "externalDocs", "xml"})


class Cut(ValueError):
    """A recursive $ref met past RECURSION_DEPTH: no value there. Whatever holds it gives
    it up where the schema lets it (an optional member, an item past minItems, an anyOf
    branch, null for a nullable) and raises it on otherwise; past the root, the schema has
    no instance within the depth."""


class Unsatisfiable(ValueError):
    """A schema no value meets (its joined schemas exclude each other, its ``not`` leaves
    nothing): an if/then/else variant that raises it is left out (engine/json_conditional.py),
    and anything else refuses the schema with it."""


def is_open(s: Any) -> bool:
    """Whether the schema ``s`` constrains nothing (true, or only annotations)."""
    return s is True or isinstance(s, dict) and not set(s) - IGNORED


def never(s: Any) -> bool:
    """Whether the schema ``s`` accepts no value: false, or ``{"not": {}}`` (zod's never
    and undefined)."""
    return s is False or isinstance(s, dict) and set(s) - IGNORED == {"not"} and \
        is_open(s["not"])


def uncut(compile_one, n: int) -> Iterable[str]:
    """``compile_one(i)`` for i in 0..n-1, leaving out those a recursion cut (alternatives:
    one left is enough); the first cut again when every one was."""
    first_cut, kept = None, 0
    for i in range(n):
        try:
            rx = compile_one(i)
        except Cut as e:
            first_cut = first_cut or e
            continue
        kept += 1
        yield rx
    if not kept:
        raise first_cut


def bounded(parts: Iterable[str], path: str) -> list[str]:
    """``parts``, stopping as soon as they are too long together: a schema repeating a
    big $ref a thousand times is refused before it takes memory."""
    out, total = [], 0
    for part in parts:
        total = within(total + len(part), path)
        out.append(part)
    return out


def within(total: int, path: str) -> int:
    """``total`` characters of regex so far, refused past MAX_REGEX_CHARS."""
    if total > MAX_REGEX_CHARS:
        raise ValueError(f"the schema at {path} needs a regex longer than "
                         f"{MAX_REGEX_CHARS} characters")
    return total


def count(s: dict, kw: str, path: str, default: int | None) -> int | None:
    """The value of the count keyword ``kw`` (minItems, maxLength, ...), ``default`` when
    absent."""
    if kw not in s:
        return default
    v = s[kw]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or \
            isinstance(v, float) and not v.is_integer():
        raise ValueError(f"{kw!r} at {path} must be a non-negative integer")
    if v > MAX_COUNT:
        raise ValueError(f"{kw!r} at {path} is above {MAX_COUNT}, the most supported")
    return int(v)


def at(path: str, key: str | int) -> str:
    """``path`` one step down, as a JSON pointer."""
    return f"{path}/{str(key).replace('~', '~0').replace('/', '~1')}"


def equality_key(value: Any) -> Any:
    """A key equal for JSON values JSON Schema takes for equal: 1 and 1.0 one number, true
    and 1 two values, objects whatever their members' order."""
    if isinstance(value, bool) or value is None:
        return ("literal", value)
    if isinstance(value, float) and not math.isfinite(value):  # not JSON: refused elsewhere
        return ("not a number", repr(value))
    if isinstance(value, (int, float)):
        return ("number", Fraction(value))
    if isinstance(value, list):
        return ("array", tuple(equality_key(v) for v in value))
    if isinstance(value, dict):
        return ("object", frozenset((k, equality_key(v)) for k, v in value.items()))
    return ("string", value)
