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

from engine.pattern_lengths import fit_lengths
from engine.regex_parse import (MAX_CODE_POINT, Alt, Alternative, Chars, Concat, Node, Ranges,
                                Repeat, negate, normalize, parse_alternatives)
from engine.regex_text import repeat

# Code points that may stand raw in a JSON string: not a control character, a quote, a
# backslash or a surrogate.
_RAW: Ranges = ((0x20, 0x21), (0x23, 0x5B), (0x5D, 0xD7FF), (0xE000, MAX_CODE_POINT))
# Those that must be escaped, with the escape json.dumps writes.
_ESCAPED = [c for c in range(0x20)] + [0x22, 0x5C]


def pattern_string_regex(pattern: object, any_char: str, path: str, min_length: int = 0,
                         max_length: int | None = None) -> str:
    """The regex of the JSON string literals (quotes included) whose value ``pattern``
    matches somewhere; ``any_char`` is the regex of one JSON string character, for the ends
    the pattern leaves open. With lengths, some of those values min_length..max_length
    characters long (engine/pattern_lengths.py). ValueError, naming ``path``, for a pattern
    that is not a string, not supported, or needs a character no JSON text holds, and for
    lengths this finds no value within."""
    if not isinstance(pattern, str):
        raise ValueError(f"'pattern' at {path} must be a string")
    try:
        alternatives = parse_alternatives(pattern)
        if min_length or max_length is not None:
            branches = _fitted(alternatives, min_length, max_length, path)
        else:
            branches = [_branch(alt, any_char) for alt in alternatives]
    except _NoFit as e:
        raise ValueError(str(e)) from None
    except ValueError as e:
        raise ValueError(f"'pattern' at {path}: {e}") from None
    inner = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
    return f'"{inner}"'


def _branch(alt: Alternative, any_char: str) -> str:
    free = f"(?:{any_char})*"
    return ("" if alt.starts else free) + _regex(alt.node) + ("" if alt.ends else free)


class _NoFit(ValueError):
    pass


# Any character a JSON string holds, for an open end under lengths: one spelling each.
_ANY = Chars(((0, 0xD7FF), (0xE000, MAX_CODE_POINT)))


def _fitted(alternatives: list[Alternative], lo: int, hi: int | None, path: str) -> list[str]:
    """Each alternative, its open ends as any characters, cut down to values lo..hi long."""
    branches = []
    for alt in alternatives:
        free = [] if alt.starts else [Repeat(_ANY, 0, None)]
        tree = Concat(tuple(free + [alt.node] + ([] if alt.ends else [Repeat(_ANY, 0, None)])))
        fitted = fit_lengths(tree, lo, hi)
        if fitted is not None:
            branches.append(_regex(fitted))
    if not branches:
        span = f"{lo}..{'' if hi is None else hi}"
        raise _NoFit(f"'pattern' at {path} has no match {span} characters long that this finds "
                     "(write the bound into the pattern)")
    return branches


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
    # Counts over MAX_REPEAT (a fitted maxLength) split as the automaton compiler needs.
    return repeat(inner, node.lo, node.hi)


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
