"""``contains`` and ``minContains`` for engine/json_schema_regex.py's compiler: an array at
least k of whose items meet the ``contains`` schema (k = minContains, default 1).

With B the items' regex and A the regex of an item meeting both ``items`` and ``contains``
(the two merged by engine/json_all_of.py), the arrays are ``B, ..., A, B, ..., A, ..., B``:
k marked A's among any B's. Every A is also a B, so the regex is ambiguous, but exact: an
array with k items meeting ``contains`` matches it (mark the first k), and one that matches
has k. ``minItems`` beside it counts every item: where the k A's do not already make
minItems, the B's before the (single) A are counted out one alternative each; a
``maxItems`` likewise (for k = 1), each alternative bounding the B's after the A.

Refused: ``maxContains`` (the other items would have to fail ``contains``, which only a
``not`` of it could say), ``contains`` beside ``prefixItems`` or ``uniqueItems``, and bounds
past what the alternatives above spell within MAX_CONTAINS_ITEMS.
"""
from __future__ import annotations

from typing import Any

from engine.json_all_of import merge_all_of
from engine.json_schema_checks import at, count
from engine.regex_text import alt, repeat

# minContains at most this: the regex spells each contained item and the runs between them.
MAX_CONTAINS = 8
# minItems (or maxItems) beside contains at most this: an alternative per count of the
# items before the contained one.
MAX_CONTAINS_ITEMS = 32


def contains_items(compiler, s: dict, prefix: list, items: Any, lo: int, hi: int | None,
                   path: str, depth: int) -> str | None:
    """The regex of the array's items (between its brackets) for ``s["contains"]``, with
    ``items`` the schema of every item and lo..hi items in all; None when contains asks for
    nothing (minContains 0)."""
    if prefix:
        raise ValueError(f"'contains' beside a tuple's items at {path} is not supported")
    if "maxContains" in s:
        raise ValueError(f"'maxContains' at {path} is not supported: the other items would "
                         "have to fail 'contains'")
    if s.get("uniqueItems"):
        raise ValueError(f"'contains' beside 'uniqueItems' at {path} is not supported")
    k = count(s, "minContains", path, 1)
    if k == 0:
        return None
    if k > MAX_CONTAINS:
        raise ValueError(f"'minContains' at {path} is above {MAX_CONTAINS}, the most supported")
    if hi is not None and hi < k:
        raise ValueError(f"'maxItems' at {path} leaves no room for 'minContains' {k} items")
    where = at(path, "contains")
    both = s["contains"] if items is True else merge_all_of([items, s["contains"]], where,
                                                            compiler.target)
    if both is False:
        raise ValueError(f"no item can meet both 'items' and 'contains' at {path}")
    a = compiler.node(both, where, depth + 1)
    b = compiler.node(items, at(path, "items"), depth + 1)
    comma = compiler.p.comma
    b_comma, comma_b = f"(?:{b}{comma})", f"(?:{comma}{b})"
    if hi is None and lo <= k:
        between = f"(?:{comma}{repeat(b_comma, 0, None)}{a})"
        return repeat(b_comma, 0, None) + a + repeat(between, k - 1, k - 1) \
            + repeat(comma_b, 0, None)
    if k > 1:
        raise ValueError(f"'minItems' or 'maxItems' beside 'minContains' {k} at {path} is "
                         "not supported")
    if max(lo, hi or 0) > MAX_CONTAINS_ITEMS:
        raise ValueError(f"'minItems' or 'maxItems' above {MAX_CONTAINS_ITEMS} beside "
                         f"'contains' at {path} is not supported")
    # p items before the contained one, and what is left of lo..hi after it.
    last = hi - 1 if hi is not None else lo - 1
    options = [repeat(b_comma, p, p) + a
               + repeat(comma_b, max(lo - 1 - p, 0), None if hi is None else hi - 1 - p)
               for p in range(last + 1)]
    if hi is None:  # lo - 1 before it or more: any number after
        options[-1] = repeat(b_comma, lo - 1, None) + a + repeat(comma_b, 0, None)
    return alt(options)
