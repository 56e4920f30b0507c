"""Regex text builders for the JSON schema translation (engine/json_schema_regex.py and
engine/json_numbers.py): alternation, grouping for a quantifier, and counted repeats kept
within the automaton compiler's largest count."""
from __future__ import annotations

MAX_REPEAT = 1000  # the largest count in a {n,m} the automaton compiler takes


def alt(parts: list[str]) -> str:
    parts = list(dict.fromkeys(parts))
    return parts[0] if len(parts) == 1 else f"(?:{'|'.join(parts)})"


def atom(x: str) -> str:
    """``x`` ready for a quantifier."""
    if len(x) == 1 or (len(x) == 2 and x[0] == "\\") or \
            (x[0] == "[" and x[-1] == "]" and "]" not in x[1:-1]):
        return x
    return f"(?:{x})"


def repeat(x: str, lo: int, hi: int | None) -> str:
    """``x`` repeated lo..hi times (hi None: no limit), no single count above MAX_REPEAT."""
    a = atom(x)
    if hi is None:
        if lo > MAX_REPEAT:
            return repeat(x, lo, lo) + a + "*"
        return {0: a + "*", 1: a + "+"}.get(lo, f"{a}{{{lo},}}")
    if hi <= MAX_REPEAT:
        if hi == 0:
            return ""
        if lo == hi:
            return a if lo == 1 else f"{a}{{{lo}}}"
        return a + "?" if (lo, hi) == (0, 1) else f"{a}{{{lo},{hi}}}"
    block = repeat(x, MAX_REPEAT, MAX_REPEAT)
    q, r = divmod(hi, MAX_REPEAT)
    if lo == hi:
        return repeat(block, q, q) + repeat(x, r, r)
    if lo:
        return repeat(x, lo, lo) + repeat(x, 0, hi - lo)
    # 0..hi: up to q-1 blocks then 0..MAX_REPEAT (every count up to q blocks), or q blocks
    # then 0..r.
    parts = [repeat(block, 0, q - 1) + repeat(x, 0, MAX_REPEAT)]
    if r:
        parts.append(repeat(block, q, q) + repeat(x, 0, r))
    return alt(parts)
