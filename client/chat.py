"""A chat prompt as the SDK sends it: ``Chat`` and its ``ChatPrompt`` message."""
from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf import struct_pb2

from protos import router_pb2

# A Struct carries numbers as doubles: an int past this would reach the template changed.
_EXACT_INT = 2 ** 53
_MESSAGE_KEYS = {"role", "content"}
_OPTIONAL_KEYS = {"name", "tool_calls", "tool_call_id"}


@dataclass
class Chat:
    """A conversation as the prompt: the router renders it with the model's chat template and
    the model answers as the assistant. A plain list of messages is the same as ``Chat(list)``.
    Messages are ``{"role": ..., "content": ...}`` dicts, with a ``"name"`` optionally, and
    OpenAI's tool-use keys: an assistant's ``"tool_calls"`` (its content may be None then),
    a "tool" message's ``"tool_call_id"``.

    The options are vLLM's: ``continue_final_message`` leaves the last message, an
    assistant's, open for the model to continue (a reply the caller has begun) instead of
    opening a new assistant turn; ``add_generation_prompt`` (None: True unless continuing)
    whether the template opens that turn; ``chat_template_kwargs`` extra template variables
    (JSON values, e.g. ``{"enable_thinking": False}``); ``chat_template_name`` one of the
    model's named templates (``ModelInfo.chat_template_names``); ``tools`` the functions
    the model may call (OpenAI's ``{"type": "function", "function": {"name", "description",
    "parameters"}}``), for a template that renders them. The reply is text in the model's
    own call syntax (``parse_tool_calls`` reads Hermes' and others'). ``chat_template`` a Jinja
    template of the caller's own to render with, on a router that accepts one
    (``ModelInfo.accepts_request_chat_template``)."""

    messages: Sequence[Mapping[str, str]]  # [{"role": "user", "content": "Hi"}, ...]
    continue_final_message: bool = False
    add_generation_prompt: bool | None = None
    chat_template_kwargs: Mapping[str, Any] | None = None
    chat_template_name: str | None = None
    tools: Sequence[Mapping[str, Any]] | None = None
    chat_template: str | None = None


def chat_prompt(chat: Chat, sendable_text) -> router_pb2.ChatPrompt:
    """``chat`` as the wire's message; TypeError for what it cannot carry. ``sendable_text``
    checks a text encodes (client/types.py's)."""
    msgs = chat.messages
    if not _is_list(msgs):
        raise TypeError("Chat.messages must be a list of {'role': ..., 'content': ...} dicts")
    out = router_pb2.ChatPrompt(continue_final_message=bool(chat.continue_final_message))
    if chat.add_generation_prompt is not None:
        out.add_generation_prompt = bool(chat.add_generation_prompt)
    if chat.chat_template_name is not None:
        if not isinstance(chat.chat_template_name, str) or not chat.chat_template_name:
            raise TypeError("Chat.chat_template_name must be a non-empty str")
        out.chat_template_name = sendable_text(chat.chat_template_name, "chat_template_name")
    if chat.chat_template is not None:
        if not isinstance(chat.chat_template, str) or not chat.chat_template:
            raise TypeError("Chat.chat_template must be a non-empty str (a Jinja template)")
        out.chat_template = sendable_text(chat.chat_template, "chat_template")
    if chat.chat_template_kwargs is not None:
        if not isinstance(chat.chat_template_kwargs, Mapping):
            raise TypeError("Chat.chat_template_kwargs must be a dict of names to JSON values")
        _fill_struct(out.chat_template_kwargs, chat.chat_template_kwargs,
                     "chat_template_kwargs", sendable_text)
    if chat.tools is not None:
        if not _is_list(chat.tools):
            raise TypeError("Chat.tools must be a list of tool dicts")
        out.tools.extend(_json_object(tool, f"tools[{i}]", sendable_text)
                         for i, tool in enumerate(chat.tools))
    for i, m in enumerate(msgs):
        _add_message(out, m, f"chat message {i}", sendable_text)
    return out


def _add_message(out: router_pb2.ChatPrompt, m: Any, where: str, text) -> None:
    if not (isinstance(m, Mapping) and isinstance(m.get("role"), str) and "content" in m):
        raise TypeError(f"{where} must be a dict with str 'role' and 'content', got {m!r}")
    if set(m) - _MESSAGE_KEYS - _OPTIONAL_KEYS:
        raise TypeError(f"{where} may have only the keys 'role', 'content', "
                        f"{', '.join(map(repr, sorted(_OPTIONAL_KEYS)))}, "
                        f"got {sorted(map(str, m))}")
    calls, content = m.get("tool_calls"), m["content"]
    if content is None and calls:
        content = ""  # OpenAI's assistant message that only calls tools
    if not isinstance(content, str):
        raise TypeError(f"{where}'s content must be a str (None beside tool_calls), "
                        f"got {content!r}")
    msg = out.messages.add(role=text(m["role"], f"{where}'s role"),
                           content=text(content, f"{where}'s content"))
    for key in ("name", "tool_call_id"):
        if key in m:
            if not isinstance(m[key], str):
                raise TypeError(f"{where}'s {key} must be a str, got {m[key]!r}")
            setattr(msg, key, text(m[key], f"{where}'s {key}"))
    if calls is not None:
        if not _is_list(calls):
            raise TypeError(f"{where}'s tool_calls must be a list of call dicts")
        msg.tool_calls.extend(_json_object(call, f"{where}'s tool_calls[{j}]", text)
                              for j, call in enumerate(calls))


def _is_list(value: Any) -> bool:
    """A list or tuple of items: not a text, and not a dict (a Sequence of its keys)."""
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes, Mapping))


def _json_object(value: Any, where: str, text) -> str:
    """``value``'s JSON text: a Struct would not keep its keys' order, which a template
    writes back (``tojson``) into the prompt."""
    if not isinstance(value, Mapping):
        raise TypeError(f"{where} must be a dict, got {type(value).__name__}")
    try:
        encoded = json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:  # a set, a NaN, a circular reference, ...
        raise TypeError(f"{where} is not JSON: {e}") from None
    return text(encoded, where)


def _fill_struct(struct: struct_pb2.Struct, values: Mapping, where: str, text) -> None:
    for k, v in values.items():
        if not isinstance(k, str):
            raise TypeError(f"{where} has the key {k!r}: keys must be str")
        _fill_value(struct.fields[text(k, f"{where}'s key")], v, f"{where}[{k!r}]", text)


def _fill_value(out: struct_pb2.Value, v: Any, where: str, text) -> None:
    if v is None:
        out.null_value = struct_pb2.NULL_VALUE
    elif isinstance(v, bool):  # before int: a bool is one
        out.bool_value = v
    elif isinstance(v, int):
        if abs(v) > _EXACT_INT:
            raise TypeError(f"{where} is {v}: integers beyond 2**53 do not travel exactly")
        out.number_value = v
    elif isinstance(v, float):
        if not math.isfinite(v):
            raise TypeError(f"{where} is {v}: JSON has no such number")
        out.number_value = v
    elif isinstance(v, str):
        out.string_value = text(v, where)
    elif isinstance(v, Mapping):
        out.struct_value.SetInParent()
        _fill_struct(out.struct_value, v, where, text)
    elif isinstance(v, (list, tuple)):
        out.list_value.SetInParent()
        for i, x in enumerate(v):
            _fill_value(out.list_value.values.add(), x, f"{where}[{i}]", text)
    else:
        raise TypeError(f"{where} is a {type(v).__name__}: only JSON values (None, bool, "
                        "int, float, str, lists and str-keyed dicts) can be sent")
