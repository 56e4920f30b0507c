"""The regexes of JSON texts' pieces, for engine/json_schema_regex.py: a string's character,
a value written as json.dumps writes it, a value of any type, an object's members and an
array's items, with the whitespace a Punctuation allows around the punctuation."""
from __future__ import annotations

import functools
import json
import math
from typing import Any

from engine.json_numbers import NUMBER
from engine.json_whitespace import Punctuation
from engine.regex_text import alt, repeat

MAX_SCHEMA_DEPTH = 64  # schema (and enum value) nesting, against stack exhaustion
_META = set(".^$*+?{}[]\\|()")

_HEX = "[0-9a-fA-F]"
# One character of a JSON string: a raw one (no quote, backslash, control or lone
# surrogate), a short escape, a \u escape of a non-surrogate, or a surrogate pair.
CHAR = ('(?:[^"\\\\\\u0000-\\u001f\\ud800-\\udfff]|\\\\["\\\\/bfnrt]'
        f"|\\\\u(?:[0-9a-cA-Ce-fE-F]{_HEX}{{3}}|[dD][0-7]{_HEX}{{2}})"
        f"|\\\\u[dD][89abAB]{_HEX}{{2}}\\\\u[dD][c-fC-F]{_HEX}{{2}})")
STRING = f'"{CHAR}*"'


def object_members(members: list[tuple[str, bool]], comma: str, nonempty: bool = False) -> str:
    """The members in order, each required one present, commas between those present.

    Built left to right as (seq, may_be_empty), seq matching the non-empty runs so far:
    one copy of seq per step keeps the regex linear in the members (an alternation per
    "first member present" would be quadratic)."""
    seq, may_be_empty = None, True
    for member, required in members:
        if seq is None:
            seq, may_be_empty = member, not required
        elif required:
            seq = f"(?:{seq}{comma})?{member}" if may_be_empty else f"{seq}{comma}{member}"
            may_be_empty = False
        else:
            after = f"{seq}(?:{comma}{member})?"
            seq = f"(?:{after}|{member})" if may_be_empty else after
    if seq is None:
        return ""
    return f"(?:{seq})?" if may_be_empty and not nonempty else seq


def array_items(firsts: list[str], rest: str | None, lo: int, hi: int | None,
              comma: str) -> str:
    """Array items: firsts[0], firsts[1], ..., then rest repeated, lo..hi items in all.

    Built from the back: an item past the first lo wraps, optional, everything after it,
    so the items present are always a leading run."""
    k = len(firsts)
    if hi == 0:
        return ""
    if not k:
        run = rest + repeat(comma + rest, max(lo - 1, 0), None if hi is None else hi - 1)
        return run if lo else f"(?:{run})?"
    tail = ""
    if rest is not None and (hi is None or hi > k):
        tail = repeat(comma + rest, max(lo - k, 0), None if hi is None else hi - k)
    for i in range(min(k, hi if hi is not None else k) - 1, -1, -1):
        item = ("" if i == 0 else comma) + firsts[i] + tail
        tail = item if i < lo else f"(?:{item})?"
    return tail


def _escape(text: str) -> str:
    return "".join("\\" + c if c in _META else f"\\u{ord(c):04x}" if c < " " or c == "\x7f"
                   else c for c in text)


def literal(value: Any, path: str, depth: int, p: Punctuation) -> str:
    """The regex of ``value``'s JSON text, with the whitespace ``p`` allows."""
    if depth > MAX_SCHEMA_DEPTH:
        raise ValueError(f"a value at {path} nests deeper than {MAX_SCHEMA_DEPTH}")
    if value is None or isinstance(value, (bool, int)):
        return json.dumps(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"the value {value} at {path} is not a JSON number")
        return _escape(json.dumps(value))
    if isinstance(value, str):
        return '"' + "".join(_string_char(c) for c in value) + '"'
    if isinstance(value, list):
        return p.open_array + p.comma.join(literal(v, path, depth + 1, p)
                                           for v in value) + p.close_array
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return p.open_object + p.comma.join(literal(k, path, depth, p) + p.colon
                                            + literal(v, path, depth + 1, p)
                                            for k, v in value.items()) + p.close_object
    raise ValueError(f"the value at {path} is not JSON: {type(value).__name__}")


def _string_char(c: str) -> str:
    escaped = _escape(json.dumps(c)[1:-1])  # as ensure_ascii writes it
    if c.isascii() or "\ud800" <= c <= "\udfff":
        return escaped
    return f"(?:{c}|{escaped})"  # without ensure_ascii: the character itself


def json_types(value: Any, path: str) -> set[str]:
    """The schema types ``value`` has (an integral number is both integer and number)."""
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int) or isinstance(value, float) and value.is_integer():
        return {"integer", "number"}
    if isinstance(value, float):
        return {"number"}
    found = {str: "string", list: "array", dict: "object"}.get(type(value))
    if found is None:
        raise ValueError(f"the value at {path} is not JSON: {type(value).__name__}")
    return {found}


@functools.lru_cache(maxsize=16)
def any_value(depth: int, p: Punctuation) -> str:
    scalar = [STRING, NUMBER, "true", "false", "null"]
    if not depth:
        return alt(scalar)
    inner = any_value(depth - 1, p)
    return alt(scalar + [f"{p.open_array}(?:{inner}(?:{p.comma}{inner})*)?{p.close_array}",
                          map_object(inner, p)])


def map_object(value: str, p: Punctuation, least: int = 0, most: int | None = None,
               key: str = STRING) -> str:
    """An object of least..most members (most >= 1) whose names match ``key`` and values
    ``value``."""
    member = f"{key}{p.colon}{value}"
    run = member + repeat(p.comma + member, max(least - 1, 0), None if most is None else most - 1)
    return f"{p.open_object}{run if least else f'(?:{run})?'}{p.close_object}"
