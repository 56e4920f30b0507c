"""``if``, ``then`` and ``else`` for engine/json_schema_regex.py's compiler.

A value meets ``{if: I, then: T, else: E, ...rest}`` when it meets rest and either I and T,
or not I and E; the two are alternatives no value meets both of, compiled as
``anyOf [allOf(rest, I, T), allOf(rest, not I, E)]`` (engine/json_all_of.py merges each).
``not I`` is written so the compiler can fold it (engine/json_not.py): where I is a type, a
few values or bounds (``{"minimum": 18}``), ``{"not": I}``; where I is about an object's
members (``properties`` and ``required``, the conditional-requirement idiom: "if country is
US, postal_code follows this pattern"), one alternative per way to miss it: a member I names
present with a value its schema refuses (``{"not": ...}`` of that member's schema, folded
against the member's own values: an enum or a const tag), or a member I requires absent. An
alternative no value meets (the rest's enum leaves no other tag) is left out, and only when
all are is the schema refused. ``then`` or ``else`` without ``if`` mean nothing and are
dropped, as JSON Schema says.
"""
from __future__ import annotations

from typing import Any

from engine.compile_budget import TooMuchWork
from engine.json_schema_checks import IGNORED, Cut, Unsatisfiable, at, is_open
from engine.regex_text import alt

_KEYWORDS = ("if", "then", "else")
# Conditions compiled in one schema at most: the variants of one are compiled whole (a $ref
# inside them is inlined by allOf's merge), so a chain of $refs to conditions would double
# its work at each link.
MAX_CONDITIONS = 128
# An object condition: the keywords it may have (its type, if any, must be "object").
_OBJECT_CONDITION = {"properties", "required", "type"}


class ConditionRefused(ValueError):
    """A refusal that already names the if/then/else it came from: an outer one passes it on
    as it is, rather than naming itself in front."""


def conditional(compiler, s: dict, path: str, depth: int) -> str:
    """The regex of ``s``, which has if, then or else."""
    rest = {k: v for k, v in s.items() if k not in _KEYWORDS}
    if "if" not in s:
        return compiler.node(rest, path, depth + 1)
    nullable = rest.pop("nullable", False)  # null is added once, below
    if not isinstance(nullable, bool):
        raise ValueError(f"'nullable' at {path} must be true or false")
    compiler.conditions += 1
    if compiler.conditions > MAX_CONDITIONS:
        raise ConditionRefused(f"the schema compiles more than {MAX_CONDITIONS} if/then/else "
                               f"conditions (at {path})")
    cond, then, other = s["if"], s.get("then", True), s.get("else", True)
    variants = [{"allOf": [rest, cond, then]}]
    variants += [{"allOf": [rest, miss, other]} for miss in _misses(cond, rest, path)]
    found, refusal, cut = [], None, None
    for v in variants:
        try:
            found.append(compiler.node(v, path, depth + 1))
        except Unsatisfiable as e:  # no value takes this way through the condition
            refusal = refusal or e
        except Cut as e:  # a recursion cut in this way: the others may end (as anyOf's)
            cut = cut or e
        except (TooMuchWork, ConditionRefused):  # the schema's as a whole, or named
            raise
        except ValueError as e:
            raise ConditionRefused(f"'if' at {path}: {e}") from None
    if not found:
        if cut is not None:
            raise cut
        raise Unsatisfiable(f"no value meets the schema at {path} whether or not it meets "
                            f"'if' ({refusal})")
    rx = alt(found)
    return alt([rx, "null"]) if nullable else rx


def _misses(cond: Any, rest: dict, path: str) -> list:
    """Schemas whose anyOf is the values that fail ``cond`` (among those ``rest`` takes)."""
    where = at(path, "if")
    if cond is True or is_open(cond):
        return []
    if cond is False:
        return [True]
    if not isinstance(cond, dict):
        raise ValueError(f"the schema at {where} is a {type(cond).__name__}, not an object or "
                         "a boolean")
    keys = set(cond) - IGNORED
    if not keys & {"properties", "required"}:
        return [{"not": cond}]  # a type or values: engine/json_not.py folds it
    if keys - _OBJECT_CONDITION or cond.get("type", "object") != "object":
        raise ValueError(f"the schema at {where} is supported as a type, values, or an "
                         "object's properties and required members")
    if rest.get("type") != "object":
        raise ValueError(f"an object condition at {where} needs \"type\": \"object\" beside "
                         "it (a value that is no object meets it)")
    props, required = cond.get("properties", {}), cond.get("required", [])
    if not isinstance(props, dict) or not isinstance(required, list):
        raise ValueError(f"'properties' or 'required' at {where} is malformed")
    misses: list = [{"required": [k], "properties": {k: {"not": v}}}
                    for k, v in props.items() if v is not True and not is_open(v)]
    # Where the rest requires it too, this one meets nothing and is left out.
    misses += [{"properties": {k: False}} for k in required]
    return misses
