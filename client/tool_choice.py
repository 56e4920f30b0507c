"""OpenAI's ``tool_choice`` through guided decoding, as vLLM serves it: the model must call a
tool, or a named one, because its reply is held to JSON that is such a call.

``tool_choice_schema(tools, choice)`` is the JSON schema to send as ``guided_json`` (None for
"auto" and "none": nothing is forced), and ``forced_tool_calls(text, tools, choice)`` reads the
guided reply back as calls, OpenAI's form, as the other parsers give them:

- ``"required"``: the reply is a JSON list of one or more ``{"name", "parameters"}`` objects,
  each a tool's name with arguments valid under its ``parameters`` schema;
- ``{"type": "function", "function": {"name": N}}``: the reply is the arguments of N, an
  object valid under its ``parameters`` schema.

The reply carries no call syntax (no ``<tool_call>`` tags): the call is JSON by construction,
whatever the model's template asks for. The workers follow the schemas' keywords that
engine/json_schema_regex.py lists and refuse others (``InvalidArgumentError``); a tool
without ``parameters`` takes any object. A reply cut by ``max_tokens`` is no call: its text is
the content, as the other parsers leave a call that does not parse.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from client.tool_calls import ParsedReply, json_or_none, new_call

ANY_OBJECT = {"type": "object"}  # a JSON schema: any object


def _functions(tools: Sequence[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """Each tool's name to its parameters schema; ValueError for a tool that is not one."""
    out: dict[str, Mapping[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if not isinstance(name, str) or not name or tool.get("type", "function") != "function":
            raise ValueError(f"tools[{i}] is not a function tool with a name: "
                             f"{json.dumps(tool)[:200]}")
        params = fn.get("parameters", ANY_OBJECT)
        if not isinstance(params, Mapping):
            raise ValueError(f"tool {name!r}'s parameters are not a JSON schema object")
        out[name] = params
    return out


def _named(choice: Any) -> str | None:
    """The function a named choice names; None for "auto", "none" and "required"."""
    if choice in ("auto", "none", "required"):
        return None
    fn = choice.get("function") if isinstance(choice, Mapping) else None
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(name, str) or choice.get("type", "function") != "function":
        raise ValueError('tool_choice must be "auto", "none", "required" or '
                         '{"type": "function", "function": {"name": ...}}, '
                         f"got {choice!r}")
    return name


def tool_choice_schema(tools: Sequence[Mapping[str, Any]], choice: Any) -> dict | None:
    """The ``guided_json`` schema that makes the reply the call(s) ``choice`` asks for; None
    when it forces nothing. ValueError for a choice or tools that cannot be forced."""
    functions = _functions(tools or [])
    name = _named(choice)
    if choice in ("auto", "none"):
        return None
    if name is not None:
        if name not in functions:
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools "
                             f"({', '.join(functions) or 'none'})")
        return dict(functions[name])
    if not functions:
        raise ValueError('tool_choice "required" needs at least one tool')
    calls = [{"type": "object",
              "properties": {"name": {"const": n}, "parameters": dict(params)},
              "required": ["name", "parameters"]} for n, params in functions.items()]
    return {"type": "array", "minItems": 1,
            "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}


def forced_tool_calls(text: str, tools: Sequence[Mapping[str, Any]], choice: Any) -> ParsedReply:
    """The calls of a reply guided by ``tool_choice_schema(tools, choice)``, each with a fresh
    id; the whole text as content when it is none (cut short, or nothing was forced)."""
    functions = _functions(tools or [])
    name = _named(choice)
    value = json_or_none(text)
    if name is not None:
        call = new_call(name, value) if name in functions else None
        return ParsedReply(None, [call]) if call is not None else ParsedReply(text)
    if choice != "required" or not isinstance(value, list) or not value:
        return ParsedReply(text)
    calls = []
    for item in value:
        ok = isinstance(item, dict) and item.get("name") in functions
        call = new_call(item["name"], item.get("parameters")) if ok else None
        if call is None:
            return ParsedReply(text)
        calls.append(call)
    return ParsedReply(None, calls)
