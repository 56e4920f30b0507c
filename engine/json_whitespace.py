"""JSON's whitespace under guided_json: ``guided_whitespace_pattern`` (vLLM's), a regex of
the whitespace allowed on both sides of every comma, colon and bracket, checked to match JSON
whitespace only; and the punctuation regexes engine/json_schema_regex.py builds with it."""
from __future__ import annotations

from dataclasses import dataclass

from engine.regex_parse import Chars, Node, Repeat, parse_alternatives

# JSON's whitespace (RFC 8259): tab, line feed, carriage return and space.
_JSON_WHITESPACE = ((9, 10), (13, 13), (32, 32))
MAX_WHITESPACE_PATTERN_CHARS = 256


def check_whitespace_pattern(pattern: object) -> None:
    """ValueError unless ``pattern`` is a regex (engine/regex_parse.py's syntax) whose
    matches are JSON whitespace only: anything else between JSON's tokens is not JSON."""
    name = "guided_whitespace_pattern"
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"{name} must be a non-empty string, got {pattern!r}")
    if len(pattern) > MAX_WHITESPACE_PATTERN_CHARS:
        raise ValueError(f"{name} has {len(pattern)} characters, more than "
                         f"{MAX_WHITESPACE_PATTERN_CHARS}")
    try:
        alternatives = parse_alternatives(pattern)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    if any(a.starts or a.ends for a in alternatives):
        raise ValueError(f"{name} takes no anchors: it matches between JSON's tokens")
    stack: list[Node] = [a.node for a in alternatives]
    while stack:
        node = stack.pop()
        if isinstance(node, Chars):
            if any(not any(a <= lo and hi <= b for a, b in _JSON_WHITESPACE)
                   for lo, hi in node.ranges):
                raise ValueError(f"{name} matches characters other than JSON's whitespace "
                                 "(space, tab, line feed and carriage return)")
        elif isinstance(node, Repeat):
            stack.append(node.item)
        else:
            stack.extend(node.items)


@dataclass(frozen=True)
class Punctuation:
    """The regexes of JSON's punctuation with the whitespace allowed around it."""
    comma: str
    colon: str
    open_array: str
    close_array: str
    open_object: str
    close_object: str

    @staticmethod
    def around(whitespace: str | None) -> Punctuation:
        """json.dumps's separators (", " or ",", ": " or ":") when ``whitespace`` is None;
        else ``whitespace`` on both sides of every comma, colon and bracket inside."""
        if whitespace is None:
            return Punctuation(", ?", ": ?", "\\[", "\\]", "\\{", "\\}")
        w = f"(?:{whitespace})"
        return Punctuation(f"{w},{w}", f"{w}:{w}", f"\\[{w}", f"{w}\\]", f"\\{{{w}",
                           f"{w}\\}}")
