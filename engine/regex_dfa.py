"""Guided decoding by regular expression (vLLM's ``guided_regex``): a character-level DFA.

The engine keeps each request's output inside the language of a client's regex: the whole
output must match it as ``re.fullmatch(pattern, output, re.ASCII)`` would. At every step it
walks each candidate token's characters from the request's current state, so the automaton is
deterministic, incremental and cheap to step:

* ``engine/regex_parse.py`` parses the pattern into a small tree, refusing what is not
  supported and what would be too large before building anything;
* the tree becomes a Thompson NFA (character states with one ranged edge, branch states with
  epsilon edges, one accepting state), built backwards from the accepting state so that no
  edge ever needs patching;
* NFA states that cannot reach acceptance are marked dead once, and left out of every subset:
  so a DFA state is either DEAD (its trimmed subset is empty) or LIVE, some continuation of
  the text reaches acceptance. The engine relies on this: a token that does not step to DEAD
  never leads the output into a dead end;
* the DFA is built lazily: a state is an interned frozenset of live NFA states (character
  states, and the accepting state), numbered as first reached, and each (state, character)
  transition is computed once and cached (a dict per state, keyed by the character). Only
  the states and characters that generation actually touches are ever built, so a pattern
  whose full DFA would be exponential costs only what is walked (and nothing is freed: a
  compiled pattern keeps every state and transition it has made).

Supported syntax (a subset of Python ``re``; where both accept a pattern, same language):
literals; escaped punctuation (``\\.``, ``\\*``, ``\\\\``, ...: any escaped character but an
ASCII letter or digit is itself); ``\\n \\t \\r \\f \\v \\a``, ``\\xHH``, ``\\uHHHH``,
``\\UHHHHHHHH``, octal ``\\0`` to ``\\077`` (inside a class also ``\\1`` to ``\\377``; outside,
those would be backreferences); ``\\d \\D \\w \\W \\s \\S`` with their ASCII meanings (``\\w`` is
``[A-Za-z0-9_]``, ``\\s`` is ``[ \\t\\n\\r\\f\\v]``), as under ``re.ASCII``; ``.`` (any character
but newline); classes ``[...]`` and ``[^...]`` with ranges, escapes and categories (a leading ``]``
or a leading or trailing ``-`` is literal; ``\\b`` in a class is backspace); groups ``(...)``,
``(?:...)``, ``(?P<name>...)`` (all only group); ``|`` (empty branches allowed); the empty
pattern; ``* + ? {n} {n,} {,m} {n,m}``, greedy or lazy (``*?`` and so on: the same language
under fullmatch). As in ``re``, a ``{`` that does not open a well-formed count is a literal
``{`` (``a{x``, ``a{}``, ``a{1,2``). ``^`` or ``\\A`` as the pattern's first token and ``$`` or
``\\Z`` as its last are accepted and change nothing: the text is matched whole anyway (``re``'s
``$`` may also match before a final newline, but fullmatch would still have to match that
newline, so it never changes the outcome).

Refused with ValueError: backreferences, lookarounds, inline flags, ``\\b \\B``, atomic groups,
possessive quantifiers, conditionals, comments, anchors anywhere else, ``\\N{...}``, unknown
escapes, a repeat of nothing or of a repeat, unbalanced parentheses or brackets, backward
ranges, and a pattern that matches no text at all (the engine could generate nothing). Limits
(also ValueError): MAX_PATTERN_LENGTH characters, MAX_REPEAT for a count, MAX_NESTING group
depth, MAX_NFA_STATES states with counted repeats expanded, checked before the NFA is built.

A compiled DFA is shared by every request with the same pattern (``compile_regex`` caches
them) and may be stepped from several threads: lookups of cached transitions take no lock;
making a new state does.
"""
from __future__ import annotations

import functools
import threading
from bisect import bisect_right
from dataclasses import dataclass

