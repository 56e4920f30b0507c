"""Token-level guidance by a regular expression (vLLM's guided_regex; guided_json through it).

The output text must fully match the pattern. ``TokenGuide`` joins the pattern's character
automaton (engine/regex_dfa.py) with the vocabulary's token bytes (engine/token_bytes.py):
at each step the tokens allowed are those whose bytes keep the text on a path to a match,
and eos once the text is a whole match.

A guide state is the automaton's state plus the bytes of a character begun but not finished
(a byte-level token may end halfway through a multi-byte character). Finding the allowed
tokens walks a trie of the vocabulary's texts (``TokenTrie``) once per guide state, a depth at
a time over arrays (engine/trie_walk.py), pruning a branch as soon as its text leaves the
pattern, so tokens sharing a beginning are walked together; the answer is cached, and a
request's cursor advances by its new tokens only. The first walk of each state is the cost of
guidance (``pdserve bench guided``: cold vs warm): a pattern that counts (``{0,400}``, a
string's ``maxLength``) has a state per count, but the states of a count far from its end look
alike as far as any token reaches, and share one walk (``TokenGuide._key``): a count costs
about as many walks as the longest token has bytes.

Every state the automaton reports is live (some text from it matches), and a branch ending
inside a character is kept only when some character with those first bytes goes on, so an
allowed token never leads to a state with nothing allowed: the text can always go on to a
match or end there. That needs a vocabulary that can spell any character (byte-level ones
have all 256 bytes); where one cannot spell what the pattern takes next (a SentencePiece
vocabulary without byte fallback), eos is allowed there and the output ends unmatched. The
mask depends on the output alone, so a request moved to another engine (its first token
sampled by a prefill worker, a migration) goes on there.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

import torch

from engine.regex_dfa import DEAD, RegexDfa
from engine.trie_walk import TrieWalker, flatten

logger = logging.getLogger(__name__)

# Token ids of the allowed sets a guide keeps (one set per guide state the requests reach,
# up to the vocabulary's size each): 4M int32 ids is 16 MB, ~30 states of a 128k vocabulary
# allowing most of it, thousands of a JSON schema's narrow ones.
_ALLOWED_CACHE_IDS = 1 << 22
# States whose automata agree as far as any token reaches share one allowed set (see
# TokenGuide._key): signatures kept per (state, depth), at most this many before they (and the
# sets keyed by them) are dropped and built again.
_MAX_SIGNATURES = 1 << 20
# Past this many bytes in a token, states are not compared (the comparison recurses that deep).
_MAX_SHARED_DEPTH = 256
_DEAD_SIGNATURE = -1


@dataclass(frozen=True)
class GuideState:
    dfa_state: int
    # The first bytes of a character whose last bytes the next tokens must bring.
    pending: bytes = b""


@dataclass
class _TrieNode:
    children: dict[str, "_TrieNode"] = field(default_factory=dict)
    # Tokens whose text ends here.
    token_ids: list[int] = field(default_factory=list)
    # Tokens whose text ends here and then begin one more character: (the code points that
    # character may be, lo and hi; token id).
    tails: list[tuple[int, int, int]] = field(default_factory=list)


class TokenTrie:
    """The vocabulary's texts as a trie of characters; built once per tokenizer.

    A text guide state (no character begun) steps the automaton once per character, a
    dictionary lookup, rather than per byte. The tokens that begin by finishing a character
    (their first byte a continuation byte) are kept apart: they can follow only a token that
    began that character, and are then fed byte by byte."""

    def __init__(self, token_bytes: Sequence[bytes | None]) -> None:
        self.token_bytes = list(token_bytes)
        self.root = _TrieNode()
        self.continuations: list[int] = []
        for token_id, data in enumerate(self.token_bytes):
            if data:
                self._add(token_id, data)
        self.levels = flatten(self.root)  # walked a depth at a time (engine/trie_walk.py)
        self.max_token_bytes = max((len(b) for b in self.token_bytes if b), default=0)

    def _add(self, token_id: int, data: bytes) -> None:
        text, tail = _split_utf8(data)
        span = _code_point_span(tail) if tail else None
        if text is None or (tail and span is None):
            self.continuations.append(token_id)
            return
        node = self.root
        for ch in text:
            node = node.children.setdefault(ch, _TrieNode())
        if tail:
            node.tails.append((*span, token_id))
        else:
            node.token_ids.append(token_id)


def _split_utf8(data: bytes) -> tuple[str | None, bytes]:
    """``data`` as whole characters and the first bytes of one more (at most 3); None for the
    text when it does not start on a character."""
    for cut in range(len(data), max(len(data) - 4, -1), -1):
        try:
            return data[:cut].decode("utf-8"), data[cut:]
        except UnicodeDecodeError:
            continue
    return None, data


_SECOND_BYTE = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}


def _utf8_length(lead: int) -> int:
    """Bytes in a character that starts with byte ``lead``; 0 when none starts so."""
    if lead < 0x80:
        return 1
    if 0xC2 <= lead <= 0xDF:
        return 2
    if 0xE0 <= lead <= 0xEF:
        return 3
    if 0xF0 <= lead <= 0xF4:
        return 4
    return 0


def _code_point_span(pending: bytes) -> tuple[int, int] | None:
    """The code points whose UTF-8 begins with ``pending`` (a character begun, not finished),
    as [lo, hi]; None when no character begins so."""
    need = _utf8_length(pending[0])
    if not 1 < need > len(pending):
        return None
    # Lead bytes E0, ED, F0 and F4 narrow their second byte's range (no overlong forms, no
    # surrogates, nothing past U+10FFFF); the rest take any continuation byte.
    second = _SECOND_BYTE.get(pending[0], (0x80, 0xBF))
    if len(pending) >= 2 and not second[0] <= pending[1] <= second[1]:
        return None
    lo, hi = bytearray(pending), bytearray(pending)
    if len(pending) == 1:
        lo.append(second[0])
        hi.append(second[1])
    lo += b"\x80" * (need - len(lo))
    hi += b"\xbf" * (need - len(hi))
    return ord(bytes(lo).decode("utf-8")), ord(bytes(hi).decode("utf-8"))


class TokenGuide:
    """One pattern's guidance over one vocabulary; shared by every request with the pattern."""

    def __init__(self, dfa: RegexDfa, trie: TokenTrie, eos_token_ids: Sequence[int]) -> None:
        self.dfa = dfa
        self.trie = trie
        self.eos_token_ids = list(eos_token_ids)
        self.start = GuideState(dfa.start)
        self._walker = TrieWalker(dfa, trie.levels)
        self._allowed: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self._num_cached_ids = 0
        # A walk reads at most a token's bytes of characters ahead (and one more's runs, for a
        # character a token ends inside).
        self._depth = trie.max_token_bytes + 1
        self._signatures: dict[tuple[int, int], int] = {}
        self._signature_ids: dict[tuple, int] = {}

    def feed_byte(self, state: GuideState, b: int) -> GuideState | None:
        """The state after one more byte; None when the text leaves the pattern."""
        data = state.pending + bytes([b])
        need = _utf8_length(data[0])
        if need == 0 or (len(data) > 1 and not 0x80 <= b <= 0xBF):
            return None
        if len(data) < need:
            span = _code_point_span(data)
            if span is None or not self.dfa.accepts_some(state.dfa_state, *span):
                return None
            return GuideState(state.dfa_state, data)
        try:
            ch = data.decode("utf-8")
        except UnicodeDecodeError:  # an overlong form or a surrogate
            return None
        nxt = self.dfa.step(state.dfa_state, ch)
        return None if nxt == DEAD else GuideState(nxt)

    def advance(self, state: GuideState, token_id: int) -> GuideState | None:
        """The state after a token; None when the token leaves the pattern (or has no text)."""
        if token_id in self.eos_token_ids and self.can_end(state):
            # Sampled where the text may end, yet the output went on: min_tokens held the
            # end back. It adds no text: the text may still end here, and only here.
            return state
        data = self.trie.token_bytes[token_id] if 0 <= token_id < len(self.trie.token_bytes) \
            else None
        if not data:
            return None
        for b in data:
            state = self.feed_byte(state, b)
            if state is None:
                return None
        return state

    def can_end(self, state: GuideState) -> bool:
        return not state.pending and self.dfa.is_accepting(state.dfa_state)

    def allowed(self, state: GuideState) -> torch.Tensor:
        """The token ids that may come next ([n] int32; never empty)."""
        key = self._key(state)
        ids = self._allowed.get(key)
        if ids is not None:
            self._allowed.move_to_end(key)
            return ids
        found = self._walk(state)
        if self.can_end(state) or not found:
            # Nothing goes on where the vocabulary cannot spell any character the pattern
            # takes next (a SentencePiece vocabulary without byte fallback): the output
            # ends there rather than be sampled unguided, as an empty mask would be.
            found += self.eos_token_ids
        ids = torch.tensor(sorted(set(found)), dtype=torch.int32)
        self._allowed[key] = ids
        self._num_cached_ids += ids.numel()
        while self._num_cached_ids > _ALLOWED_CACHE_IDS and len(self._allowed) > 1:
            self._num_cached_ids -= self._allowed.popitem(last=False)[1].numel()
        return ids

    def _key(self, state: GuideState) -> tuple:
        """What a state's allowed set depends on. A walk from a state reads the automaton no
        further than the longest token reaches, so two states whose runs and next states
        agree to that depth allow the same tokens: the states of a count (``{4,40}``, a
        string's ``maxLength``) far from its end share one walk instead of one each."""
        if self._depth > _MAX_SHARED_DEPTH:
            return (state,)
        if len(self._signatures) > _MAX_SIGNATURES:
            self._signatures.clear()
            self._signature_ids.clear()
            self._allowed.clear()
            self._num_cached_ids = 0
        return (self.can_end(state), self._signature(state.dfa_state, self._depth),
                state.pending)

    def _signature(self, dfa_state: int, depth: int) -> int:
        """An id equal for two states exactly when their runs, and their next states' to
        ``depth`` - 1, are equal."""
        got = self._signatures.get((dfa_state, depth))
        if got is not None:
            return got
        cuts, nexts = self.dfa.runs(dfa_state)
        if depth == 0:
            shape = (tuple(cuts), tuple(n == DEAD for n in nexts))
        else:
            shape = (tuple(cuts), tuple(_DEAD_SIGNATURE if n == DEAD
                                        else self._signature(n, depth - 1) for n in nexts))
        sig = self._signature_ids.setdefault((depth, shape), len(self._signature_ids))
        self._signatures[(dfa_state, depth)] = sig
        return sig

    def _walk(self, state: GuideState) -> list[int]:
        if state.pending:  # only a token finishing the character goes on
            return [t for t in self.trie.continuations if self.advance(state, t) is not None]
        return self._walker.walk(state.dfa_state).tolist()


