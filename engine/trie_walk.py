"""The vocabulary trie walked a level at a time over arrays (for engine/guided_regex.py).

A guide state's allowed tokens are those whose characters keep the automaton alive. Walking
the trie node by node costs a Python step per node (~10k nodes of an 8192-token vocabulary
for a permissive state: ~18 ms on the 2-core VM). Here the trie is flattened once into one
array row per depth (each node's parent, character, tokens and tails), and a walk steps every
node of a depth together: the nodes are grouped by their parent's automaton state, and each
group's next states come from one ``searchsorted`` over that state's runs. The cost is a few
array operations per depth and per distinct state at that depth.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.regex_dfa import DEAD, RegexDfa, span_is_live


@dataclass
class TrieLevel:
    """The trie's nodes at one depth (the root alone at depth 0)."""
    parent: np.ndarray  # [n] int64: the parent's index at the depth above
    chars: np.ndarray  # [n] int64: the code point leading here
    token_starts: np.ndarray  # [n + 1] int64: node i's tokens are token_ids[starts[i]:starts[i+1]]
    token_ids: np.ndarray  # [t] int64: the tokens whose text ends at each node
    tail_nodes: np.ndarray  # [k] int64: the node a tail hangs on
    tail_lo: np.ndarray  # [k] int64: code points a token ending inside a character may begin
    tail_hi: np.ndarray  # [k] int64
    tail_ids: np.ndarray  # [k] int64: that token


def flatten(root) -> list[TrieLevel]:
    """``root`` (a guided_regex TokenTrie's root node) as one TrieLevel per depth."""
    levels, nodes, parents, chars = [], [root], [0], [0]
    while nodes:
        starts, ids, tail_nodes, tails = [0], [], [], []
        for i, node in enumerate(nodes):
            ids += node.token_ids
            starts.append(len(ids))
            for lo, hi, t in node.tails:
                tail_nodes.append(i)
                tails.append((lo, hi, t))
        lo, hi, tail_ids = (zip(*tails) if tails else ((), (), ()))
        levels.append(TrieLevel(_ints(parents), _ints(chars), _ints(starts), _ints(ids),
                                _ints(tail_nodes), _ints(lo), _ints(hi), _ints(tail_ids)))
        below, parents, chars = [], [], []
        for i, node in enumerate(nodes):
            for ch, child in node.children.items():
                below.append(child)
                parents.append(i)
                chars.append(ord(ch))
        nodes = below
    return levels


def _ints(values) -> np.ndarray:
    return np.asarray(list(values), dtype=np.int64)


class TrieWalker:
    """Walks one automaton over a flattened trie; each state's runs kept as arrays."""

    def __init__(self, dfa: RegexDfa, levels: list[TrieLevel]) -> None:
        self.dfa = dfa
        self.levels = levels
        self._runs: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def walk(self, dfa_state: int) -> np.ndarray:
        """The tokens whose characters (and, for a token ending inside a character, its first
        bytes) keep ``dfa_state`` alive: [n] int64, unsorted."""
        found = []
        states = np.asarray([dfa_state], dtype=np.int64)  # the root's
        for depth, level in enumerate(self.levels):
            if depth:
                states = self._step(states[level.parent], level.chars)
                live = np.flatnonzero(states != DEAD)
                if not live.size:
                    break
                found.append(_gather(level.token_starts, level.token_ids, live))
            if level.tail_nodes.size:
                found.append(self._tails(states, level))
        return np.concatenate(found) if found else np.zeros(0, dtype=np.int64)

    def _step(self, parents: np.ndarray, chars: np.ndarray) -> np.ndarray:
        """Each node's state: its parent's stepped by its character (DEAD from DEAD)."""
        out = np.full(parents.shape, DEAD, dtype=np.int64)
        for state, members in _groups(parents):
            cuts, nexts = self._arrays(state)
            out[members] = nexts[np.searchsorted(cuts, chars[members], side="right") - 1]
        return out

    def _tails(self, states: np.ndarray, level: TrieLevel) -> np.ndarray:
        """The tail tokens whose first bytes begin some character the node's state takes."""
        at = states[level.tail_nodes]
        keep = np.zeros(at.shape, dtype=bool)
        for state, members in _groups(at):
            cuts, nexts = self._arrays(state)
            first = np.searchsorted(cuts, level.tail_lo[members], side="right") - 1
            last = np.searchsorted(cuts, level.tail_hi[members], side="right") - 1
            keep[members] = span_is_live(first, last, nexts[first])
        return level.tail_ids[keep]

    def _arrays(self, state: int) -> tuple[np.ndarray, np.ndarray]:
        got = self._runs.get(state)
        if got is None:
            cuts, nexts = self.dfa.runs(state)
            got = self._runs[state] = (np.asarray(cuts, dtype=np.int64),
                                       np.asarray(nexts, dtype=np.int64))
        return got


def _groups(states: np.ndarray):
    """(state, the indices holding it) for each live state in ``states``."""
    order = np.argsort(states, kind="stable")
    ordered = states[order]
    bounds = np.flatnonzero(np.diff(ordered)) + 1
    for members, first in zip(np.split(order, bounds), np.concatenate(([0], bounds))):
        if ordered[first] != DEAD:
            yield int(ordered[first]), members


def _gather(starts: np.ndarray, ids: np.ndarray, nodes: np.ndarray) -> np.ndarray:
    """The concatenated token lists of ``nodes`` (CSR rows)."""
    lo, hi = starts[nodes], starts[nodes + 1]
    lengths = hi - lo
    total = int(lengths.sum())
    if not total:
        return np.zeros(0, dtype=np.int64)
    # Each output position's row start, plus its offset within the row.
    offsets = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return ids[np.repeat(lo, lengths) + offsets]
