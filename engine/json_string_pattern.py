"""JSON Schema's ``pattern`` for ``guided_json``: the regex of the JSON string literals whose
value the pattern matches.

A schema's pattern is matched against the decoded string, anywhere in it (a search: only
``^`` and ``$`` tie it to the ends), while the guide matches the JSON text. So the pattern is
parsed (engine/regex_parse.py: Python ``re``'s syntax, ASCII ``\\d \\w \\s``; anchors only at the
ends of a top-level alternative, as JSON Schema's patterns are usually written) and written
again, character set by character set, over the text of a JSON string: a character that may
stand raw stands raw, and a quote, a backslash or a control character stands as ``json.dumps``
escapes it. Each character thus has one spelling where the pattern constrains it (non-ASCII
raw, as without ``ensure_ascii``); an unanchored end may be any JSON string characters,
escapes included. Surrogate code points cannot be in the text at all (UTF-8 has no spelling
for them), so a pattern that needs one is refused.

An alternative anchored at neither end, like the pattern ``ab``, is ``"<any>ab<any>"``; with
``^...$`` around it, exactly ``"ab"``; in ``^a|b$`` each alternative keeps its own anchor.
"""
from __future__ import annotations

import json

from engine.regex_parse import (MAX_CODE_POINT, Alt, Alternative, Chars, Concat, Node, Ranges,
                                Repeat, negate, normalize, parse_alternatives)

# Code points that may stand raw in a JSON string: not a control character, a quote, a
# backslash or a surrogate.
_RAW: Ranges = ((0x20, 0x21), (0x23, 0x5B), (0x5D, 0xD7FF), (0xE000, MAX_CODE_POINT))
# Those that must be escaped, with the escape json.dumps writes.
_ESCAPED = [c for c in range(0x20)] + [0x22, 0x5C]


def pattern_string_regex(pattern: object, any_char: str, path: str) -> str:
    """The regex of the JSON string literals (quotes included) whose value ``pattern``
    matches somewhere; ``any_char`` is the regex of one JSON string character, for the ends
    the pattern leaves open. ValueError, naming ``path``, for a pattern that is not a
    string, not supported, or needs a character no JSON text holds."""
    if not isinstance(pattern, str):
        raise ValueError(f"'pattern' at {path} must be a string")
    try:
        branches = [_branch(alt, any_char) for alt in parse_alternatives(pattern)]
    except ValueError as e:
        raise ValueError(f"'pattern' at {path}: {e}") from None
    inner = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
    return f'"{inner}"'


def _branch(alt: Alternative, any_char: str) -> str:
    free = f"(?:{any_char})*"
    return ("" if alt.starts else free) + _regex(alt.node) + ("" if alt.ends else free)


def _regex(node: Node) -> str:
    """``node``'s language with every character as a JSON string spells it."""
    if isinstance(node, Chars):
        return _chars(node.ranges)
    if isinstance(node, Concat):
        return "".join(_regex(item) for item in node.items)
    if isinstance(node, Alt):
        return "(?:" + "|".join(_regex(item) for item in node.items) + ")"
    inner = _regex(node.item)
    if not inner:
        return ""
    return f"(?:{inner}){_quantifier(node)}"


def _quantifier(node: Repeat) -> str:
    lo, hi = node.lo, node.hi
    if hi is None:
        return {0: "*", 1: "+"}.get(lo, f"{{{lo},}}")
    if (lo, hi) == (0, 1):
        return "?"
    return f"{{{lo}}}" if lo == hi else f"{{{lo},{hi}}}"


def _chars(ranges: Ranges) -> str:
    raw = _intersect(ranges, _RAW)
    parts = [_class(raw)] if raw else []
    parts += [_literal(json.dumps(chr(c))[1:-1]) for c in _ESCAPED if _member(ranges, c)]
    if not parts:
        raise ValueError("it needs a character a JSON text cannot hold (a surrogate code "
                         "point)")
    return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"


def _intersect(a: Ranges, b: Ranges) -> Ranges:
    return negate(normalize(negate(a) + negate(b)))


def _member(ranges: Ranges, c: int) -> bool:
    return any(lo <= c <= hi for lo, hi in ranges)


def _class(ranges: Ranges) -> str:
    if len(ranges) == 1 and ranges[0][0] == ranges[0][1]:
        return _code(ranges[0][0])
    return "[" + "".join(_code(lo) if lo == hi else f"{_code(lo)}-{_code(hi)}"
                         for lo, hi in ranges) + "]"


def _literal(text: str) -> str:
    return "".join(_code(ord(c)) for c in text)


def _code(cp: int) -> str:
    """One code point as a regex atom (also inside a class): ASCII letters and digits as
    themselves, the rest by number, so no character is ever taken for syntax."""
    if cp < 0x80 and chr(cp).isalnum():
        return chr(cp)
    return f"\\u{cp:04x}" if cp <= 0xFFFF else f"\\U{cp:08x}"
