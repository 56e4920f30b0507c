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
* the DFA is built whole when the pattern is compiled, breadth first from the start state: a
  state is a sorted tuple of live NFA states (character states, and the accepting state),
  numbered as first reached. Its row comes from a sweep over the range boundaries of its
  character states' classes: between two boundaries every code point moves the same NFA
  states, so one epsilon closure serves the whole run (the alphabet is partitioned per state,
  into only the classes that state tells apart), and neighbouring runs that reach the same
  state merge. A row is kept as its runs (the code points where they start, the states they
  step to: two small arrays), so ``step`` is a bisect in the state's runs and a lookup;
* the build is bounded, and refused while it is being paid: a DFA can be exponentially larger
  than its NFA (``(a|b)*a(a|b){500}``, ``.*a.{300}``), and the pattern comes from a client.
  ``compile_regex`` raises ValueError as soon as the DFA passes MAX_DFA_STATES states or its
  build passes MAX_BUILD_STEPS steps (an NFA state visited by a closure; a range, a boundary
  or a class open at a boundary, handled by a sweep), which bounds the compile time, the NFA
  states the subsets hold together (each was visited) and the size of the table (a boundary
  swept makes a run at most). It has to be then: the router compiles a pattern off the event
  loop to refuse it before a request is placed, and an error in the engine's step could not
  be reported cleanly.

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
``{`` (``a{x``, ``a{}``, ``a{1,2``). ``^`` or ``\\A`` as the first token and ``$`` or ``\\Z``
as the last of the pattern or of an alternative outside groups (``^a|b$``) are accepted and
change nothing: the text is matched whole anyway (``re``'s
``$`` may also match before a final newline, but fullmatch would still have to match that
newline, so it never changes the outcome).

Refused with ValueError: backreferences, lookarounds, inline flags, ``\\b \\B``, atomic groups,
possessive quantifiers, conditionals, comments, anchors anywhere else, ``\\N{...}``, unknown
escapes, a repeat of nothing or of a repeat, unbalanced parentheses or brackets, backward
ranges, and a pattern that matches no text at all (the engine could generate nothing). Limits
(also ValueError): MAX_PATTERN_LENGTH characters, MAX_REPEAT for a count, MAX_NESTING group
depth, MAX_NFA_STATES states with counted repeats expanded, checked before the NFA is built;
MAX_DFA_STATES and MAX_BUILD_STEPS, checked as the DFA is built.

A compiled DFA never changes: every request with the same pattern shares it (``compile_regex``
caches them by text), and any thread may step it without a lock.
"""
from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

from engine.compile_cache import CompileCache
from engine.regex_parse import (MAX_CODE_POINT, MAX_NESTING, MAX_NFA_STATES, MAX_PATTERN_LENGTH,
                                MAX_REPEAT, Alt, Chars, Concat, Node, Repeat, parse)

__all__ = ["DEAD", "MAX_BUILD_STEPS", "MAX_DFA_STATES", "MAX_NESTING", "MAX_NFA_STATES",
           "MAX_PATTERN_LENGTH", "MAX_REPEAT", "RegexDfa", "TooManySteps", "compile_regex"]

DEAD = -1
# A pattern without choices needs a state per character state and one after the last: every
# such pattern the parser takes compiles (a JSON string of up to 1000 characters needs 17,003
# states, an object holding one and a few more fields ~24,000). Reaching this count to refuse
# (a|b)*a(a|b){500} takes about half a second on a slow core.
MAX_DFA_STATES = MAX_NFA_STATES + 1
# guided_json's regexes take up to ~430,000 steps (that object), its any-value regex ~18,000;
# a pattern refused at this count has cost a quarter to three quarters of a second.
MAX_BUILD_STEPS = 2_000_000


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
        # One pair of range tuples per distinct class, found by node and then by value: the
        # copies of a counted repeat share it (a big class repeated costs its ranges once),
        # and the determinizer sweeps each distinct class once per state.
        self._by_node: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        self._by_ranges: dict[tuple, tuple[tuple[int, ...], tuple[int, ...]]] = {}

    def new_state(self, eps=(), edge=((), ()), target=-1) -> int:
        nfa = self.nfa
        nfa.eps.append(eps)
        nfa.los.append(edge[0])
        nfa.his.append(edge[1])
        nfa.target.append(target)
        return len(nfa.target) - 1

    def edge(self, node: Chars) -> tuple[tuple[int, ...], tuple[int, ...]]:
        edge = self._by_node.get(id(node))  # ids are stable: the tree outlives the build
        if edge is None:
            edge = self._by_ranges.get(node.ranges)
            if edge is None:
                edge = (tuple(lo for lo, _ in node.ranges), tuple(hi for _, hi in node.ranges))
                self._by_ranges[node.ranges] = edge
            self._by_node[id(node)] = edge
        return edge

    def build(self, node: Node, out: int) -> int:
        """The entry state of an automaton for ``node`` that continues to state ``out``."""
        if isinstance(node, Chars):
            return self.new_state(edge=self.edge(node), target=out)
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


class TooManySteps(ValueError):
    """A build stopped at its step budget."""


class _Determinizer:
    """The subset construction, eager and breadth first, refused as soon as it passes a budget
    (see the module docstring). It is thrown away once the rows are made: the subsets are
    only needed to find the states."""

    def __init__(self, nfa: Nfa, max_steps: int | None = None):
        self.nfa = nfa
        self.max_steps = MAX_BUILD_STEPS if max_steps is None else max_steps
        live = live_states(nfa)
        # Closures only walk live states, and keep the character states and the accepting one.
        self.succ = [tuple(t for t in eps if live[t]) for eps in nfa.eps]
        self.keep = [t >= 0 for t in nfa.target]
        self.keep[nfa.accept] = True
        self.subsets: list[tuple[int, ...]] = []  # per state: its NFA states, sorted
        self.ids: dict[tuple[int, ...], int] = {}
        self.steps = 0
        self.cuts: list[array] = []  # per state: the code points where its runs start
        self.nexts: list[array] = []  # per state: the state each run steps to
        self.start = self.intern(self.closure([nfa.start] if live[nfa.start] else []))
        while len(self.cuts) < len(self.subsets):
            self.add_row(self.subsets[len(self.cuts)])

    def add_row(self, subset: tuple[int, ...]) -> None:
        nfa = self.nfa
        # The character states grouped by class (equal classes share their range tuples), so
        # that a class is swept once however many states carry it.
        groups: dict[int, tuple[tuple[int, ...], tuple[int, ...], list[int]]] = {}
        for s in subset:
            los = nfa.los[s]
            if los:  # the accepting state has no edge
                groups.setdefault(id(los), (los, nfa.his[s], []))[2].append(nfa.target[s])
        opens: dict[int, list[int]] = {}
        closes: dict[int, list[int]] = {}
        for key, (los, his, _) in groups.items():
            self.spend(len(los))
            for lo, hi in zip(los, his):
                opens.setdefault(lo, []).append(key)
                closes.setdefault(hi + 1, []).append(key)
        cuts, nexts = array("i"), array("i")
        active: set[int] = set()  # the classes holding the code points from p on
        memo: dict[frozenset[int], int] = {}  # the classes around a nested one come back
        for p in sorted(opens.keys() | closes.keys() | {0}):
            if p > MAX_CODE_POINT:
                break
            active.difference_update(closes.get(p, ()))
            active.update(opens.get(p, ()))
            self.spend(1 + len(active))  # the key costs its size: overlapping classes pay it
            key = frozenset(active)
            nxt = memo.get(key)
            if nxt is None:
                seeds = [t for g in key for t in groups[g][2]]
                nxt = memo[key] = self.intern(self.closure(seeds))
            if not nexts or nexts[-1] != nxt:
                cuts.append(p)
                nexts.append(nxt)
        self.cuts.append(cuts)
        self.nexts.append(nexts)

    def closure(self, seeds: list[int]) -> tuple[int, ...]:
        """The character states (and the accepting state) reached by live epsilon edges."""
        succ, keep = self.succ, self.keep
        seen = set(seeds)  # live: the targets of live character states are live
        stack = list(seen)
        kept = []
        while stack:
            s = stack.pop()
            if keep[s]:
                kept.append(s)
                continue
            for t in succ[s]:
                if t not in seen:
                    seen.add(t)
                    stack.append(t)
        self.spend(len(seen))
        kept.sort()
        return tuple(kept)

    def spend(self, steps: int) -> None:
        self.steps += steps
        if self.steps > self.max_steps:
            raise TooManySteps(f"the regex's automaton is too large: building it takes more "
                               f"than {self.max_steps} steps; simplify it (nested or "
                               "overlapping repeats multiply its states and their size)")

    def intern(self, subset: tuple[int, ...]) -> int:
        if not subset:
            return DEAD
        sid = self.ids.get(subset)
        if sid is not None:
            return sid
        if len(self.subsets) == MAX_DFA_STATES:
            raise ValueError(f"the regex's automaton needs more than {MAX_DFA_STATES} states; "
                             f"simplify it (nested or overlapping repeats multiply states)")
        sid = self.ids[subset] = len(self.subsets)
        self.subsets.append(subset)
        return sid


class RegexDfa:
    """The whole automaton of one pattern, built at once and immutable after; see the module
    docstring. ValueError when it would pass a budget: ``max_steps`` build steps
    (TooManySteps; MAX_BUILD_STEPS unless given lower) or MAX_DFA_STATES states."""

    def __init__(self, nfa: Nfa, max_steps: int | None = None):
        built = _Determinizer(nfa, max_steps)
        self.build_steps = built.steps  # what it cost: a schema's compile counts it
        self.start = built.start
        # State s steps the code points from _cuts[s][i] up to the next cut to _nexts[s][i]:
        # a run per change of next state (arrays: 4 bytes a number, no object each).
        self._cuts, self._nexts = built.cuts, built.nexts
        self._accepting = bytes(nfa.accept in subset for subset in built.subsets)

    @property
    def num_states(self) -> int:
        """Live states (DEAD not counted)."""
        return len(self._accepting)

    def step(self, state: int, ch: str) -> int:
        """The state after one character (any code point) from ``state``; DEAD stays DEAD."""
        if state < 0:
            return DEAD
        return self._nexts[state][bisect_right(self._cuts[state], ord(ch)) - 1]

    def walk(self, state: int, text: str) -> int:
        """The state after ``text`` from ``state``: DEAD at the first character leading nowhere."""
        cuts, nexts = self._cuts, self._nexts
        for ch in text:
            if state < 0:
                return DEAD
            state = nexts[state][bisect_right(cuts[state], ord(ch)) - 1]
        return state

    def accepts_some(self, state: int, lo: int, hi: int) -> bool:
        """Whether some character in code points [lo, hi] steps ``state`` to a live state: a
        guide asks it of a character whose first UTF-8 bytes are all a token holds."""
        if state < 0 or lo > hi:
            return False
        cuts = self._cuts[state]
        first = bisect_right(cuts, lo) - 1
        return bool(span_is_live(first, bisect_right(cuts, hi, first) - 1,
                                 self._nexts[state][first]))

    def runs(self, state: int) -> tuple[Sequence[int], Sequence[int]]:
        """``state``'s transitions: the code points where each run starts, and each run's
        next state (DEAD for none); ``state`` must be live."""
        return self._cuts[state], self._nexts[state]

    def is_accepting(self, state: int) -> bool:
        """Whether the text that led to ``state`` matches the whole pattern."""
        return state >= 0 and self._accepting[state] == 1

    def fullmatch(self, text: str) -> bool:
        return self.is_accepting(self.walk(self.start, text))


def span_is_live(first, last, first_next):
    """Whether runs ``first``..``last`` of a state's row (``first_next``: where the first one
    steps) hold a live one; on ints, or elementwise on numpy arrays."""
    # Neighbouring runs step to different states, so of two runs one is live.
    return (last > first) | (first_next != DEAD)


def compile_regex(pattern: str) -> RegexDfa:
    """The DFA for ``pattern`` (cached by its text); ValueError when it is invalid, unsupported,
    too large, or matches no text at all."""
    if not isinstance(pattern, str):
        raise ValueError(f"the regex must be a string, not {type(pattern).__name__}")
    # A refusal can cost most of a second of building.
    return _AUTOMATA.call(pattern, lambda: _compile(pattern))


# A compiled automaton holds ~200 bytes a state, ~10 MB at the budgets: 16 kept is ~160 MB at
# worst, and requests of one kind share their pattern.
_AUTOMATA: CompileCache[RegexDfa] = CompileCache(kept=16, refused=256)


def _compile(pattern: str) -> RegexDfa:
    dfa = RegexDfa(build_nfa(parse(pattern)))
    if dfa.start == DEAD:
        raise ValueError(f"the regex {pattern[:80]!r} matches no text at all")
    return dfa