from engine.regex_parse import (MAX_NESTING, MAX_NFA_STATES, MAX_PATTERN_LENGTH, MAX_REPEAT,
                                Alt, Chars, Concat, Node, Repeat, parse)

__all__ = ["DEAD", "MAX_NESTING", "MAX_NFA_STATES", "MAX_PATTERN_LENGTH", "MAX_REPEAT",
           "RegexDfa", "compile_regex"]

DEAD = -1


@dataclass
class Nfa:
    """A Thompson NFA. State s is a character state when ``target[s] >= 0`` (one edge, on the
    code points in ranges ``los[s][i]..his[s][i]``), else a branch state with ``eps[s]``."""
    eps: list[tuple[int, ...]]
    los: list[tuple[int, ...]]
    his: list[tuple[int, ...]]
    target: list[int]
    accept: int
    start: int = -1


class _Builder:
    def __init__(self):
        self.nfa = Nfa(eps=[()], los=[()], his=[()], target=[-1], accept=0)

    def new_state(self, eps=(), ranges=(), target=-1) -> int:
        nfa = self.nfa
        nfa.eps.append(eps)
        nfa.los.append(tuple(lo for lo, _ in ranges))
        nfa.his.append(tuple(hi for _, hi in ranges))
        nfa.target.append(target)
        return len(nfa.target) - 1

    def build(self, node: Node, out: int) -> int:
        """The entry state of an automaton for ``node`` that continues to state ``out``."""
        if isinstance(node, Chars):
            return self.new_state(ranges=node.ranges, target=out)
        if isinstance(node, Concat):
            for item in reversed(node.items):
                out = self.build(item, out)
            return out
        if isinstance(node, Alt):
            branch = self.new_state()
            self.nfa.eps[branch] = tuple(self.build(item, out) for item in node.items)
            return branch
        return self.repeat(node, out)

    def repeat(self, node: Repeat, out: int) -> int:
        # Sizes must stay as Repeat.size counts them: the parser refuses on that count.
        eps, x = self.nfa.eps, node.item
        if node.hi is None:
            loop = self.new_state()  # x then loop: back into x, or on
            body = self.build(x, loop)
            eps[loop] = (body, out)
            cur, copies = (loop, 0) if node.lo == 0 else (body, node.lo - 1)
        else:
            cur, copies = out, node.lo
            for _ in range(node.hi - node.lo):  # x(x(x)?)? from the inside out
                optional = self.new_state()
                eps[optional] = (self.build(x, cur), out)
                cur = optional
        for _ in range(copies):
            cur = self.build(x, cur)
        return cur


def build_nfa(tree: Node) -> Nfa:
    builder = _Builder()
    builder.nfa.start = builder.build(tree, builder.nfa.accept)
    return builder.nfa


def live_states(nfa: Nfa) -> list[bool]:
    """Which states can reach acceptance (an edge on an empty class leads nowhere)."""
    preds: list[list[int]] = [[] for _ in nfa.target]
    for s, (succ, target, los) in enumerate(zip(nfa.eps, nfa.target, nfa.los)):
        for t in succ:
            preds[t].append(s)
        if target >= 0 and los:
            preds[target].append(s)
    live = [False] * len(preds)
    live[nfa.accept] = True
    stack = [nfa.accept]
    while stack:
        for p in preds[stack.pop()]:
            if not live[p]:
                live[p] = True
                stack.append(p)
    return live


