"""``dependentRequired``, ``dependentSchemas`` and draft 7's ``dependencies`` for
engine/json_schema_regex.py: an object schema with them is the anyOf of variants without
them, exactly. For a dependency of the member ``a``: one variant where ``a`` is present
(required, with what it needs: the members it names required, or its schema joined by
allOf), unless it needs a member never generated or a false schema; one where it is absent
(left out of ``properties``), unless it is required. Where ``a`` is not declared, it is never
generated, and nothing changes. At most ``MAX_VARIANTS`` variants.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.json_schema_checks import at, never

MAX_VARIANTS = 64
KEYWORDS = ("dependentRequired", "dependentSchemas", "dependencies")
_SHAPES = {"dependentRequired": "an array of names", "dependentSchemas": "a schema",
           "dependencies": "a schema or an array of names"}


@dataclass
class _Variant:
    schema: dict  # the object's own keywords, its required and properties narrowed
    joined: list = field(default_factory=list)  # dependent schemas it must meet as well

    def present(self, name: str, needed: list[str], schema: Any) -> _Variant:
        required = list(dict.fromkeys([*self.schema.get("required", []), name, *needed]))
        return _Variant({**self.schema, "required": required},
                        self.joined + ([] if schema is None else [schema]))

    def absent(self, name: str) -> _Variant:
        props = {k: v for k, v in self.schema["properties"].items() if k != name}
        # No member left: {} alone, not the object of any members an empty properties reads as.
        closed = {} if props else {"additionalProperties": False}
        return _Variant({**self.schema, "properties": props, **closed}, self.joined)

    def built(self) -> dict:
        return {"allOf": [self.schema, *self.joined]} if self.joined else self.schema


def dependency_variants(s: dict, path: str) -> list[dict] | None:
    """The object schemas, free of dependency keywords, whose anyOf is ``s``; None when
    ``s`` has none."""
    rules = _rules(s, path)
    if not rules:
        return None
    base = {k: v for k, v in s.items() if k not in KEYWORDS}
    base["type"] = "object"  # the variants are the object part of s
    props = base.get("properties", {})
    if not isinstance(props, dict) or not props:
        raise ValueError(f"dependencies at {path} are supported beside 'properties' only (an "
                         "object of any members cannot leave a name out)")
    variants = [_Variant(base)]
    for name, needed, schema in rules:
        grown = []
        for v in variants:
            declared = v.schema["properties"]
            if name not in declared:  # never generated here: its dependency never applies
                grown.append(v)
                continue
            # Present unless it needs a member never generated here, or a false schema.
            if not never(schema) and all(n in declared for n in needed):
                grown.append(v.present(name, needed, schema))
            if name not in v.schema.get("required", []):
                grown.append(v.absent(name))
        if not grown:
            raise ValueError(f"the member {name!r} at {path} is required, and what it "
                             "depends on is false or names members not in 'properties': no "
                             "value is valid")
        if len(grown) > MAX_VARIANTS:
            raise ValueError(f"dependencies at {path} make more than {MAX_VARIANTS} variants "
                             "of the object")
        variants = grown
    return [v.built() for v in variants]


def _rules(s: dict, path: str) -> list[tuple[str, list[str], Any]]:
    """Each dependency: the member, the members it needs, the schema it needs (or None)."""
    rules = []
    for kw in KEYWORDS:
        if kw not in s:
            continue
        if not isinstance(s[kw], dict):
            raise ValueError(f"{kw!r} at {path} must be an object")
        for name, dep in s[kw].items():
            where = at(at(path, kw), name)
            if isinstance(dep, list) and kw != "dependentSchemas":
                if any(not isinstance(n, str) for n in dep):
                    raise ValueError(f"{kw!r} at {where} must be an array of strings")
                rules.append((name, dep, None))
            elif isinstance(dep, (dict, bool)) and kw != "dependentRequired":
                rules.append((name, [], dep))
            else:
                raise ValueError(f"{kw!r} at {where} must be {_SHAPES[kw]}")
    return rules
