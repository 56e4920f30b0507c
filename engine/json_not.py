"""``not`` for engine/json_schema_regex.py, where it says what to leave out in terms the
rest of the schema can carry: types (``{"not": {"type": "null"}}``, anything but null), or
values of a schema whose values are few (``{"type": "boolean", "not": {"const": false}}``),
strings of a string schema with no rule but its lengths (engine/json_not_strings.py), or
bounds (``{"not": {"minimum": 18}}``, a number below 18: engine/json_not_bounds.py).
The schema is rewritten without it; any other ``not`` is refused.
"""
from __future__ import annotations

from typing import Any

from engine.json_not_bounds import is_bounds, without_bounds
from engine.json_not_strings import free_string, without_strings
from engine.json_schema_checks import IGNORED, TYPES, at, equality_key, is_open


def without_not(c, s: dict, path: str) -> Any:
    """``s`` with its ``not`` folded into its type or its values: a schema, or False when
    nothing is left. ``c`` is the compiler (its resolved, types and finite_values)."""
    where = at(path, "not")
    inner = c.resolved(s["not"], where)
    rest = {k: v for k, v in s.items() if k != "not"}
    if inner is False or is_open(inner):
        return rest if inner is False else False  # not false: no constraint; not {}: none
    if isinstance(inner, dict) and set(inner) - IGNORED == {"type"}:
        return _without_types(c, rest, set(c.types(inner, where)), path)
    if is_bounds(inner):  # engine/json_not_bounds.py
        return without_bounds(c, rest, inner, path, _without_types)
    left_out = c.finite_values(inner, where, 0)
    if left_out is not None and free_string(rest):  # engine/json_not_strings.py
        return without_strings(rest, left_out, path)
    kept = c.finite_values(rest, path, 0) if left_out is not None else None
    if kept is None:
        raise ValueError(f"'not' at {path} is supported for types to leave out, bounds "
                         "(minimum, maxLength, minItems ...), or values of a schema whose "
                         "values are few (an enum, a const, booleans)")
    keys = {equality_key(v) for v in left_out}
    kept = [v for v in kept if equality_key(v) not in keys]
    if not kept:
        return False
    out = {k: v for k, v in rest.items() if k in IGNORED}
    return {**out, "enum": kept}


def _without_types(c, rest: dict, excluded: set[str], path: str) -> Any:
    if "number" in excluded:
        excluded.add("integer")  # an integer is a number
    # Without "type", the types the keywords constrain, as the compiler takes them; where
    # "not" leaves none of those, the others (keywords constrain only their own types).
    types = c.types(rest, path) or list(TYPES)
    if "type" not in rest and not set(types) - excluded:
        types = list(TYPES)
    if "integer" in excluded and "number" in types and "number" not in excluded:
        raise ValueError(f"'not' at {path} leaves out integers but not numbers: a number "
                         "without the integers is not supported")
    kept = [t for t in types if t not in excluded]
    if not kept:  # OpenAPI's nullable is a type too
        return {"type": "null"} if rest.get("nullable") is True and "null" not in excluded \
            else False
    out = {**rest, "type": kept}
    if "null" in excluded:
        out.pop("nullable", None)
    return out
