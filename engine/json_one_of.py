"""``oneOf`` for engine/json_schema_regex.py: its schemas compile as alternatives, which is
right only where no text one of them generates is valid under another (then each text is
valid under exactly one). That is shown here for every pair, or the oneOf is refused:

- by type: the types one generates are types the other does not accept (a schema without
  ``type`` accepts every type its keywords do not constrain);
- by values: both are enums or consts with no value in common;
- by a tag: a member one requires has enum or const values the other's declared member
  never has (pydantic's discriminated unions, OpenAPI's tagged ones);
- by names: one requires a member the other's declared members never include, or one
  requires a member the other forbids (``additionalProperties: false``).
"""
from __future__ import annotations

from typing import Any

from engine.json_schema_checks import IGNORED, at, equality_key
from engine.json_text_regex import MAX_SCHEMA_DEPTH, json_types

MAX_ONE_OF = 128  # schemas in one oneOf: each pair is compared
_KINDS = frozenset({"null", "boolean", "number", "string", "array", "object"})
_JOINS = ("anyOf", "oneOf", "allOf")


def check_exclusive(schemas: list, path: str, c) -> None:
    """Refuses (ValueError) the oneOf ``schemas`` at ``path`` unless no text one generates
    is valid under another. ``c`` is the compiler: its resolved, types and finite_values."""
    if len(schemas) > MAX_ONE_OF:
        raise ValueError(f"'oneOf' at {path} has {len(schemas)} schemas: at most {MAX_ONE_OF}"
                         " are supported (anyOf has no limit)")
    schemas = [c.resolved(s, path) for s in schemas]
    # Each schema's kinds once: a pair then costs little unless their kinds meet.
    made = [_generated(c, s, path, 0) for s in schemas]
    taken = [_accepted(c, s, path, 0) for s in schemas]
    values = [_values(c, s, path) for s in schemas]
    for i, a in enumerate(schemas):
        for j, b in enumerate(schemas):
            common = made[i] & taken[j]
            if i != j and common and not _apart(c, a, b, common, values[i], values[j], path):
                raise ValueError(f"'oneOf' at {path}: a value valid under its schema {i} may "
                                 f"be valid under its schema {j} too, and then under more "
                                 "than one (use anyOf if either may hold, or tell them apart "
                                 "by type, by values, or by a required member with a const)")


def _excludes(c, a: Any, b: Any, path: str) -> bool:
    """Whether no text generated for ``a`` is valid under ``b``."""
    a, b = c.resolved(a, path), c.resolved(b, path)
    common = _generated(c, a, path, 0) & _accepted(c, b, path, 0)
    return not common or _apart(c, a, b, common, _values(c, a, path), _values(c, b, path),
                                path)


def _apart(c, a: Any, b: Any, common: set[str], va: set | None, vb: set | None,
           path: str) -> bool:
    """Whether no text generated for ``a`` is valid under ``b``, where the kinds ``common``
    of theirs meet: by their values (``va``, ``vb``: _values'), or for objects by their
    members."""
    if va is not None and vb is not None and not va & vb:
        return True
    return common == {"object"} and isinstance(a, dict) and isinstance(b, dict) and \
        _members_exclude(c, a, b, path)


def _values(c, s: Any, path: str, depth: int = 0) -> set | None:
    """The equality keys of the values ``s`` allows, when they are few: its own, or those
    every schema of its allOf with few allows (a member two schemas joined constrain). None
    stands for any values, so a schema met again while its own are being found is left out
    of its allOf (a superset, which is sound). Once per schema a compile: allOf chains of
    $refs back to one schema walked 3^64 schemas without it."""
    s = c.resolved(s, path)
    c.budget.walk(path)
    if not (isinstance(s, dict) and isinstance(s.get("allOf"), list) and
            not set(s) - IGNORED - {"allOf"} and depth < MAX_SCHEMA_DEPTH):
        values = c.finite_values(s, path, 0)
        return None if values is None else {equality_key(v) for v in values}
    memo = c.kinds_memo.get(("values", id(s)))
    if memo is not None and memo[0] is s:  # (the schema is held: its id is not reused)
        return memo[1]
    c.kinds_memo[("values", id(s))] = (s, None)
    known = [v for v in (_values(c, sub, path, depth + 1) for sub in s["allOf"])
             if v is not None]
    found = set.intersection(*known) if known else None
    c.kinds_memo[("values", id(s))] = (s, found)
    return found


def _kinds(types) -> set[str]:
    """Schema types as kinds of value: an integer is a number."""
    return {"number" if t == "integer" else t for t in types}


def _value_kinds(s: dict, path: str) -> set[str]:
    """The kinds of ``s``'s enum or const values."""
    values = s["enum"] if "enum" in s and isinstance(s["enum"], list) else [s.get("const")]
    return _kinds(t for v in values for t in json_types(v, path))