@dataclass
class GuideCursor:
    """A request's place in its guide: the state after its first ``consumed`` output tokens."""
    guide: TokenGuide
    state: GuideState
    consumed: int = 0

    @classmethod
    def after(cls, guide: TokenGuide, output_token_ids: Sequence[int], what: str) -> "GuideCursor":
        """The cursor past an output so far (a resumed or prefilled request's); ValueError
        when that output already left the pattern."""
        cursor = cls(guide, guide.start)
        cursor.catch_up(output_token_ids, what)
        return cursor

    def catch_up(self, output_token_ids: Sequence[int], what: str = "the pattern") -> None:
        for token_id in output_token_ids[self.consumed:]:
            nxt = self.guide.advance(self.state, token_id)
            if nxt is None:
                raise ValueError(f"the output so far does not match {what} at its token "
                                 f"{self.consumed} (id {token_id})")
            self.state = nxt
            self.consumed += 1

    def allowed(self, output_token_ids: Sequence[int]) -> torch.Tensor:
        """The next token's allowed ids after ``output_token_ids`` (this request's output)."""
        try:
            self.catch_up(output_token_ids)
        except ValueError as e:
            # Only a sampled token outside the mask gets here (a bug): the output ends,
            # rather than the engine's step failing every request with it.
            logger.error("guided output left its pattern (%s): ending it", e)
            return torch.tensor(self.guide.eos_token_ids, dtype=torch.int32)
        return self.guide.allowed(self.state)
