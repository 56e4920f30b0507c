"""Which texts a request's output may become, and the cursor that guides it there.

A request follows at most one guide (SamplingParams.guide): ``guided_choice`` (one of some
texts, engine/guided_choice.py), ``guided_regex`` (text matching a pattern) or
``guided_json`` (JSON valid under a schema, turned into a pattern by
engine/json_schema_regex.py); the two patterns guide through engine/guided_regex.py.

The router checks that a pattern compiles (``check_guide``: no tokenizer needed) so that a
bad one is refused before any worker is picked; an engine builds the request's cursor
(``Guides.cursor``), whose allowed tokens the sampler keeps at each step.
"""
from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from typing import Sequence

from engine.compile_cache import CompileCache
from engine.guided_choice import ChoiceCursor, check_choice_prefix, tokenize_choices
from engine.json_schema_regex import schema_to_regex
from engine.regex_dfa import compile_regex
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

# Compiled guides an engine keeps, by pattern: requests of a kind repeat theirs. Each holds
# up to 16 MB of allowed sets (engine/guided_regex.py) besides its automaton.
_GUIDES_KEPT = 16


# Schemas' regexes, and refusals: one refused can have cost its whole compile budget
# (engine/compile_budget.py).
_SCHEMAS: CompileCache[str] = CompileCache(kept=64, refused=256)


def _schema_pattern(schema_text: str, whitespace: str | None) -> str:
    key = json.dumps([schema_text, whitespace])
    return _SCHEMAS.call(key, lambda: _compile_schema(schema_text, whitespace))


def _compile_schema(schema_text: str, whitespace: str | None) -> str:
    try:
        schema = json.loads(schema_text)
    except json.JSONDecodeError as e:
        raise ValueError(f"guided_json is not JSON: {e}") from None
    return schema_to_regex(schema, whitespace)


def guide_pattern(params: SamplingParams) -> str | None:
    """The regular expression the output must match (guided_regex, or guided_json's)."""
    if params.guided_regex:
        return params.guided_regex
    if params.guided_json:
        return _schema_pattern(params.guided_json, params.guided_whitespace_pattern)
    return None


def check_guide(params: SamplingParams) -> None:
    """ValueError when the request's pattern or schema cannot guide (the router's check)."""
    pattern = guide_pattern(params)
    if pattern is not None:
        compile_regex(pattern)


class Guides:
    """An engine's guided decoding: the cursor each guided request samples through."""

    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids)
        self._guides: OrderedDict[tuple, object] = OrderedDict()  # by _guide_key
        # Guides are built in threads (warm) while requests are added on a loop: the cache is
        # shared, the building is not locked (a second request for a pattern being built
        # builds it too, rather than hold its thread, or the loop, on the first).
        self._lock = threading.Lock()

    def ready(self, params: SamplingParams) -> bool:
        """Whether ``cursor(params, ...)`` is quick: no pattern guide, or its guide built."""
        if not params.has_pattern_guide or self.tokenizer is None:
            return True
        with self._lock:
            return _guide_key(params) in self._guides

    def warm(self, params: SamplingParams) -> None:
        """Builds the guide ``params`` follow (a schema's compile, its automaton, the
        vocabulary's trie at the first), so that ``cursor`` finds it: for a caller that must
        not wait on that, in a thread. ValueError as ``cursor`` raises it."""
        if params.has_pattern_guide and self.tokenizer is not None:
            self._guide(params)

    @functools.cached_property
    def _trie(self):
        from engine.guided_regex import TokenTrie
        from engine.token_bytes import token_byte_strings

        # (Python 3.11's cached_property builds it once; later ones may build it twice.)
        return TokenTrie(token_byte_strings(self.tokenizer))

    def cursor(self, params: SamplingParams, output_token_ids: list[int]):
        """The request's cursor past ``output_token_ids`` (what it resumes from); None when it
        has no guide. ValueError when the guide cannot be followed, or the output so far
        already left it."""
        if params.guide is None:
            return None
        if self.tokenizer is None:
            raise ValueError(f"{params.guide} needs a model with a tokenizer")
        if not self.eos_token_ids:
            raise ValueError(f"{params.guide} ends the output with the model's eos token, and "
                             "this model has none")
        if params.guided_choice:
            seqs = tokenize_choices(self.tokenizer, params.guided_choice)
            check_choice_prefix(seqs, output_token_ids)
            return ChoiceCursor(seqs, self.eos_token_ids)
        from engine.guided_regex import GuideCursor

        return GuideCursor.after(self._guide(params), output_token_ids, params.guide)

    def _guide(self, params: SamplingParams):
        from engine.guided_regex import TokenGuide

        key = _guide_key(params)
        with self._lock:
            guide = self._guides.get(key)
            if guide is not None:
                self._guides.move_to_end(key)
                return guide
        guide = TokenGuide(compile_regex(guide_pattern(params)), self._trie, self.eos_token_ids)
        with self._lock:
            guide = self._guides.setdefault(key, guide)  # one built meanwhile wins
            self._guides.move_to_end(key)
            if len(self._guides) > _GUIDES_KEPT:
                self._guides.popitem(last=False)
        return guide


def _guide_key(params: SamplingParams) -> tuple:
    """What a pattern guide is kept by: the request's own text (a schema's compile is what
    finding its guide must not cost)."""
    if params.guided_regex:
        return ("regex", params.guided_regex)
    return ("json", params.guided_json, params.guided_whitespace_pattern)
