"""OpenAI's ``response_format`` through guided decoding: ``response_format_schema(fmt)`` is the
JSON schema to send as ``guided_json`` (None for plain text).

- ``{"type": "text"}``: nothing forced;
- ``{"type": "json_object"}`` (JSON mode): any JSON object (its values nested at most two
  arrays or objects deep, engine/json_schema_regex.py's bound for a value left open);
- ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``: an instance of
  the schema (``strict`` is how the workers follow it anyway: keywords they cannot follow
  are refused, never ignored).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from client.tool_choice import ANY_OBJECT


def response_format_schema(fmt: Mapping[str, Any] | None) -> dict | None:
    """The ``guided_json`` schema for ``fmt``; ValueError for one that is none of the three."""
    kind = fmt.get("type") if isinstance(fmt, Mapping) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return dict(ANY_OBJECT)
    spec = fmt.get("json_schema") if kind == "json_schema" else None
    schema = spec.get("schema") if isinstance(spec, Mapping) else None
    if not isinstance(schema, Mapping):
        raise ValueError('response_format must be {"type": "text"}, {"type": "json_object"} '
                         'or {"type": "json_schema", "json_schema": {"schema": {...}}}, '
                         f"got {fmt!r}"[:300])
    return dict(schema)
