"""A chat prompt as the SDK sends it: ``Chat`` and its ``ChatPrompt`` message."""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf import struct_pb2

from protos import router_pb2

# A Struct carries numbers as doubles: an int past this would reach the template changed.
_EXACT_INT = 2 ** 53
_MESSAGE_KEYS = {"role", "content"}


@dataclass
class Chat:
    """A conversation as the prompt: the router renders it with the model's chat template and
    the model answers as the assistant. A plain list of messages is the same as ``Chat(list)``.
    Messages are ``{"role": ..., "content": ...}`` dicts, with a ``"name"`` optionally.

    The options are vLLM's: ``continue_final_message`` leaves the last message, an
    assistant's, open for the model to continue (a reply the caller has begun) instead of
    opening a new assistant turn; ``add_generation_prompt`` (None: True unless continuing)
    whether the template opens that turn; ``chat_template_kwargs`` extra template variables
    (JSON values, e.g. ``{"enable_thinking": False}``); ``chat_template_name`` one of the
    model's named templates (``ModelInfo.chat_template_names``)."""

    messages: Sequence[Mapping[str, str]]  # [{"role": "user", "content": "Hi"}, ...]
    continue_final_message: bool = False
    add_generation_prompt: bool | None = None
    chat_template_kwargs: Mapping[str, Any] | None = None
    chat_template_name: str | None = None


def chat_prompt(chat: Chat, sendable_text) -> router_pb2.ChatPrompt:
    """``chat`` as the wire's message; TypeError for what it cannot carry. ``sendable_text``
    checks a text encodes (client/types.py's)."""
    msgs = chat.messages
    if isinstance(msgs, (str, bytes, Mapping)) or not isinstance(msgs, Sequence):
        raise TypeError("Chat.messages must be a list of {'role': ..., 'content': ...} dicts")
    out = router_pb2.ChatPrompt(continue_final_message=bool(chat.continue_final_message))
    if chat.add_generation_prompt is not None:
        out.add_generation_prompt = bool(chat.add_generation_prompt)
    if chat.chat_template_name is not None:
        if not isinstance(chat.chat_template_name, str) or not chat.chat_template_name:
            raise TypeError("Chat.chat_template_name must be a non-empty str")
        out.chat_template_name = sendable_text(chat.chat_template_name, "chat_template_name")
    if chat.chat_template_kwargs is not None:
        if not isinstance(chat.chat_template_kwargs, Mapping):
            raise TypeError("Chat.chat_template_kwargs must be a dict of names to JSON values")
        _fill_struct(out.chat_template_kwargs, chat.chat_template_kwargs,
                     "chat_template_kwargs", sendable_text)
    for i, m in enumerate(msgs):
        if not (isinstance(m, Mapping) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise TypeError(f"chat message {i} must be a dict with str 'role' and 'content', "
                            f"got {m!r}")
        # "tool_calls" and the like: the router renders none of them, none is sent.
        if set(m) - _MESSAGE_KEYS - {"name"}:
            raise TypeError(f"chat message {i} may have only the keys 'role', 'content' and "
                            f"'name', got {sorted(map(str, m))}")
        msg = out.messages.add(role=sendable_text(m["role"], f"chat message {i}'s role"),
                               content=sendable_text(m["content"],
                                                     f"chat message {i}'s content"))
        if "name" in m:
            if not isinstance(m["name"], str):
                raise TypeError(f"chat message {i}'s name must be a str, got {m['name']!r}")
            msg.name = sendable_text(m["name"], f"chat message {i}'s name")
    return out


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