def _own_kinds(c, s: dict, path: str) -> set[str] | None:
    """The kinds ``type`` names, with null if nullable; None without."""
    if "type" not in s:
        return None
    return _kinds(c.types(s, path)) | ({"null"} if s.get("nullable") is True else set())


def _via_ref(c, ref: str, path: str, depth: int, kinds_of) -> set[str]:
    """``kinds_of`` the schema ``ref`` names, once per compile: a $ref met again while its
    own kinds are being found stands for every kind (both functions find supersets, so any
    answer that widens is sound). Without it two branches of ``{"$ref": "#"}`` beside each
    other walked 2^depth schemas: a 100-byte schema held a thread for minutes."""
    key = (ref, kinds_of)
    if key in c.kinds_memo:
        found = c.kinds_memo[key]
        return set(_KINDS) if found is None else found
    c.kinds_memo[key] = None
    try:
        found = kinds_of(c, c.target(ref, path), path, depth + 1)
    except BaseException:
        del c.kinds_memo[key]
        raise
    c.kinds_memo[key] = found
    return found


def _bare_ref(s: Any) -> str | None:
    if isinstance(s, dict) and set(s) - IGNORED == {"$ref"} and isinstance(s["$ref"], str):
        return s["$ref"]
    return None


def _generated(c, s: Any, path: str, depth: int) -> set[str]:
    """The kinds of value the compiler may generate for ``s`` (a superset)."""
    c.budget.walk(path)
    if (ref := _bare_ref(s)) is not None:
        return _via_ref(c, ref, path, depth, _generated)
    if s is False:
        return set()
    if not isinstance(s, dict) or depth > MAX_SCHEMA_DEPTH or "not" in s:
        return set(_KINDS)  # (a "not" may widen the types its keywords imply)
    if "enum" in s or "const" in s:
        kinds = _value_kinds(s, path)
    elif any(k in s for k in (*_JOINS, "$ref")):
        kinds = _combined(c, s, path, depth, _generated)
    else:
        kinds = _kinds(c.types(s, path)) or set(_KINDS)
    own = _own_kinds(c, s, path)
    kinds = kinds if own is None else kinds & own
    return kinds | ({"null"} if s.get("nullable") is True else set())


def _accepted(c, s: Any, path: str, depth: int) -> set[str]:
    """The kinds of value ``s`` accepts some of (a superset: by its type, values and
    combinators; other keywords leave the other kinds alone)."""
    c.budget.walk(path)
    if (ref := _bare_ref(s)) is not None:
        return _via_ref(c, ref, path, depth, _accepted)
    if s is False:
        return set()
    if not isinstance(s, dict) or depth > MAX_SCHEMA_DEPTH:
        return set(_KINDS)
    kinds = set(_KINDS)
    if "enum" in s or "const" in s:
        kinds = _value_kinds(s, path)
    if any(k in s for k in (*_JOINS, "$ref")):
        kinds &= _combined(c, s, path, depth, _accepted)
    own = _own_kinds(c, s, path)
    return kinds if own is None else kinds & own


def _combined(c, s: dict, path: str, depth: int, kinds_of) -> set[str]:
    """The kinds ``s``'s $ref and combinators allow, by ``kinds_of`` each schema."""
    kinds = set(_KINDS)
    if "$ref" in s and isinstance(s["$ref"], str):
        kinds &= _via_ref(c, s["$ref"], path, depth, kinds_of)
    for kw in _JOINS:
        subs = s.get(kw)
        if not isinstance(subs, list) or not subs:
            continue
        each = [kinds_of(c, sub, path, depth + 1) for sub in subs]
        kinds &= set.intersection(*each) if kw == "allOf" else set.union(*each)
    return kinds


def _members_exclude(c, a: dict, b: dict, path: str) -> bool:
    """Whether no object generated for ``a`` is valid under ``b``, by their members."""
    a_props, b_props = a.get("properties", {}), b.get("properties", {})
    a_required, b_required = a.get("required", []), b.get("required", [])
    if not all(isinstance(x, dict) for x in (a_props, b_props)) or \
            not all(isinstance(x, list) for x in (a_required, b_required)):
        return False
    for name in a_required:  # a tag: its values in a and in b never meet
        if name in a_props and name in b_props:
            va, vb = _values(c, a_props[name], at(path, name)), \
                _values(c, b_props[name], at(path, name))
            if va is not None and vb is not None and not va & vb:
                return True
        if b.get("additionalProperties") is False and name not in b_props and \
                "patternProperties" not in b:
            return True  # a member b forbids
    # a's generated objects carry declared members only (a map's names are any).
    declared = bool(a_props) or a.get("additionalProperties") is False
    return declared and any(name not in a_props for name in b_required)
