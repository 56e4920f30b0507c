"""JSON numbers within bounds, as regexes (for engine/json_schema_regex.py): integers exactly
as JSON writes them, digit by digit, for bounds of any size."""
from __future__ import annotations

import math

from engine.regex_text import alt, repeat

NUMBER_BOUNDS = ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")
INTEGER = "(?:0|-?[1-9][0-9]*)"
NUMBER = "-?(?:0|[1-9][0-9]*)(?:\\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"


def int_bounds(s: dict, path: str) -> tuple[int | None, int | None]:
    """The least and greatest integers the bound keywords allow (None: unbounded)."""
    los, his = [], []
    for kw in NUMBER_BOUNDS:
        if kw not in s:
            continue
        v = s[kw]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or \
                isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"{kw!r} at {path} must be a number")
        if kw == "minimum":
            los.append(math.ceil(v))
        elif kw == "exclusiveMinimum":
            los.append(math.floor(v) + 1)
        elif kw == "maximum":
            his.append(math.floor(v))
        else:
            his.append(math.ceil(v) - 1)
    lo, hi = max(los, default=None), min(his, default=None)
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"the bounds at {path} leave no integer")
    return lo, hi


def int_range(lo: int | None, hi: int | None) -> str:
    """Integers in lo..hi (None: unbounded) as JSON writes them: no leading zeros, no -0."""
    if lo is None and hi is None:
        return INTEGER
    parts = []
    if lo is None or lo < 0:  # the negatives, as "-" and their magnitude
        parts.append("-" + _natural_range(1 if hi is None or hi >= 0 else -hi,
                                          None if lo is None else -lo))
    if hi is None or hi >= 0:
        parts.append(_natural_range(0 if lo is None else max(lo, 0), hi))
    return alt(parts)


def _natural_range(lo: int, hi: int | None) -> str:
    """The naturals in lo..hi (None: unbounded), one digit count at a time."""
    top = 10 ** len(str(lo)) - 1 if hi is None else hi
    parts = []
    for n in range(len(str(lo)), len(str(top)) + 1):
        least = max(lo, 10 ** (n - 1) if n > 1 else 0)
        parts.append(_digits_range(str(least), str(min(top, 10 ** n - 1))))
    if hi is None:  # and every longer number
        parts.append("[1-9]" + repeat("[0-9]", len(str(lo)), None))
    return alt(parts)


def _digits_range(lo: str, hi: str) -> str:
    """Digit strings as long as lo and hi, from lo to hi."""
    k = next((i for i, (a, b) in enumerate(zip(lo, hi)) if a != b), len(lo))
    if k == len(lo):
        return lo
    a, b, rest = int(lo[k]), int(hi[k]), len(lo) - k - 1
    # The middle digits take any tail; lo's and hi's own digit does when its tail is
    # all 0s (resp. 9s), and otherwise needs a tail at least (at most) its own.
    mid_lo = a if set(lo[k + 1:]) <= {"0"} else a + 1
    mid_hi = b if set(hi[k + 1:]) <= {"9"} else b - 1
    parts = []
    if mid_lo > a:
        parts.append(lo[k] + _tail_range(lo[k + 1:], above=True))
    if mid_lo <= mid_hi:
        parts.append(_digit_class(mid_lo, mid_hi) + repeat("[0-9]", rest, rest))
    if mid_hi < b:
        parts.append(hi[k] + _tail_range(hi[k + 1:], above=False))
    return lo[:k] + alt(parts)


def _tail_range(digits: str, above: bool) -> str:
    """Digit strings as long as ``digits``, at least it (above) or at most it; built from
    the last digit back, without recursion (bounds may have hundreds of digits)."""
    edge = "0" if above else "9"
    rx = ""
    for i in range(len(digits) - 1, -1, -1):
        d, rest = int(digits[i]), len(digits) - 1 - i
        any_tail = repeat("[0-9]", rest, rest)
        if set(digits[i:]) <= {edge}:
            rx = repeat("[0-9]", rest + 1, rest + 1)
        elif set(digits[i + 1:]) <= {edge}:  # this digit or beyond it, then any tail
            rx = (_digit_class(d, 9) if above else _digit_class(0, d)) + any_tail
        elif d == (9 if above else 0):  # no other digit beyond this one
            rx = digits[i] + rx
        else:
            other = _digit_class(d + 1, 9) if above else _digit_class(0, d - 1)
            rx = alt([digits[i] + rx, other + any_tail])
    return rx


def _digit_class(a: int, b: int) -> str:
    return str(a) if a == b else f"[{a}-{b}]"
