"""What compiling a text gave, kept by the text's digest: the last results, and the last refusals.

A pattern or schema costs up to a second of compiling to refuse (engine/regex_dfa.py's build
budget, engine/compile_budget.py's), so a client that sends one again is answered from here
at no cost; requests of one kind share a guide, so a result is reused too. Refusals are kept
apart from results, and more of them: a refusal is a short message, a result may be an
automaton of megabytes. Keys are digests: a text may be 200000 characters long.
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class CompileCache(Generic[T]):
    """The last ``kept`` results of ``call`` (least recently used out first), and the
    ValueError messages of the last ``refused`` texts refused."""

    def __init__(self, kept: int, refused: int) -> None:
        if kept < 1 or refused < 1:
            raise ValueError(f"a compile cache must keep at least 1 result and 1 refusal, "
                             f"not {kept} and {refused}")
        self.kept, self.refused = kept, refused
        self._results: OrderedDict[bytes, T] = OrderedDict()
        self._refusals: OrderedDict[bytes, str] = OrderedDict()
        self._lock = threading.Lock()

    def call(self, text: str, compile_text: Callable[[], T]) -> T:
        """``compile_text()``'s result for ``text``, or the ValueError it raised: from the
        cache when ``text`` was compiled lately. Two threads may compile one text at once
        (the lock is not held while compiling); both get an equal result."""
        key = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        with self._lock:
            if key in self._results:
                self._results.move_to_end(key)
                return self._results[key]
            refused = self._refusals.get(key)
        if refused is not None:
            raise ValueError(refused)
        try:
            result = compile_text()
        except ValueError as e:
            self._keep(self._refusals, key, str(e), self.refused)
            raise
        self._keep(self._results, key, result, self.kept)
        return result

    def _keep(self, kept: OrderedDict, key: bytes, value, most: int) -> None:
        with self._lock:
            kept[key] = value
            kept.move_to_end(key)
            while len(kept) > most:
                kept.popitem(last=False)

    @property
    def num_results(self) -> int:
        return len(self._results)

    @property
    def num_refusals(self) -> int:
        return len(self._refusals)
