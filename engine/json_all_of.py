"""``allOf`` for engine/json_schema_regex.py: its schemas merged into one whose instances
are exactly those every one of them accepts, keyword by keyword, where that can be said
exactly; refused where it cannot.

Keywords beside ``$ref``, ``anyOf`` or ``oneOf`` are one more such schema (draft 2020-12's
reading; draft 7 ignores them, and an instance of both is an instance of the $ref alone
too). Merging, a ``$ref`` at the top of a schema is followed; an ``anyOf`` or ``oneOf`` is
distributed (allOf [A, anyOf [B, C]] is anyOf [allOf [A, B], allOf [A, C]]; a oneOf
stays a oneOf, which engine/json_one_of.py checks), at most ``MAX_ALTERNATIVES``
alternatives; combinations whose schemas exclude each other are left out.

Keyword by keyword: ``type`` lists intersect (an integer is a number); ``required`` lists
join; lower bounds take the greatest, upper bounds the least; ``multipleOf`` the least
common multiple; ``enum`` and ``const`` values
intersect; ``uniqueItems`` holds if one says so; ``nullable`` holds if every schema says so
(a subset where a schema takes null by its type: the compiler generates subsets anyway).
Members: each name any schema declares is declared, valued by every schema that constrains
it (its own ``properties``, or another's ``additionalProperties``); a name another's
``additionalProperties: false`` forbids is left out, or refused when required. Items: the
``items`` schemas join, unless a tuple is beside another array schema. Any other keyword in
two schemas must have one value in both.
"""
from __future__ import annotations

import itertools
import math
from fractions import Fraction
from typing import Any, Callable

from engine.json_numbers import draft4_bounds
from engine.json_schema_checks import IGNORED, at, equality_key, never
from engine.json_text_regex import MAX_SCHEMA_DEPTH

MAX_ALTERNATIVES = 64  # anyOf/oneOf alternatives an allOf may distribute into

_LOWER = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties")
_UPPER = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties")
_MEMBERS = ("properties", "additionalProperties", "patternProperties")
_TUPLES = ("prefixItems", "additionalItems")
_JOINED = ("anyOf", "oneOf", "allOf", "$ref")


def merge_all_of(schemas: list, path: str, resolve: Callable[[str, str], Any]) -> Any:
    """One schema for allOf ``schemas`` at ``path``: a plain schema, {"anyOf": [...]} of
    plain ones, or False when they exclude each other. ``resolve(ref, path)`` is the schema
    a $ref names. ValueError for what cannot be merged exactly."""
    return _merge(schemas, path, resolve, [MAX_ALTERNATIVES])


def _merge(schemas: list, path: str, resolve, budget: list[int]) -> Any:
    plain: list[dict] = []
    choices: list[tuple[str, list]] = []  # ("anyOf" or "oneOf", its schemas)
    refs: dict[str, bool] = {}  # the $refs flattened: True once done, False while open
    for s in schemas:
        if not _flatten(s, path, resolve, plain, choices, 0, refs):
            return False
    if not choices:
        return _merge_plain(plain, path)
    one_of = any(kw == "oneOf" for kw, _ in choices)
    if one_of and len(choices) > 1:
        raise ValueError(f"'oneOf' beside other alternatives ('anyOf' or 'oneOf') joined at "
                         f"{path} is not supported")
    merged = []
    # An alternative may hold alternatives again (a $ref back to this allOf, even): the
    # budget counts every combination tried, at every level.
    for combo in itertools.product(*(options for _, options in choices)):
        budget[0] -= 1
        if budget[0] < 0:
            raise ValueError(f"'allOf' at {path} distributes into more than "
                             f"{MAX_ALTERNATIVES} alternatives")
        m = _merge([*plain, *combo], path, resolve, budget)
        if m is not False:
            merged += m["anyOf"] if "anyOf" in m else [m]
    if not merged:
        return False
    # oneOf's schemas, each joined with the rest: the compiler checks they exclude each other.
    return merged[0] if len(merged) == 1 else {"oneOf" if one_of else "anyOf": merged}


