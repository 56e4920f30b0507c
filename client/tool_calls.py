"""Tool calls out of a model's reply, for models whose chat template asks for Hermes' call
syntax (Qwen2.5, Qwen3, the Hermes models): each call a JSON object ``{"name", "arguments"}``
between ``<tool_call>`` and ``</tool_call>``. The router streams the reply as the model wrote
it; this turns it into OpenAI's form, ready to go back as the assistant's message of the next
turn (``Chat(tools=...)``, engine/chat_tools.py), each call's answer a "tool" message naming
the call's id.

As vLLM's Hermes parser does, a reply whose calls do not all parse (a call cut short by
max_tokens, JSON the model got wrong) has no calls: the whole text is its content.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

HERMES_OPEN = "<tool_call>"
# A call, or the last one left open (the reply ended inside it).
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # the JSON text of an object, as OpenAI's API returns it

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedReply:
    content: str | None  # the text before the first call; None when there is none
    tool_calls: list[ToolCall] = field(default_factory=list)

    def as_message(self) -> dict[str, Any]:
        """The reply as the next turn's assistant message."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            msg["tool_calls"] = [c.as_dict() for c in self.tool_calls]
        elif self.content is None:
            msg["content"] = ""
        return msg


def parse_hermes_tool_calls(text: str) -> ParsedReply:
    """``text``'s calls, in order, each with a fresh id (``call_`` and 24 hex digits)."""
    if HERMES_OPEN not in text:
        return ParsedReply(text)
    calls = []
    for match in _CALL.finditer(text):
        body = match.group(1) if match.group(1) is not None else match.group(2)
        call = _call(body)
        if call is None:
            return ParsedReply(text)
        calls.append(call)
    return ParsedReply(text[:text.index(HERMES_OPEN)].strip() or None, calls)


def _call(body: str) -> ToolCall | None:
    return call_from_object(json_or_none(body), ("arguments",))


def json_or_none(text: str) -> Any:
    """``text``'s JSON value; None when it is no JSON (callers check the value's type)."""
    try:
        return json.loads(text)
    except ValueError:
        return None


def call_from_object(obj: Any, argument_keys: tuple[str, ...],
                     new_id: Callable[[], str] | None = None) -> ToolCall | None:
    """A call written as a JSON object ``{"name", <arguments>}``, its arguments under the
    first of ``argument_keys`` it has (none: no arguments); None when it is no such call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in argument_keys if k in obj), None)
    return new_call(obj["name"], {} if key is None else obj[key], new_id)


def new_call(name: str, arguments: Any, new_id: Callable[[], str] | None = None
             ) -> ToolCall | None:
    """A call of ``name`` with ``arguments`` (a JSON object, or its text: some models write
    that) and a fresh id (OpenAI's form unless ``new_id``); None when the arguments are no
    JSON object."""
    if isinstance(arguments, str):
        arguments = json_or_none(arguments)
    if not isinstance(arguments, dict):
        return None
    try:
        text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError):  # NaN or an infinity; a set, bytes: no JSON
        return None
    return ToolCall((new_id or openai_call_id)(), name, text)


def openai_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
