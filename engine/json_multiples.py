"""``multipleOf`` under guided_json (engine/json_schema_regex.py): the integers, or the
numbers, within a schema's bounds that its ``multipleOf`` divides, as regexes.

A number v is a multiple of k = K / 10^D (D: k's digits after its point) when N = v * 10^D
is an integer that K divides. Such a number is written with exactly D digits after its point
("12.50" for 0.01, "3.0" for 0.5, none for an integral k), so the text is N's digits with a
point before the last D, and the regex is one of integers N:

- few of them (bounds on both sides leaving at most MAX_LISTED): each one, listed;
- else, where K divides 10^m (K's prime factors are 2 and 5), N's last m digits decide:
  N = q * 10^m + r with r one of the multiples of K below 10^m (at most MAX_LISTED of them),
  q any natural within the bounds, r's range cut where q meets a bound;
- else (a factor 3, 7, ...: no number of last digits decides) refused.

An integer's multipleOf a/b (reduced) asks for the multiples of a (0.5: any integer).
Negative values are "-" and a positive magnitude's text: never -0.
"""
from __future__ import annotations

import math
from decimal import Decimal
from fractions import Fraction

from engine.json_numbers import (MAX_BOUND_DIGITS, decimal_bounds, digits_range, json_decimal,
                                 natural_range)
from engine.regex_text import alt

MAX_LISTED = 200  # values, or last-digit residues, written out one by one
_MAX_SUFFIX_DIGITS = 12


def multiple_of(s: dict, path: str) -> Decimal:
    """``multipleOf`` of ``s`` as the decimal JSON spelled, checked to be above 0."""
    k = s["multipleOf"]
    if isinstance(k, bool) or not isinstance(k, (int, float)) or \
            isinstance(k, float) and not math.isfinite(k) or k <= 0:
        raise ValueError(f"'multipleOf' at {path} must be a number above 0")
    return json_decimal(k, "multipleOf", path, MAX_BOUND_DIGITS)


def integer_multiples(lo: int | None, hi: int | None, k: Decimal, path: str) -> str:
    """The integers in lo..hi (None: unbounded) that k divides."""
    return _multiples(lo, hi, Fraction(k).numerator, 0, path)


def number_multiples(s: dict, k: Decimal, path: str) -> str:
    """The numbers within the bound keywords of ``s`` that k divides, written with as many
    digits after the point as k has."""
    places = max(0, -k.normalize().as_tuple().exponent)
    scale = Decimal(10) ** places
    lo, lo_open, hi, hi_open = decimal_bounds(s, path, MAX_BOUND_DIGITS)
    least = None if lo is None else _ceil(lo * scale) + (lo_open and lo * scale % 1 == 0)
    most = None if hi is None else _floor(hi * scale) - (hi_open and hi * scale % 1 == 0)
    return _multiples(least, most, int(k * scale), places, path)


def _multiples(lo: int | None, hi: int | None, factor: int, places: int, path: str) -> str:
    """The integers N in lo..hi that ``factor`` divides, each written as N / 10^places."""
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"the bounds at {path} leave no multiple of 'multipleOf'")
    try:
        parts = _naturals(0 if lo is None else max(lo, 0), hi, factor, places)
        if lo is None or lo < 0:  # "-" and the magnitude, from 1
            least = 1 if hi is None or hi >= 0 else -hi
            negatives = _naturals(least, None if lo is None else -lo, factor, places)
            if negatives:
                parts.append("-" + alt(negatives))
    except _Refused:
        raise ValueError(f"'multipleOf' at {path} is not supported: only one whose multiples "
                         "their last digits tell (no prime factor but 2 and 5 in its digits: "
                         "0.01, 0.5, 5, 10, ...), or bounds that leave at most "
                         f"{MAX_LISTED} multiples") from None
    if not parts:
        raise ValueError(f"the bounds at {path} leave no multiple of 'multipleOf'")
    return alt(parts)


class _Refused(Exception):
    pass


def _naturals(lo: int, hi: int | None, factor: int, places: int) -> list[str]:
    """Regexes of the naturals N in lo..hi that ``factor`` divides, written as N / 10^places."""
    if hi is not None and lo > hi:
        return []
    if factor == 1 and places == 0:
        return [natural_range(lo, hi)]
    if hi is not None and hi // factor - (lo - 1) // factor <= MAX_LISTED:
        first = -(-lo // factor) * factor
        return [_spell(n, places) for n in range(first, hi + 1, factor)]
    m = next((m for m in range(places, places + _MAX_SUFFIX_DIGITS)
              if 10 ** m % factor == 0), None)
    if m is None or (factor > 1 and 10 ** m // factor > MAX_LISTED):
        raise _Refused
    period = 10 ** m
    parts = []
    if m > places:  # below the period the whole part is short: listed (fewer than MAX_LISTED)
        parts += _naturals(lo, period - 1 if hi is None else min(hi, period - 1), factor,
                           places)
        lo = max(lo, period)
    if hi is not None and lo > hi:
        return parts
    qa, ra = divmod(lo, period)
    qb, rb = (None, None) if hi is None else divmod(hi, period)
    tails = _Tails(factor, m, places)
    if qa == qb:
        parts += tails.after(str(qa), ra, rb)
        return parts
    parts += tails.after(str(qa), ra, period - 1)
    if qb is None or qb - 1 >= qa + 1:
        parts += tails.after(natural_range(qa + 1, None if qb is None else qb - 1), 0,
                             period - 1)
    if qb is not None:
        parts += tails.after(str(qb), 0, rb)
    return parts


class _Tails:
    """The last m digits of the multiples of ``factor``, the point before the last ``places``
    of them."""

    def __init__(self, factor: int, m: int, places: int):
        self.factor, self.m, self.places = factor, m, places

    def after(self, head: str, lo: int, hi: int) -> list[str]:
        """``head`` followed by the tails whose value is in lo..hi; [] when none is."""
        if self.factor == 1:  # every tail: m == places, the tail is all fraction
            return [f"{head}\\.{digits_range(str(lo).zfill(self.m), str(hi).zfill(self.m))}"]
        first = -(-lo // self.factor) * self.factor
        tails = [self._text(r) for r in range(first, hi + 1, self.factor)]
        return [f"{head}{alt(tails)}"] if tails else []

    def _text(self, r: int) -> str:
        digits = str(r).zfill(self.m)
        if not self.places:
            return digits
        return f"{digits[:-self.places]}\\.{digits[-self.places:]}"


def _spell(n: int, places: int) -> str:
    """N / 10^places with exactly ``places`` digits after the point, as a regex."""
    if not places:
        return str(n)
    whole, frac = divmod(n, 10 ** places)
    return f"{whole}\\.{str(frac).zfill(places)}"


def _ceil(d: Decimal) -> int:
    return int(d.to_integral_value(rounding="ROUND_CEILING"))


def _floor(d: Decimal) -> int:
    return int(d.to_integral_value(rounding="ROUND_FLOOR"))
