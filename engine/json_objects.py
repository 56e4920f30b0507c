"""Objects for engine/json_schema_regex.py's compiler: declared members, maps of any members,
and the names a member may have (``propertyNames``, ``patternProperties``).

A map whose names are few (``propertyNames`` an enum or a const: pydantic's ``dict`` keyed by
an Enum or a Literal) carries each name at most once, in the enum's order, as declared
optional members; other maps repeat one member of any name the rule allows, so a name may
repeat (JSON keeps the last) and ``minProperties`` stays at most 1. ``patternProperties``
takes one pattern (pydantic's ``dict`` keyed by a string with a pattern): its maps carry only
names the pattern matches, valued by its schema; beside ``properties``, a declared name the
pattern matches is refused unless the pattern's schema constrains nothing, as the value would
have to meet both schemas.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.json_dependencies import dependency_variants
from engine.json_schema_checks import IGNORED, Cut, at, count, is_open, never, within
from engine.json_string_pattern import pattern_string_regex
from engine.json_text_regex import CHAR, STRING, any_value, literal, map_object, object_members
from engine.regex_text import alt

# The keywords a propertyNames schema may have beside annotations, when it is not an enum or
# a const: those of a string.
_NAME_KEYWORDS = {"type", "minLength", "maxLength", "pattern", "format"}


@dataclass(frozen=True)
class MemberNames:
    """The names an object's members may have: ``key`` matches their JSON texts; ``listed``
    are the names themselves when they are few; ``value`` (patternProperties) is the schema
    such a member's value meets, with where it is, instead of additionalProperties."""
    key: str
    listed: tuple[str, ...] | None = None
    value: tuple[Any, str] | None = None