class RegexDfa:
    """The lazily determinized automaton of one pattern; see the module docstring."""

    def __init__(self, nfa: Nfa):
        self._nfa = nfa
        self._live = live_states(nfa)
        self._subsets: list[tuple[int, ...]] = []  # per state: its live character states
        self._accepting: list[bool] = []
        self._trans: list[dict[str, int]] = []  # per state: character -> next state
        self._ids: dict[frozenset[int], int] = {}
        self._lock = threading.Lock()
        self.start = self._intern(self._closure([nfa.start]))

    @property
    def num_states(self) -> int:
        """States made so far (DEAD not counted)."""
        return len(self._subsets)

    def step(self, state: int, ch: str) -> int:
        """The state after one character (any code point) from ``state``; DEAD stays DEAD."""
        if state < 0:
            return DEAD
        nxt = self._trans[state].get(ch)
        return self._advance(state, ch) if nxt is None else nxt

    def walk(self, state: int, text: str) -> int:
        """The state after ``text`` from ``state``: DEAD at the first character leading nowhere."""
        trans = self._trans
        for ch in text:
            if state < 0:
                return DEAD
            nxt = trans[state].get(ch)
            state = self._advance(state, ch) if nxt is None else nxt
        return state

    def accepts_some(self, state: int, lo: int, hi: int) -> bool:
        """Whether some character in code points [lo, hi] steps ``state`` to a live state: a
        guide asks it of a character whose first UTF-8 bytes are all a token holds."""
        if state < 0:
            return False
        nfa = self._nfa
        for s in self._subsets[state]:
            los = nfa.los[s]
            # Ranges are sorted and apart: the last one starting at or below hi reaches
            # furthest, so it alone can overlap [lo, hi].
            i = bisect_right(los, hi) - 1
            if i >= 0 and nfa.his[s][i] >= lo:
                return True
        return False

    def is_accepting(self, state: int) -> bool:
        """Whether the text that led to ``state`` matches the whole pattern."""
        return state >= 0 and self._accepting[state]

    def fullmatch(self, text: str) -> bool:
        return self.is_accepting(self.walk(self.start, text))

    def _advance(self, state: int, ch: str) -> int:
        """Make (or find) the transition not cached yet, and cache it."""
        cp, nfa = ord(ch), self._nfa
        seeds = []
        for s in self._subsets[state]:
            los = nfa.los[s]
            i = bisect_right(los, cp) - 1
            if i >= 0 and cp <= nfa.his[s][i]:
                seeds.append(nfa.target[s])
        nxt = self._intern(self._closure(seeds))
        self._trans[state][ch] = nxt
        return nxt

    def _closure(self, seeds: list[int]) -> frozenset[int]:
        """The live character states (and the accepting state) reached by epsilon edges."""
        nfa, live = self._nfa, self._live
        seen: set[int] = set()
        kept = []
        stack = [s for s in seeds if live[s]]
        while stack:
            s = stack.pop()
            if s in seen:
                continue
            seen.add(s)
            if nfa.target[s] >= 0 or s == nfa.accept:
                kept.append(s)
            # A live branch state may lead to dead ones; a dead one leads to no live one.
            stack.extend(t for t in nfa.eps[s] if live[t] and t not in seen)
        return frozenset(kept)

    def _intern(self, subset: frozenset[int]) -> int:
        if not subset:
            return DEAD
        sid = self._ids.get(subset)
        if sid is not None:
            return sid
        with self._lock:  # two threads must not give one subset two numbers, or one number two
            sid = self._ids.get(subset)
            if sid is None:
                sid = len(self._subsets)
                self._subsets.append(tuple(subset))
                self._accepting.append(self._nfa.accept in subset)
                self._trans.append({})
                self._ids[subset] = sid  # published last: a number seen is a state complete
        return sid


def compile_regex(pattern: str) -> RegexDfa:
    """The DFA for ``pattern`` (cached by its text); ValueError when it is invalid, unsupported,
    too large, or matches no text at all."""
    if not isinstance(pattern, str):
        raise ValueError(f"the regex must be a string, not {type(pattern).__name__}")
    return _compile(pattern)


@functools.lru_cache(maxsize=64)
def _compile(pattern: str) -> RegexDfa:
    dfa = RegexDfa(build_nfa(parse(pattern)))
    if dfa.start == DEAD:
        raise ValueError(f"the regex {pattern[:80]!r} matches no text at all")
    return dfa