def _flatten(s: Any, path: str, resolve, plain: list, choices: list, depth: int,
             refs: dict[str, bool]) -> bool:
    """Adds ``s``'s plain keywords to ``plain`` and its alternatives to ``choices``,
    following its $ref and allOf; False when ``s`` is false. A $ref already flattened adds
    nothing again (A and A is A): without that, allOf chains of two $refs to one schema
    flattened 2^depth schemas, a small schema holding a thread for minutes."""
    if depth > MAX_SCHEMA_DEPTH:
        raise ValueError(f"'allOf' at {path} leads back to itself through $ref or allOf")
    if s is True:
        return True
    if s is False:
        return False
    if not isinstance(s, dict):
        raise ValueError(f"the schema at {path} is a {type(s).__name__}, "
                         "not an object or a boolean")
    own = {k: v for k, v in s.items() if k not in IGNORED and k not in _JOINED}
    if own:
        plain.append(draft4_bounds(own))  # so that bounds of several schemas compare
    if "$ref" in s:
        ref = s["$ref"]
        if not isinstance(ref, str):
            raise ValueError(f"'$ref' at {path} must be a string")
        if refs.get(ref) is False:
            raise ValueError(f"'allOf' at {path} leads back to itself through $ref")
        if ref not in refs:
            refs[ref] = False
            if not _flatten(resolve(ref, path), ref, resolve, plain, choices, depth + 1,
                            refs):
                return False
            refs[ref] = True
    for kw in _JOINED[:3]:
        if kw not in s:
            continue
        if not isinstance(s[kw], list) or not s[kw]:
            raise ValueError(f"{kw!r} at {path} must be a non-empty array of schemas")
        if kw != "allOf":
            choices.append((kw, s[kw]))
            continue
        for i, sub in enumerate(s[kw]):
            if not _flatten(sub, at(at(path, kw), i), resolve, plain, choices, depth + 1,
                            refs):
                return False
    return True


def _merge_plain(schemas: list[dict], path: str) -> Any:
    """The plain (no $ref or combinator) ``schemas`` as one, or False."""
    merged: dict = {}
    for kw in dict.fromkeys(k for s in schemas for k in s):
        holders = [s for s in schemas if kw in s]
        if kw in _MEMBERS or kw in ("items", *_TUPLES):
            continue  # below, with the keywords they depend on
        values = [s[kw] for s in holders]
        if kw == "type":
            merged[kw] = _types(values, path)
            if not merged[kw]:
                return False
        elif kw == "required":
            merged[kw] = list(dict.fromkeys(n for v in values for n in _names(v, kw, path)))
        elif kw in ("enum", "const"):
            continue
        elif kw in _LOWER + _UPPER and len(values) > 1 and \
                all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            merged[kw] = max(values) if kw in _LOWER else min(values)
        elif kw == "multipleOf" and len(values) > 1 and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
                and math.isfinite(v) for v in values):
            merged[kw] = _least_common_multiple(values)
        elif kw == "uniqueItems" and all(isinstance(v, bool) for v in values):
            merged[kw] = any(values)
        elif kw == "nullable":
            merged[kw] = len(values) == len(schemas) and all(v is True for v in values)
        else:
            merged[kw] = _one_value(kw, values, path)
    if not _merge_values(schemas, merged, path):
        return False
    _merge_items(schemas, merged, path)
    return _merge_members(schemas, merged, path)


def _least_common_multiple(values: list) -> int | float:
    """The least number every one of ``values`` divides: a multiple of each is a multiple of
    it. Exact: each value as the decimal it is written as (0.1 is 1/10)."""
    fractions = [Fraction(repr(v)) for v in values]
    lcm = fractions[0]
    for f in fractions[1:]:
        lcm = Fraction(math.lcm(lcm.numerator, f.numerator), math.gcd(lcm.denominator,
                                                                       f.denominator))
    return int(lcm) if lcm.denominator == 1 else float(lcm)


