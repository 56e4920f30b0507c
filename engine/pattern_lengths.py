"""A regex tree cut down to texts of a given length range (for guided_json's ``pattern``
beside ``minLength``/``maxLength``, engine/json_string_pattern.py).

``fit_lengths(node, lo, hi)`` returns a tree whose texts are some of ``node``'s, each lo..hi
characters long: a subset of the intersection, by design (as the rest of guided_json's
regexes are), found without building automata. Lengths are shared out top-down:

- a concatenation gives each part its shortest length, then spreads what ``hi`` leaves as
  evenly as the parts can take it (so ``[a-z]+-[0-9]+`` under 9 splits 8 characters 4 and 4),
  and raises parts toward ``lo`` the same way;
- an alternation keeps the branches that fit;
- a repeat of a fixed-length item bounds its count (``[a-z]+`` under 10: ``[a-z]{1,10}``);
  a repeat of a variable-length one repeats it a fixed number of times (the fewest that can
  reach ``lo``), each copy with its share.

``node`` is returned as it is when all its texts already fit; None when this finds no text.
"""
from __future__ import annotations

import math

from engine.regex_parse import Alt, Concat, Node, Repeat, text_lengths


def fit_lengths(node: Node, lo: int, hi: int | None) -> Node | None:
    """Some of ``node``'s texts, those lo..hi characters long (hi None: no longest)."""
    nlo, nhi = text_lengths(node)
    if (nhi is not None and nhi < lo) or (hi is not None and nlo > hi):
        return None
    if nlo >= lo and (hi is None or (nhi is not None and nhi <= hi)):
        return node
    if isinstance(node, Alt):
        kept = [f for f in (fit_lengths(b, lo, hi) for b in node.items) if f is not None]
        return None if not kept else kept[0] if len(kept) == 1 else Alt(tuple(kept))
    if isinstance(node, Concat):
        items = []
        for item, (a, b) in zip(node.items, _allot([text_lengths(i) for i in node.items],
                                                   lo, hi)):
            fitted = fit_lengths(item, a, b)
            if fitted is None:
                return None
            items.append(fitted)
        return Concat(tuple(items))
    # A single character fits or not (above): what is left is a repeat.
    return _fit_repeat(node, lo, hi)


def _allot(spans: list[tuple[int, int | None]], lo: int,
           hi: int | None) -> list[tuple[int, int | None]]:
    """Each part's range, within its own, the ranges' sums within lo..hi (the caller made
    sure the parts' shortest sum to at most hi and their longest to at least lo)."""
    least = [a for a, _ in spans]
    room = [None if b is None else b - a for a, b in spans]
    if hi is not None:
        room = _spread(room, hi - sum(least))
    most = [a + r if r is not None else None for a, r in zip(least, room)]
    if sum(least) < lo:  # raise the shortest toward lo, as evenly
        raised = _spread([None if m is None else m - a for a, m in zip(least, most)],
                         lo - sum(least))
        least = [a + r for a, r in zip(least, raised)]
    return list(zip(least, most))


def _spread(caps: list[int | None], total: int) -> list[int]:
    """``total`` shared out as evenly as ``caps`` allow (None: no cap); less where the caps
    sum to less."""
    shares = [0] * len(caps)
    open_ = [i for i, c in enumerate(caps) if c is None or c > 0]
    while total > 0 and open_:
        each = max(total // len(open_), 1)
        for i in list(open_):
            if total <= 0:
                break
            give = each if caps[i] is None else min(each, caps[i] - shares[i])
            shares[i] += give
            total -= give
            if caps[i] is not None and shares[i] >= caps[i]:
                open_.remove(i)
    return shares


def _fit_repeat(node: Repeat, lo: int, hi: int | None) -> Node | None:
    a, b = text_lengths(node.item)
    if a == b:  # each copy as long as any: only the count is bounded
        least = max(node.lo, math.ceil(lo / a))
        most = hi // a if hi is not None else None
        if node.hi is not None:
            most = node.hi if most is None else min(most, node.hi)
        if most is not None and least > most:
            return None
        return Repeat(node.item, least, most)
    # Copies of different lengths: a fixed count, the fewest that can reach lo, each copy
    # given its share.
    count = max(node.lo, 1, 0 if b is None or not b else math.ceil(lo / b))
    if node.hi is not None and count > node.hi:
        return None
    item = fit_lengths(node.item, math.ceil(lo / count),
                       None if hi is None else hi // count)
    if item is None:
        return None
    if hi is None:  # each copy long enough: any more of them too
        return Repeat(item, count, node.hi)
    return Repeat(item, node.lo if lo == 0 else count, count)
