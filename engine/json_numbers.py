"""JSON numbers within bounds, as regexes (for engine/json_schema_regex.py), digit by digit
for bounds of any size: integers exactly as JSON writes them; numbers without an exponent,
their fraction compared with a decimal bound's digit by digit."""
from __future__ import annotations

import math
from decimal import Decimal

from engine.json_schema_checks import Unsatisfiable
from engine.regex_text import alt, atom, repeat

NUMBER_BOUNDS = ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")
INTEGER = "(?:0|-?[1-9][0-9]*)"
NUMBER = "-?(?:0|[1-9][0-9]*)(?:\\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"


def draft4_bounds(s: dict) -> dict:
    """``s`` with draft 4's (and OpenAPI 3.0's) boolean exclusiveMinimum/Maximum as draft
    2020-12's numbers: a true flag makes its bound exclusive, a false one says nothing. A
    true flag without its bound stays, for _bounds to refuse."""
    for flag, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(s.get(flag), bool) and (not s[flag] or bound in s):
            s = dict(s)
            if s.pop(flag):
                s[flag] = s.pop(bound)
    return s


def _bounds(s: dict, path: str) -> list[tuple[str, int | float]]:
    """The bound keywords of ``s`` with their values (draft 4's flags read as
    draft4_bounds reads them), each checked to be a finite number."""
    s, out = draft4_bounds(s), []
    for kw in NUMBER_BOUNDS:
        if kw not in s:
            continue
        v = s[kw]
        if v is True:  # draft 4's flag without its bound
            bound = "minimum" if kw == "exclusiveMinimum" else "maximum"
            raise ValueError(f"{kw!r} true at {path} needs {bound!r} beside it "
                             "(draft 4's form)")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or \
                isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"{kw!r} at {path} must be a number")
        out.append((kw, v))
    return out


def int_bounds(s: dict, path: str) -> tuple[int | None, int | None]:
    """The least and greatest integers the bound keywords allow (None: unbounded)."""
    lo, lo_open, hi, hi_open = decimal_bounds(s, path)
    least = None if lo is None else math.floor(lo) + 1 if lo_open else math.ceil(lo)
    most = None if hi is None else math.ceil(hi) - 1 if hi_open else math.floor(hi)
    if least is not None and most is not None and least > most:
        raise Unsatisfiable(f"the bounds at {path} leave no integer")
    return least, most


def int_range(lo: int | None, hi: int | None) -> str:
    """Integers in lo..hi (None: unbounded) as JSON writes them: no leading zeros, no -0."""
    if lo is None and hi is None:
        return INTEGER
    parts = []
    if lo is None or lo < 0:  # the negatives, as "-" and their magnitude
        parts.append("-" + natural_range(1 if hi is None or hi >= 0 else -hi,
                                          None if lo is None else -lo))
    if hi is None or hi >= 0:
        parts.append(natural_range(0 if lo is None else max(lo, 0), hi))
    return alt(parts)


def natural_range(lo: int, hi: int | None) -> str:
    """The naturals in lo..hi (None: unbounded), one digit count at a time."""
    top = 10 ** len(str(lo)) - 1 if hi is None else hi
    parts = []
    for n in range(len(str(lo)), len(str(top)) + 1):
        least = max(lo, 10 ** (n - 1) if n > 1 else 0)
        parts.append(digits_range(str(least), str(min(top, 10 ** n - 1))))
    if hi is None:  # and every longer number
        parts.append("[1-9]" + repeat("[0-9]", len(str(lo)), None))
    return alt(parts)


def digits_range(lo: str, hi: str) -> str:
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
_DIGITS = "[0-9]*"
# Digits after a bound's decimal point, at most (a bound's fraction is compared digit by digit).
MAX_BOUND_DIGITS = 40


def number_range(s: dict, path: str) -> str:
    """Numbers within the bound keywords of ``s`` (NUMBER when it has none), compared exactly
    with the bounds as JSON wrote them (0.1 is one tenth). ``-0`` is never written."""
    lo, lo_open, hi, hi_open = decimal_bounds(s, path, MAX_BOUND_DIGITS)
    if lo is None and hi is None:
        return NUMBER
    parts = []
    if hi is None or hi > 0 or (hi == 0 and not hi_open):
        a, a_open = (Decimal(0), False) if lo is None or lo < 0 else (lo, lo_open)
        parts += _magnitudes(a, a_open, hi, hi_open)
    if lo is None or lo < 0:  # the negatives, as "-" and their magnitude (never 0)
        a, a_open = (-hi, hi_open) if hi is not None and hi < 0 else (Decimal(0), True)
        negatives = _magnitudes(a, a_open, None if lo is None else -lo, lo_open)
        if negatives:
            parts.append("-" + alt(negatives))
    if not parts:
        raise Unsatisfiable(f"the bounds at {path} leave no number")
    return alt(parts)


# (least, whether it is excluded, greatest, whether it is excluded); None: unbounded.
_Bounds = tuple[Decimal | None, bool, Decimal | None, bool]


