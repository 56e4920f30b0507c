"""Refusals kept by the text refused: a pattern or schema that costs a second of compiling to
refuse (engine/regex_dfa.py's build budget, engine/compile_budget.py's) costs a client that
sends it again nothing. ``functools.lru_cache`` keeps results only."""
from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class Refusals:
    """The ValueError messages of the last ``kept`` texts refused, by their digest (a text
    may be 200000 characters long)."""

    def __init__(self, kept: int) -> None:
        if kept < 1:
            raise ValueError(f"Refusals must keep at least 1, not {kept}")
        self.kept = kept
        self._messages: dict[bytes, str] = {}
        self._lock = threading.Lock()

    def call(self, text: str, compile_text: Callable[[], T]) -> T:
        """``compile_text()``, or the ValueError it raised when ``text`` was last seen."""
        key = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        refused = self._messages.get(key)
        if refused is not None:
            raise ValueError(refused)
        try:
            return compile_text()
        except ValueError as e:
            with self._lock:
                self._messages[key] = str(e)
                while len(self._messages) > self.kept:
                    self._messages.pop(next(iter(self._messages)))
            raise

    def __len__(self) -> int:
        return len(self._messages)
