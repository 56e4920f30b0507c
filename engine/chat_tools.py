"""The tools a chat request offers the model, and the calls of them its messages record, as
OpenAI's chat API (and vLLM's) carries them. A template that supports tool use renders them
into the prompt (Qwen's and Llama 3.1's read ``tools``, and an assistant message's
``tool_calls``, and a "tool" message's ``tool_call_id``); the model's reply is text, in the
template's own call syntax, which the caller parses (the SDK's client/tool_calls.py reads
Hermes' ``<tool_call>``).

A tool: ``{"type": "function", "function": {"name", "description"?, "parameters"?}}``, the
parameters a JSON schema. A tool call: ``{"id"?, "type"?: "function", "function": {"name",
"arguments"}}``, the arguments a JSON object or its text (OpenAI's form), parsed here into the
object the templates read (``arguments | tojson``, ``arguments.items()``), as vLLM does.
Every refusal is a ValueError (INVALID_ARGUMENT).
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from engine.json_values import json_size, plain_json

# A request's tools are rendered into its prompt (a template writes each one's schema): their
# JSON may be this large at most, and nest this deep (schemas nest two levels per property).
MAX_TOOLS = 512
MAX_TOOLS_BYTES = 1 << 20
MAX_TOOL_JSON_DEPTH = 32
# Calls one assistant message may record.
MAX_TOOL_CALLS = 128
MAX_TOOL_CALL_ID_CHARS = 256


def check_tools(tools: Sequence[Mapping] | None) -> list[dict] | None:
    """Plain-dict copies of ``tools`` after checking; None for none (or an empty list: a
    template's ``{% if tools %}`` takes both as no tools)."""
    out = _plain_list(tools, "tools", MAX_TOOLS)
    for i, tool in enumerate(out):
        function = _function(tool, f"tools[{i}]")
        _optional(function, "description", str, f"tools[{i}]")
        _optional(function, "parameters", dict, f"tools[{i}]")
    size = json_size(out)
    if size > MAX_TOOLS_BYTES:
        raise ValueError(f"the tools are {size} bytes of JSON; at most {MAX_TOOLS_BYTES}")
    return out or None


def check_tool_calls(calls: Sequence[Mapping] | None) -> list[dict] | None:
    """Plain-dict copies of one message's ``tool_calls``, each call's arguments an object;
    None for none (or an empty list)."""
    out = _plain_list(calls, "tool_calls", MAX_TOOL_CALLS)
    for j, call in enumerate(out):
        at = f"tool_calls[{j}]"
        function = _function(call, at)
        function["arguments"] = _arguments(function.get("arguments"), at)
        _optional(call, "id", str, at)
        _check_id_length(call.get("id", ""), f"{at}'s id")
    return out or None


def check_tool_call_id(value: str | None) -> str | None:
    """A "tool" message's answer names the call it answers (the call's id)."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"tool_call_id must be a non-empty string, got {value!r}")
    _check_id_length(value, "tool_call_id")
    return value


def _plain_list(values: Sequence | None, what: str, limit: int) -> list:
    """Plain JSON copies of the items of ``values`` (None: none), at most ``limit``."""
    if values is None:
        return []
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Sequence):
        raise ValueError(f"{what} must be a list of objects, got {type(values).__name__}")
    if len(values) > limit:
        raise ValueError(f"{len(values)} {what}; at most {limit}")
    return [plain_json(v, f"{what}[{i}]", MAX_TOOL_JSON_DEPTH, what)
            for i, v in enumerate(values)]


def _check_id_length(value: str, what: str) -> None:
    if len(value) > MAX_TOOL_CALL_ID_CHARS:
        raise ValueError(f"{what} is {len(value)} characters; at most {MAX_TOOL_CALL_ID_CHARS}")


def parse_json(text: str, where: str) -> Any:
    """The value of one JSON text a client sent (a tool, a call); ValueError when it is not
    JSON, or nests past what the parser takes."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"{where} nests deeper than {MAX_TOOL_JSON_DEPTH} levels") from None
    except ValueError as e:
        raise ValueError(f"{where} is not JSON ({e}): {text[:80]!r}") from None


def _function(obj: Any, where: str) -> dict:
    """``obj``'s "function", checked to be a function with a name (``obj`` plain JSON)."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where} must be an object, got {type(obj).__name__}")
    if obj.get("type", "function") != "function":
        raise ValueError(f"{where}'s type must be 'function', got {obj['type']!r}")
    function = obj.get("function")
    if not isinstance(function, dict):
        raise ValueError(f"{where} must have a 'function' object")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}'s function must have a non-empty string 'name'")
    return function


def _optional(obj: dict, key: str, kind: type, where: str) -> None:
    if key in obj and not isinstance(obj[key], kind):
        what = "an object" if kind is dict else "a string"
        raise ValueError(f"{where}'s {key} must be {what}, got {type(obj[key]).__name__}")


def _arguments(arguments: Any, where: str) -> dict:
    if isinstance(arguments, str):
        arguments = parse_json(arguments, f"{where}'s arguments")
        # json.loads takes NaN and Infinity, which no template's tojson writes back
        arguments = plain_json(arguments, f"{where}'s arguments", MAX_TOOL_JSON_DEPTH,
                               "tool_calls")
    if not isinstance(arguments, dict):
        raise ValueError(f"{where}'s arguments must be a JSON object (or its text), "
                         f"got {type(arguments).__name__}")
    return arguments
