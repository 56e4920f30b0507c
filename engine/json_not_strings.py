"""``not`` of some strings beside a plain string schema, for engine/json_not.py:
``{"type": "string", "not": {"const": "US"}}`` is any string but "US", as a ``pattern``
the compiler already spells in every JSON escape (engine/json_string_pattern.py matches the
decoded characters, so "\\u0055S" is "US" there too).

The pattern is the complement of the words, walked on their trie: at each node the string
may end (unless the node is a word), go on with a character no word goes on with (then
anything), or follow a word's next character. Its size is the words' total length.
"""
from __future__ import annotations

from typing import Any

from engine.json_schema_checks import IGNORED

# Strings a "not" may leave out of a free string, and characters in each.
MAX_WORDS = 64
MAX_WORD_CHARS = 256
# The keywords of a string schema the complement may stand beside (a pattern or a format
# would have to be intersected with it).
_PLAIN_STRING = {"type", "minLength", "maxLength", "nullable"}
_ANY = r"[\s\S]"


def free_string(rest: dict) -> bool:
    """Whether ``rest`` is a string schema of no other rule than its lengths (its type
    "string", ["string"] as allOf's merge writes it, or implied by a length)."""
    if set(rest) - IGNORED - _PLAIN_STRING:
        return False
    if "type" in rest:
        return rest["type"] in ("string", ["string"])
    return "minLength" in rest or "maxLength" in rest


def without_strings(rest: dict, left_out: list[Any], path: str) -> dict:
    """``rest`` (a free string: free_string) without the strings among ``left_out``."""
    words = sorted({v for v in left_out if isinstance(v, str)})
    if not words:
        return rest
    if len(words) > MAX_WORDS or any(len(w) > MAX_WORD_CHARS for w in words):
        raise ValueError(f"'not' at {path} leaves out more than {MAX_WORDS} strings, or one "
                         f"of more than {MAX_WORD_CHARS} characters")
    trie: dict = {}
    for w in words:
        node = trie
        for ch in w:
            node = node.setdefault(ch, {})
        node[None] = {}  # a word ends here
    return {**rest, "pattern": f"^(?:{_complement(trie)})$"}


def _complement(node: dict) -> str:
    """The regex of the strings that are no word below ``node`` (its words' rest)."""
    chars = sorted(k for k in node if k is not None)
    options = [] if None in node else [""]
    if chars:
        options.append(f"[^{''.join(_literal(c) for c in chars)}]{_ANY}*")
    else:
        options.append(f"{_ANY}+")  # a word's end with none longer: one more character
    options += [_literal(c) + f"(?:{_complement(node[c])})" for c in chars]
    return "|".join(options)


def _literal(c: str) -> str:
    """``c`` in a regex, in or out of a class (what could be syntax is a hex escape)."""
    if c.isalnum() or c in " _,:;'\"=!@#%&~`<>/":
        return c
    return f"\\x{ord(c):02x}" if ord(c) < 0x100 else \
        f"\\u{ord(c):04x}" if ord(c) < 0x10000 else f"\\U{ord(c):08x}"