class ObjectRules:
    """The object methods of engine/json_schema_regex.py's _Compiler, which provides
    ``p``, ``node``, ``string``, ``types``, ``resolved``, ``finite_values`` and
    ``automaton``."""

    def object(self, s: dict, path: str, depth: int) -> str:
        variants = dependency_variants(s, path)
        if variants is not None:  # the anyOf of variants without dependencies
            return self.node(variants[0] if len(variants) == 1 else {"anyOf": variants}, path,
                             depth + 1)
        props, required = s.get("properties", {}), s.get("required", [])
        extra = s.get("additionalProperties")
        extra = False if never(extra) else extra
        if not isinstance(props, dict):
            raise ValueError(f"'properties' at {path} must be an object")
        if extra is not None and not isinstance(extra, (bool, dict)):
            raise ValueError(f"'additionalProperties' at {path} must be a schema")
        if not isinstance(required, list) or any(not isinstance(r, str) for r in required):
            raise ValueError(f"'required' at {path} must be an array of strings")
        for name in required:
            if name not in props:
                raise ValueError(f"'required' at {path} names {name!r}, which is not in "
                                 "'properties': such a member is not generated")
        least = count(s, "minProperties", path, 0)
        most = count(s, "maxProperties", path, None)
        if most is not None and least > most:
            raise ValueError(f"'minProperties' at {path} is above 'maxProperties'")
        names = self.member_names(s, path)
        patterned = names is not None and names.value is not None
        if not props and (extra is not False or patterned):  # a map: members by name rules
            return self.map_object(extra, names, least, most, path, depth)
        # Beside properties, additionalProperties changes nothing: none beyond them is
        # generated (absent, the spec's default, already allows them).
        return self.declared_object(props, set(required), names, least, most, path, depth)

    def member_names(self, s: dict, path: str) -> MemberNames | None:
        """The rule ``propertyNames`` or ``patternProperties`` sets on member names; None
        where neither constrains them."""
        patterns = s.get("patternProperties", {})
        if not isinstance(patterns, dict):
            raise ValueError(f"'patternProperties' at {path} must be an object of schemas")
        if len(patterns) > 1:
            raise ValueError(f"'patternProperties' at {path} has {len(patterns)} patterns: "
                             "only one is supported")
        if patterns and "propertyNames" in s:
            raise ValueError(f"'patternProperties' beside 'propertyNames' at {path} is not "
                             "supported")
        if patterns:
            (pattern, value), = patterns.items()
            where = at(path, "patternProperties")
            return MemberNames(pattern_string_regex(pattern, CHAR, where),
                               value=(value, at(where, pattern)))
        if "propertyNames" not in s:
            return None
        return self.property_names(s["propertyNames"], at(path, "propertyNames"))

    def property_names(self, s: Any, path: str) -> MemberNames | None:
        """The names a ``propertyNames`` schema allows: an enum's or a const's strings, or
        a string's (lengths, pattern, format); None for a schema that constrains nothing."""
        s = self.resolved(s, path)
        if is_open(s):
            return None
        if never(s):
            raise ValueError(f"'propertyNames' at {path} accepts no name: only an empty object is "
                             "valid (drop the members instead)")
        values = self.finite_values(s, path, 0)
        if values is not None:
            listed = tuple(v for v in values if isinstance(v, str))
            if not listed:
                raise ValueError(f"'propertyNames' at {path} allows no string, and member "
                                 "names are strings: only an empty object is valid")
            return MemberNames(alt([literal(v, path, 0, self.p) for v in listed]), listed)
        if not isinstance(s, dict) or set(s) - IGNORED - _NAME_KEYWORDS:
            raise ValueError(f"'propertyNames' at {path} is supported as an enum, a const, or "
                             "a string's type, minLength, maxLength, pattern and format")
        if "type" in s and "string" not in self.types(s, path):
            raise ValueError(f"'propertyNames' at {path} allows no string, and member names "
                             "are strings: only an empty object is valid")
        return MemberNames(self.string(s, path))

    def map_object(self, extra: Any, names: MemberNames | None, least: int, most: int | None,
                   path: str, depth: int) -> str:
        """An object of members named as ``names`` allow (any, for None), least..most of
        them, valued as ``extra`` (or patternProperties' schema) says."""
        if names is not None and names.listed is not None:
            return self.listed_map(extra, names.listed, least, most, path, depth)
        if least > 1:
            raise ValueError(f"'minProperties' {least} at {path} is not supported for an "
                             "object of any members: a generated name may repeat, and a "
                             "repeated name counts once")
        empty = self.p.open_object + self.p.close_object
        if most == 0:
            return empty
        value_schema, where = extra, at(path, "additionalProperties")
        if names is not None and names.value is not None:
            value_schema, where = names.value
        try:
            value = self.member_value(value_schema, where, depth)
        except Cut:  # a recursion cut at the values: no members
            if least:
                raise
            return empty
        return map_object(value, self.p, least, most,
                          key=STRING if names is None else names.key)

    def listed_map(self, extra: Any, listed: tuple[str, ...], least: int, most: int | None,
                   path: str, depth: int) -> str:
        """An object whose members are some of the ``listed`` names, each at most once, in
        the list's order."""
        if least > 1 or (most is not None and most < len(listed)):
            raise ValueError(f"'minProperties' above 1 or 'maxProperties' below {len(listed)} "
                             f"beside the names 'propertyNames' lists at {path} is not "
                             "supported")
        try:
            value = self.member_value(extra, at(path, "additionalProperties"), depth)
        except Cut:
            if least:
                raise
            return self.p.open_object + self.p.close_object
        members = [(literal(name, path, depth, self.p) + self.p.colon + value, False)
                   for name in listed]
        within(sum(len(m) for m, _ in members), path)
        return self.p.open_object + object_members(members, self.p.comma, nonempty=least > 0) \
            + self.p.close_object

    def member_value(self, s: Any, path: str, depth: int) -> str:
        """A map's values: any value where the schema leaves them open."""
        if s is None or s is True:
            return any_value(self.any_depth, self.p)
        return self.node(s, path, depth + 1)

    def declared_object(self, props: dict, required: set[str], names: MemberNames | None,
                        least: int, most: int | None, path: str, depth: int) -> str:
        """The declared members in order, each required one present, least..most in all
        (bounds the required and declared members' counts already meet, or a minimum of 1
        where none is required); a member whose name ``names`` rules out is left out, or
        refused when required."""
        members, total, cut = [], 0, None
        for name, sub in props.items():
            if never(self.resolved(sub, path)):  # a member that may not be there
                if name in required:
                    raise ValueError(f"'required' at {path} names {name!r}, whose schema is "
                                     "false: no value is valid")
                continue
            if names is not None and not self.name_fits(names, name, sub, name in required, path):
                continue
            try:
                value = self.node(sub, at(at(path, "properties"), name), depth + 1)
            except Cut as e:  # a recursion cut at an optional member: it is left out
                if name in required:
                    raise
                cut = e
                continue
            member = literal(name, path, depth, self.p) + self.p.colon + value
            total = within(total + len(member), path)
            members.append((member, name in required))
        if least > len(members):
            if cut is not None:
                raise cut
            raise ValueError(f"'minProperties' at {path} asks for more members than the "
                             "schema allows")
        if least > max(len(required), 1):
            raise ValueError(f"'minProperties' {least} at {path} is not supported beside "
                             f"{len(required)} required members (require as many)")
        if most is not None and most < len(members):
            raise ValueError(f"'maxProperties' {most} at {path} is not supported beside "
                             f"{len(members)} properties (declare at most as many)")
        return self.p.open_object + object_members(members, self.p.comma, nonempty=least > 0) \
            + self.p.close_object

    def name_fits(self, names: MemberNames, name: str, schema: Any, required: bool,
                  path: str) -> bool:
        """Whether the declared member ``name`` (valued by ``schema``) is generated under
        ``names``' rule."""
        # The engine's own automaton, not re: the pattern is the client's, and an automaton
        # walks a name in linear time whatever the pattern. Not kept in compile_regex's
        # cache, which holds the guides.
        matched = name in names.listed if names.listed is not None else \
            self.automaton(names.key, path).fullmatch(json.dumps(name, ensure_ascii=False))
        if names.value is not None:  # patternProperties: a matched name meets both schemas
            if matched and not is_open(names.value[0]) and names.value[0] != schema:
                raise ValueError(f"the member {name!r} at {path} is also named by the pattern "
                                 f"at {names.value[1]}, and a value meeting both schemas is "
                                 "not supported")
            return True
        if not matched and required:
            raise ValueError(f"'required' at {path} names {name!r}, which 'propertyNames' "
                             "does not allow: no value is valid")
        return matched
