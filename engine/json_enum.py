"""An enum's or a const's values that meet the keywords beside them, for
engine/json_schema_regex.py's compiler.

``{"type": "string", "enum": ["a", "bb"], "maxLength": 1}`` allows "a" only, as OpenAPI
documents write it (an enum of codes beside the string's own rules). Each value's JSON text
is matched against the regex of the schema without the enum, on the engine's own automaton
(the same reading every generated text gets, in linear time whatever a pattern says); the
value is kept when it matches. A keyword constrains only its own type, as in JSON Schema: a
number in ``{"enum": ["ab", 5], "maxLength": 1}`` is kept whatever maxLength says, unless a
``type`` beside them leaves it out. Only scalar values are checked: an array's or an object's
text in the regex depends on the whitespace and member order the regex spells, so those are
refused beside such keywords.
"""
from __future__ import annotations

import json
from typing import Any

from engine.json_text_regex import json_types
from engine.regex_dfa import RegexDfa


def values_meeting(compiler, kw: str, values: list, keywords: dict, path: str,
                   depth: int) -> list:
    """The ``values`` (of the schema's ``kw``, already narrowed by ``type``) that
    ``keywords`` (the schema's type-specific ones, and its ``type``) allow."""
    constraining = [k for k in keywords if k != "type"]
    if not constraining:
        return values
    for v in values:
        if isinstance(v, (list, dict)):
            raise ValueError(f"{constraining[0]!r} beside {kw!r} at {path} is supported for "
                             "string, number, boolean and null values only")
    automata: dict[str, RegexDfa] = {}
    kept = []
    for v in values:
        # Checked as its own type: the keywords of other types say nothing of it (the
        # compiler reads {"maxLength": 1, "type": "number"} as any number), unless the
        # schema's type says otherwise.
        mine = json_types(v, path)
        kind = "typed" if "type" in keywords else "integer" if "integer" in mine \
            else next(iter(mine))
        if kind not in automata:
            rest = keywords if kind == "typed" else {**keywords, "type": kind}
            automata[kind] = compiler.automaton(compiler.node(rest, path, depth + 1), path)
        if any(automata[kind].fullmatch(text) for text in _spellings(v)):
            kept.append(v)
    return kept


def _spellings(v: Any) -> list[str]:
    """``v``'s JSON texts: json.dumps's, and an integral number's both with and without a
    fraction (1.0 is an integer to JSON Schema, which an integer's regex spells 1; a
    fraction's multiples spell 3 as 3.0)."""
    text = json.dumps(v, ensure_ascii=False)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return [text]
    if isinstance(v, int):
        return [text, text + ".0"]
    return [text, json.dumps(int(v))] if v.is_integer() else [text]
