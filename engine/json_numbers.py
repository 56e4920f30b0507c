"""JSON numbers within bounds, as regexes (for engine/json_schema_regex.py): integers exactly
as JSON writes them, digit by digit, for bounds of any size."""
from __future__ import annotations

import math

from engine.regex_text import alt, repeat

NUMBER_BOUNDS = ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")
INTEGER = "(?:0|-?[1-9][0-9]*)"
NUMBER = "-?(?:0|[1-9][0-9]*)(?:\\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"


def _bounds(s: dict, path: str) -> list[tuple[str, int | float]]:
    """The bound keywords of ``s`` with their values, each checked to be a finite number."""
    out = []
    for kw in NUMBER_BOUNDS:
        if kw not in s:
            continue
        v = s[kw]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or \
                isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"{kw!r} at {path} must be a number")
        out.append((kw, v))
    return out


def int_bounds(s: dict, path: str) -> tuple[int | None, int | None]:
    """The least and greatest integers the bound keywords allow (None: unbounded)."""
    los, his = [], []
    for kw, v in _bounds(s, path):
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


# A bounded number is written without an exponent: an integer part, then any fraction.
_FRACTION = "(?:\\.[0-9]+)?"
_NONZERO_FRACTION = "\\.[0-9]*[1-9][0-9]*"
_ZERO_FRACTION = "(?:\\.0+)?"


def number_range(s: dict, path: str) -> str:
    """Numbers within the bound keywords of ``s`` (NUMBER when it has none). The bounds must
    be whole numbers: a decimal bound's edge would be compared digit by digit in the
    fraction, which is not done. ``-0`` is never written."""
    lo, lo_open, hi, hi_open = _number_bounds(s, path)
    if lo is None and hi is None:
        return NUMBER
    parts = []
    if hi is None or hi > 0 or (hi == 0 and not hi_open):
        a, a_open = (0, False) if lo is None or lo < 0 else (lo, lo_open)
        parts += _magnitudes(a, a_open, hi, hi_open)
    if lo is None or lo < 0:  # the negatives, as "-" and their magnitude (never 0)
        a, a_open = (-hi, hi_open) if hi is not None and hi < 0 else (0, True)
        negatives = _magnitudes(a, a_open, None if lo is None else -lo, lo_open)
        if negatives:
            parts.append("-" + alt(negatives))
    if not parts:
        raise ValueError(f"the bounds at {path} leave no number")
    return alt(parts)


def _number_bounds(s: dict, path: str) -> tuple[int | None, bool, int | None, bool]:
    """(least, whether it is excluded, greatest, whether it is excluded); None: unbounded."""
    lo = hi = None
    lo_open = hi_open = False
    for kw, v in _bounds(s, path):
        if isinstance(v, float) and not v.is_integer():
            raise ValueError(f"{kw!r} {v} at {path} bounds a number with a fraction: only "
                             "whole-number bounds are supported on \"number\" (\"integer\" "
                             "takes any)")
        v, is_open = int(v), kw.startswith("exclusive")
        if kw.endswith("inimum"):
            if lo is None or v > lo or (v == lo and is_open):
                lo, lo_open = v, is_open
        elif hi is None or v < hi or (v == hi and is_open):
            hi, hi_open = v, is_open
    return lo, lo_open, hi, hi_open


def _magnitudes(a: int, a_open: bool, b: int | None, b_open: bool) -> list[str]:
    """Unsigned decimal texts of the values from a to b (b None: no end), each end excluded
    or not: the integer part a with a fraction (a nonzero one where a is excluded), the
    integer parts between with any, and b itself (with zeros only as its fraction)."""
    if b is not None and (a > b or (a == b and (a_open or b_open))):
        return []
    if a == b:
        return [f"{a}{_ZERO_FRACTION}"]
    parts = [f"{a}{_NONZERO_FRACTION if a_open else _FRACTION}"]
    if b is None or b - 1 >= a + 1:
        parts.append(_natural_range(a + 1, None if b is None else b - 1) + _FRACTION)
    if b is not None and not b_open:
        parts.append(f"{b}{_ZERO_FRACTION}")
    return parts
