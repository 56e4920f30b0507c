"""``not`` of bounds for engine/json_not.py: ``{"not": {"minimum": 18}}`` is a number below 18.

A bound constrains only its own type ({"minimum": 18} takes every string), so what its ``not``
leaves is that type with the bound turned over: minimum 18 becomes exclusiveMaximum 18,
minLength 3 becomes maxLength 2, maxItems 4 becomes minItems 5. Several bounds, and a
``type`` beside them, are left by failing any one of them: the values of the types ``type``
leaves out (engine/json_not.py's rule for types), or those of a bound's type past it. Each
way is joined with the rest of the schema, and the ways are its anyOf, so this takes the
condition of an if/then/else such as ``"if": {"properties": {"age": {"minimum": 18}}}``.
"""
from __future__ import annotations

import math
from typing import Any

from engine.json_all_of import merge_all_of
from engine.json_numbers import draft4_bounds, int_bounds, number_range
from engine.json_schema_checks import IGNORED, Unsatisfiable, at

# Each bound, the type it constrains, and the bound that leaves what it refuses: (keyword,
# value as a function of the bound's).
_TURNED = {
    "minimum": ("number", "exclusiveMaximum", lambda v: v),
    "exclusiveMinimum": ("number", "maximum", lambda v: v),
    "maximum": ("number", "exclusiveMinimum", lambda v: v),
    "exclusiveMaximum": ("number", "minimum", lambda v: v),
    "minLength": ("string", "maxLength", lambda n: n - 1),
    "maxLength": ("string", "minLength", lambda n: n + 1),
    "minItems": ("array", "maxItems", lambda n: n - 1),
    "maxItems": ("array", "minItems", lambda n: n + 1),
}
BOUNDS = frozenset(_TURNED)


def is_bounds(inner: Any) -> bool:
    """Whether ``inner`` (a ``not``'s schema) is bounds, with at most a ``type`` beside."""
    if not isinstance(inner, dict):
        return False
    keys = set(draft4_bounds(inner)) - IGNORED
    return bool(keys & BOUNDS) and keys <= BOUNDS | {"type"}


def without_bounds(c, rest: dict, inner: dict, path: str, without_types) -> Any:
    """``rest`` without what ``inner`` (bounds, with a type or not) takes: a schema, or False
    when nothing is left. ``without_types(c, rest, types, path)`` is engine/json_not.py's
    ``rest`` without values of ``types``."""
    where = at(path, "not")
    inner = draft4_bounds(inner)
    types = c.types(inner, where) if "type" in inner else None
    ways = []
    if types is not None:  # a value of another type fails inner
        left = without_types(c, rest, set(types), path)
        if left is not False:
            ways.append(left)
    # A value of the bound's type past it (never null: the merge keeps OpenAPI's nullable
    # only where every schema joined has it).
    for kw in sorted(set(inner) & BOUNDS):
        kind, turned, value = _TURNED[kw]
        bound = _checked(kw, inner[kw], kind, where)
        if turned.startswith("max") and kind != "number" and bound == 0:
            continue  # every string or array has at least 0 characters or items
        if types is not None and kind not in types and \
                not (kind == "number" and "integer" in types):
            continue  # the type refuses such values: the way above has them already
        way = merge_all_of([rest, {"type": kind, turned: value(bound)}], path, c.target)
        if way is not False and not _leaves_none(way, path):
            ways.append(way)
    if not ways:
        return False
    return ways[0] if len(ways) == 1 else {"anyOf": ways}


def _leaves_none(way: Any, path: str) -> bool:
    """Whether a way's bounds leave no value: the bound turned over, past one of rest's. Such
    a way is left out, where the compiler would refuse a schema of it."""
    if not isinstance(way, dict) or set(way) & {"anyOf", "oneOf", "allOf", "$ref", "enum",
                                                "const", "not", "if"}:
        return False
    kind = way.get("type")
    if isinstance(kind, list):
        kind = kind[0] if len(kind) == 1 else None
    try:
        if kind == "integer":
            int_bounds(way, path)
        elif kind == "number":
            number_range(way, path)
    except Unsatisfiable:
        return True
    lengths = {"string": ("minLength", "maxLength"), "array": ("minItems", "maxItems")}
    if kind in lengths:
        lo, hi = (way.get(kw) for kw in lengths[kind])
        return isinstance(lo, int) and isinstance(hi, int) and lo > hi
    return False


def _checked(kw: str, bound: Any, kind: str, where: str) -> int | float:
    if isinstance(bound, bool) or not isinstance(bound, (int, float)) or \
            isinstance(bound, float) and not math.isfinite(bound):
        raise ValueError(f"{kw!r} at {where} must be a finite number")
    if kind != "number" and (not isinstance(bound, int) or bound < 0):
        raise ValueError(f"{kw!r} at {where} must be a non-negative integer")
    return bound
