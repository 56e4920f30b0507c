"""JSON values a request hands a chat template (its kwargs, its tools, its messages' tool
calls): checked to be plain JSON, within a nesting bound, before any template sees them."""
from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any


def plain_json(value: Any, where: str, max_depth: int, root: str, depth: int = 0) -> Any:
    """A plain copy of ``value`` (None, bool, int, finite float, str, lists, dicts with
    non-empty string keys), nested ``max_depth`` levels at most below ``root``; ValueError
    naming ``where`` otherwise."""
    if depth > max_depth:
        raise ValueError(f"{root} nest deeper than {max_depth} levels")
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where} is {value}: JSON has no such number")
        return value
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str) or not k:
                raise ValueError(f"{where} has the key {k!r}: keys must be non-empty strings")
            out[k] = plain_json(v, f"{where}[{k!r}]", max_depth, root, depth + 1)
        return out
    if isinstance(value, (list, tuple)):
        return [plain_json(v, f"{where}[{i}]", max_depth, root, depth + 1)
                for i, v in enumerate(value)]
    raise ValueError(f"{where} is a {type(value).__name__}: only JSON values (null, booleans, "
                     "numbers, strings, lists and string-keyed objects) are accepted")


def json_size(value: Any) -> int:
    """The bytes of ``value``'s JSON (UTF-8), as the bounds on what a request sends count."""
    return len(json.dumps(value, ensure_ascii=False).encode())