def _types(values: list, path: str) -> list[str]:
    """The types every one of ``values`` (a type or a list of them) allows."""
    common = None
    for v in values:
        types = [v] if isinstance(v, str) else v
        if not isinstance(types, list) or not types:
            raise ValueError(f"'type' at {path} must be a type or a non-empty array of them")
        if common is None:
            common = list(types)
            continue
        allowed = set(types) | ({"integer"} if "number" in types else set())
        narrowed = ["integer"] if "number" in common and "integer" in types else []
        common = [t for t in common if t in allowed] + narrowed
    return list(dict.fromkeys(common))


def _names(v: Any, kw: str, path: str) -> list[str]:
    if not isinstance(v, list) or any(not isinstance(n, str) for n in v):
        raise ValueError(f"{kw!r} at {path} must be an array of strings")
    return v


def _one_value(kw: str, values: list, path: str) -> Any:
    """The value every schema holding ``kw`` gives it: one, or refused."""
    if any(equality_key(v) != equality_key(values[0]) for v in values[1:]):
        raise ValueError(f"{kw!r} has different values in the schemas 'allOf' joins at {path}"
                         ": not supported")
    return values[0]


def _merge_values(schemas: list[dict], merged: dict, path: str) -> bool:
    """``enum`` and ``const`` as one enum of the values all of them list; False for none."""
    lists = [s["enum"] if "enum" in s else [s["const"]] for s in schemas
             if "enum" in s or "const" in s]
    if not lists:
        return True
    if any(not isinstance(v, list) for v in lists):
        raise ValueError(f"'enum' at {path} must be an array")
    kept = lists[0]
    for other in lists[1:]:
        keys = {equality_key(v) for v in other}
        kept = [v for v in kept if equality_key(v) in keys]
    if not kept:
        return False
    merged["enum"] = kept
    return True


def _merge_items(schemas: list[dict], merged: dict, path: str) -> None:
    holders = [s for s in schemas if any(k in s for k in ("items", *_TUPLES))]
    if len(holders) == 1:
        merged.update({k: holders[0][k] for k in ("items", *_TUPLES) if k in holders[0]})
    elif holders:
        if any(k in s for s in holders for k in _TUPLES) or \
                any(isinstance(s.get("items"), list) for s in holders):
            raise ValueError(f"a tuple ('prefixItems', or an array 'items') beside another "
                             f"array schema in 'allOf' at {path} is not supported")
        merged["items"] = _all([s["items"] for s in holders])


def _merge_members(schemas: list[dict], merged: dict, path: str) -> Any:
    holders = [s for s in schemas if any(k in s for k in _MEMBERS)]
    if len(holders) <= 1:
        merged.update({k: holders[0][k] for k in _MEMBERS if holders and k in holders[0]})
        return merged
    if any("patternProperties" in s for s in holders):
        raise ValueError(f"'patternProperties' beside another object schema in 'allOf' at "
                         f"{path} is not supported")
    for s in holders:
        if not isinstance(s.get("properties", {}), dict):
            raise ValueError(f"'properties' at {path} must be an object")
    names = dict.fromkeys(n for s in holders for n in s.get("properties", {}))
    props = {}
    for name in names:
        # Each schema constrains the member: by its properties, else its additionalProperties.
        rules = [s["properties"][name] if name in s.get("properties", {}) else
                 s["additionalProperties"] for s in holders
                 if name in s.get("properties", {}) or "additionalProperties" in s]
        if any(never(r) for r in rules):
            if name in merged.get("required", []):
                return False
            continue
        props[name] = _all(rules)
    merged["properties"] = props
    extras = [s["additionalProperties"] for s in holders if "additionalProperties" in s]
    if extras:
        merged["additionalProperties"] = False if any(never(e) for e in extras) else \
            _all(extras)
    return merged


def _all(schemas: list) -> Any:
    """allOf ``schemas``, or the one schema when they are all the same."""
    distinct = list({equality_key(s): s for s in schemas if s is not True}.values())
    if not distinct:
        return True
    return distinct[0] if len(distinct) == 1 else {"allOf": distinct}