def decimal_bounds(s: dict, path: str, max_digits: int | None = None) -> _Bounds:
    """The bound keywords of ``s`` as _Bounds, the tighter of two on one side.
    ``max_digits``: the most digits a bound may have after its point (a number's fraction
    is compared with it digit by digit)."""
    lo = hi = None
    lo_open = hi_open = False
    for kw, v in _bounds(s, path):
        v, is_open = json_decimal(v, kw, path, max_digits), kw.startswith("exclusive")
        if kw.endswith("inimum"):
            if lo is None or v > lo or (v == lo and is_open):
                lo, lo_open = v, is_open
        elif hi is None or v < hi or (v == hi and is_open):
            hi, hi_open = v, is_open
    return lo, lo_open, hi, hi_open


def json_decimal(v: int | float, kw: str, path: str, max_digits: int | None = None) -> Decimal:
    """A keyword's number as the decimal JSON spelled: a float by its shortest repr (0.1, not
    0.1000000000000000055); ValueError past ``max_digits`` digits after its point."""
    d = Decimal(repr(v)) if isinstance(v, float) else Decimal(v)
    if max_digits is not None and -d.as_tuple().exponent > max_digits:
        raise ValueError(f"{kw!r} at {path} has more than {max_digits} digits after its "
                         "decimal point")
    return d


def _split(d: Decimal) -> tuple[int, str]:
    """A non-negative decimal's integer part and its fraction's digits, trailing zeros cut."""
    whole = int(d)
    text = format(d - whole, "f")
    return whole, text.partition(".")[2].rstrip("0")


def _magnitudes(a: Decimal, a_open: bool, b: Decimal | None, b_open: bool) -> list[str]:
    """Unsigned decimal texts of the values from a to b (b None: no end), each end excluded
    or not: the integer part of a with a fraction at least a's, the integer parts between
    with any, and b's with a fraction at most b's."""
    if b is not None and (a > b or (a == b and (a_open or b_open))):
        return []
    (ka, fa), (kb, fb) = _split(a), (None, "") if b is None else _split(b)
    if ka == kb:
        return _with_fraction(str(ka), _between(fa, a_open, fb, b_open))
    parts = _with_fraction(str(ka), _at_least(fa, a_open))
    if kb is None or kb - 1 >= ka + 1:
        parts.append(natural_range(ka + 1, None if kb is None else kb - 1) + "(?:\\.[0-9]+)?")
    if kb is not None:
        parts += _with_fraction(str(kb), _at_most(fb, b_open))
    return parts


# A fraction's possible digit strings, as (whether it may be absent, the regex of the
# non-empty ones or None); the value of digits f is 0.f.

def _with_fraction(whole: str, fraction: tuple[bool, str | None]) -> list[str]:
    empty_ok, digits = fraction
    if digits is None:
        return [whole] if empty_ok else []
    return [f"{whole}(?:\\.{atom(digits)})?" if empty_ok else f"{whole}\\.{atom(digits)}"]


def _at_least(f: str, strict: bool) -> tuple[bool, str]:
    """Fractions of value at least 0.f (above it, ``strict``)."""
    if not f:
        return (not strict, "[0-9]*[1-9][0-9]*" if strict else "[0-9]+")
    return False, alt(_above(f) + [f + ("[0-9]*[1-9][0-9]*" if strict else _DIGITS)])


def _at_most(f: str, strict: bool) -> tuple[bool, str | None]:
    """Fractions of value at most 0.f (below it, ``strict``)."""
    if not f:
        return (not strict, None if strict else "0+")
    parts = _below(f) + [f[:j] for j in range(1, len(f))]
    if not strict:
        parts.append(f + "0*")
    return True, alt(parts)


def _between(fa: str, a_strict: bool, fb: str, b_strict: bool) -> tuple[bool, str | None]:
    """Fractions from 0.fa to 0.fb (0.fa <= 0.fb; an end excluded where strict)."""
    n = max(len(fa), len(fb))
    pa, pb = fa.ljust(n, "0"), fb.ljust(n, "0")
    if pa == pb:  # one value: both ends included (the caller saw to that)
        return (not fa, (fa + "0*") if fa else "0+")
    d = next(i for i in range(n) if pa[i] != pb[i])
    prefix, x, y = pa[:d], int(pa[d]), int(pb[d])
    parts = []
    rest_a, rest_b = fa[d + 1:], fb[d + 1:]
    tail_a = _DIGITS if not rest_a and not a_strict else _at_least(rest_a, a_strict)[1]
    parts.append(prefix + str(x) + atom(tail_a))
    if x + 1 <= y - 1:
        parts.append(prefix + _digit_class(x + 1, y - 1) + _DIGITS)
    empty_b, below_b = _at_most(rest_b, b_strict)
    if below_b is not None:
        parts.append(prefix + str(y) + (f"(?:{below_b})?" if empty_b else atom(below_b)))
    elif empty_b:
        parts.append(prefix + str(y))
    if not a_strict:  # fa itself, followed by zeros, however short
        parts.append(fa + "0*" if fa else "0+")
    return (not fa and not a_strict), alt(parts)


def _above(f: str) -> list[str]:
    """Digit strings that leave f's digits with a greater one (and go on anyhow)."""
    return [f[:i] + _digit_class(int(f[i]) + 1, 9) + _DIGITS
            for i in range(len(f)) if f[i] != "9"]


def _below(f: str) -> list[str]:
    return [f[:i] + _digit_class(0, int(f[i]) - 1) + _DIGITS
            for i in range(len(f)) if f[i] != "0"]
