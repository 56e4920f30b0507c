"""Tool calls out of a reply in the other call syntaxes chat templates ask models for, named
as vLLM's --tool-call-parser names them; Hermes' is client/tool_calls.py's.

- ``llama3_json`` (Llama 3.1-3.3 with JSON tool calling): the reply is the calls, each a JSON
  object ``{"name", "parameters"}`` ("arguments" too), several separated by ``;``, maybe after
  ``<|python_tag|>``.
- ``mistral``: the calls follow ``[TOOL_CALLS]``, as a JSON list of ``{"name", "arguments"}``
  (the v3 tokenizers') or as ``name[ARGS]{...}`` after each ``[TOOL_CALLS]`` (v11 on); the
  text before the first is content. Ids are 9 letters and digits, the only ones Mistral's
  templates take back.
- ``pythonic`` (Llama 3.2, Llama 4): the reply is a Python list of calls with keyword
  arguments of literal values, ``[get_weather(city="Oslo"), now()]``, maybe between
  ``<|python_start|>`` and ``<|python_end|>``.

``[TOOL_CALLS]``, ``<|python_tag|>`` and Llama 4's markers are special tokens: the text has
them only when the request keeps them (``skip_special_tokens=False``), as with vLLM. As for
Hermes', a reply whose calls do not all parse has none: its whole text is content.
"""
from __future__ import annotations

import ast
import json
import re
import uuid
from collections.abc import Callable

from client.tool_calls import (ParsedReply, call_from_object, json_or_none, new_call,
                               parse_hermes_tool_calls)

PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"
LLAMA4_START, LLAMA4_END = "<|python_start|>", "<|python_end|>"
# A function's name as the syntaxes without JSON around it write it.
_NAME = re.compile(r"[A-Za-z_][\w.\-]*\Z")


def parse_llama3_json_tool_calls(text: str) -> ParsedReply:
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].lstrip()
    if not body.startswith("{"):
        return ParsedReply(text)
    calls, decoder, i = [], json.JSONDecoder(), 0
    while True:
        try:
            obj, i = decoder.raw_decode(body, i)
        except ValueError:
            return ParsedReply(text)
        call = call_from_object(obj, ("parameters", "arguments"))
        if call is None:
            return ParsedReply(text)
        calls.append(call)
        rest = body[i:].lstrip()
        if not rest:
            return ParsedReply(None, calls)
        if not rest.startswith(";"):
            return ParsedReply(text)
        rest = rest[1:].lstrip()
        i = len(body) - len(rest)


def parse_mistral_tool_calls(text: str) -> ParsedReply:
    if MISTRAL_CALLS not in text:
        return ParsedReply(text)
    head, _, rest = text.partition(MISTRAL_CALLS)
    rest = rest.strip()
    if rest.startswith("["):
        calls = _mistral_list(rest)
    else:
        calls = [_mistral_call(part.strip()) for part in rest.split(MISTRAL_CALLS)]
    if not calls or None in calls:
        return ParsedReply(text)
    return ParsedReply(head.strip() or None, calls)


def _mistral_list(body: str) -> list | None:
    objs = json_or_none(body)
    if not isinstance(objs, list):
        return None
    return [call_from_object(o, ("arguments",), _mistral_id) for o in objs]


def _mistral_call(part: str):
    """``name[ARGS]{...}``, or ``name{...}``."""
    name, sep, arguments = part.partition(MISTRAL_ARGS)
    if not sep:
        brace = part.find("{")
        if brace < 0:
            return None
        name, arguments = part[:brace], part[brace:]
    name = name.strip()
    if not _NAME.match(name):
        return None
    return new_call(name, arguments.strip(), _mistral_id)


def _mistral_id() -> str:
    return uuid.uuid4().hex[:9]


def parse_pythonic_tool_calls(text: str) -> ParsedReply:
    body = text.strip()
    if body.startswith(LLAMA4_START) and body.endswith(LLAMA4_END):
        body = body[len(LLAMA4_START):-len(LLAMA4_END)].strip()
    if not (body.startswith("[") and body.endswith("]")):
        return ParsedReply(text)
    try:
        tree = ast.parse(body, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return ParsedReply(text)
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return ParsedReply(text)
    calls = [_python_call(node) for node in tree.body.elts]
    if None in calls:
        return ParsedReply(text)
    return ParsedReply(None, calls)


def _python_call(node: ast.expr):
    """``name(key=literal, ...)``: positional arguments have no name to send."""
    if not isinstance(node, ast.Call) or node.args:
        return None
    name = ast.unparse(node.func)
    if not _NAME.match(name):
        return None
    arguments = {}
    for kw in node.keywords:
        if kw.arg is None:  # **mapping
            return None
        try:
            arguments[kw.arg] = ast.literal_eval(kw.value)
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
    return new_call(name, arguments)  # None for literals JSON has no form for (sets, bytes)


TOOL_CALL_SYNTAXES: dict[str, Callable[[str], ParsedReply]] = {
    "hermes": parse_hermes_tool_calls,
    "llama3_json": parse_llama3_json_tool_calls,
    "mistral": parse_mistral_tool_calls,
    "pythonic": parse_pythonic_tool_calls,
}


def parse_tool_calls(text: str, syntax: str) -> ParsedReply:
    """``text``'s calls in ``syntax`` (one of TOOL_CALL_SYNTAXES, vLLM's parser names)."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    return TOOL_CALL_SYNTAXES[check_syntax(syntax)](text)


def check_syntax(syntax: str) -> str:
    if syntax not in TOOL_CALL_SYNTAXES:
        raise ValueError(f"no tool-call syntax {syntax!r}: one of "
                         f"{', '.join(sorted(TOOL_CALL_SYNTAXES))}")
    return syntax
