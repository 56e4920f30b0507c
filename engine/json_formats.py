"""The string ``format``s guided_json generates (engine/json_schema_regex.py): the regex of
each format's text (inside the JSON string's quotes), and the lengths beside one it accepts.

Each regex matches a subset of the texts its RFC allows, by design: the generated text needs
one reasonable spelling, and every text matched must pass strict validators (JSON Schema's
format assertions, pydantic's types). Every character is printable ASCII and never a quote or
a backslash, so a text's length in the regex is its length as JSON Schema counts it.

- ``date``, ``time``, ``date-time``: RFC 3339 with upper-case ``T`` and ``Z``; years from
  0001 (Python's datetime has no year 0), days within their month (leap years known), no
  leap second (Python's datetime has none; RFC 3339 allows one at 23:59:60 UTC only);
- ``uuid``: RFC 4122's hex-and-hyphens form, either case;
- ``ipv4``: dotted quads without leading zeros;
- ``ipv6``: RFC 4291's hex forms, ``::`` compression included (no trailing dotted quad);
- ``hostname``: RFC 1123 names of at most seven labels, the last one starting with a letter
  (so a URL parser never reads the name as a number) and at most 24 characters long, the
  others at most 37: never over the 253 characters a name may have. No label carries ``--``
  as its third and fourth characters (reserved for IDNA: ``xn--``);
- ``email``: RFC 5321's dot-atom local part (at most three atoms of at most 20 characters)
  at a hostname of two to five labels: within the 254 characters an address may have;
- ``uri``: ``http`` and ``https`` URLs (pydantic's HttpUrl takes no other scheme, and its
  schema says only ``uri``) of a hostname or an IPv4 host, an optional port (0..65535),
  then a path, a query and a fragment of RFC 3986's characters (percent escapes included)
  of at most 256, 128 and 32 characters or escapes (each with its leading ``/``, ``?`` or
  ``#``): never over 2083 characters, the ``maxLength`` pydantic's HttpUrl writes. The
  bounds keep the regex small (each bounded character is automaton states): a schema with
  a dozen URLs still compiles;
- ``duration``: RFC 3339's (ISO 8601) ``P1Y2M3D``, ``PT4H5M6S``, ``P7W`` and their like,
  each count of at most six digits (so pydantic's timedelta holds the sum).

Lengths beside a format are accepted when every text of the format's regex meets them (as
pydantic's ``minLength: 1`` and ``maxLength: 2083`` beside ``uri`` do); otherwise refused.

OpenAPI's numeric formats: ``int32`` and ``int64`` bound an integer (beside its own bounds),
``float`` and ``double`` leave a number as it is; its ``password`` and ``binary`` leave a
string as it is (lengths apply as without a format). A format of another type than the value's
is left alone (``{"type": ["string", "integer"], "format": "date"}``: any integer), as JSON
Schema's validators leave it; a format of no type here is refused.
"""
from __future__ import annotations

import functools

from engine.json_numbers import int_range
from engine.regex_parse import parse, text_lengths
from engine.regex_text import alt, repeat

_HEX = "[0-9a-fA-F]"
_DIGIT = "[0-9]"

# --- date and time (RFC 3339) ---
_MONTH_DAY = ("(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
              "|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-8]))")
# Years 0001..9999: RFC 3339 has a year 0000, Python's datetime (and pydantic) do not.
_YEAR = "(?:[0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)"
# Divisible by 4 and not by 100, or by 400.
_LEAP_YEAR = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_DATE = f"(?:{_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)"
_HOUR_MINUTE = "(?:[01][0-9]|2[0-3]):[0-5][0-9]"
_TIME = f"{_HOUR_MINUTE}:[0-5][0-9](?:\\.[0-9]+)?(?:Z|[+-]{_HOUR_MINUTE})"


# --- hosts ---
_ALNUM = "[A-Za-z0-9]"
_LDH = "[A-Za-z0-9-]"


def _label(first: str, max_len: int) -> str:
    """A hostname label of 1..max_len letters, digits and hyphens (max_len >= 5), starting
    with ``first``, ending with a letter or digit, never ``--`` as its 3rd and 4th."""
    return alt([first, first + _ALNUM, first + _LDH + _ALNUM, first + _LDH * 2 + _ALNUM,
                f"{first}{_LDH}(?:{_ALNUM}{_LDH}|-{_ALNUM}){_LDH}{{0,{max_len - 5}}}{_ALNUM}"])


_INNER_LABEL = _label(_ALNUM, 37)
_LAST_LABEL = _label("[A-Za-z]", 24)


def _hostname(min_labels: int, max_labels: int) -> str:
    return f"(?:{_INNER_LABEL}\\.){{{min_labels - 1},{max_labels - 1}}}{_LAST_LABEL}"


_DEC_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_IPV4 = f"{_DEC_OCTET}(?:\\.{_DEC_OCTET}){{3}}"


def _ipv6() -> str:
    """RFC 3986's IPv6address without its dotted quad forms (``::ffff:1.2.3.4``; they would
    double the regex): eight 16-bit groups, one run of zero groups written ``::``."""
    h16 = f"{_HEX}{{1,4}}"
    ls32 = f"{h16}:{h16}"

    def groups(n: int) -> str:  # n groups, each followed by a colon
        return repeat(f"{h16}:", n, n)

    # After the "::", by the most groups before it (0..7): what leaves room for them.
    tails = [groups(5 - k) + ls32 for k in range(6)] + [h16, ""]
    forms = [groups(6) + ls32]
    for k, tail in enumerate(tails):
        head = f"(?:{h16}{repeat(':' + h16, 0, k - 1)})?" if k else ""
        forms.append(f"{head}::{tail}")
    return alt(forms)


# --- email (RFC 5321 Mailbox, dot-atom local part) ---
_ATEXT = "[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]"
_ATOM = f"{_ATEXT}{{1,20}}"


# --- uri (RFC 3986) ---
_PCHAR = f"(?:[A-Za-z0-9._~!$&'()*+,;=:@-]|%{_HEX}{_HEX})"
_PATH_OR_QUERY = f"(?:{_PCHAR}|[/?])"


def _uri() -> str:
    host = alt([_hostname(1, 7), _IPV4])
    port = f"(?::{int_range(0, 65535)})?"
    return (f"https?://{host}{port}(?:/(?:{_PCHAR}|/){{0,255}})?"
            f"(?:\\?{_PATH_OR_QUERY}{{0,127}})?(?:#{_PATH_OR_QUERY}{{0,31}})?")


# --- duration (RFC 3339 appendix A) ---
def _duration() -> str:
    n = f"{_DIGIT}{{1,6}}"
    second = f"{n}S"
    minute = f"{n}M(?:{second})?"
    hour = f"{n}H(?:{minute})?"
    time = f"T(?:{hour}|{minute}|{second})"
    day = f"{n}D"
    month = f"{n}M(?:{day})?"
    year = f"{n}Y(?:{month})?"
    return f"P(?:(?:{day}|{month}|{year})(?:{time})?|{time}|{n}W)"


FORMATS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": f"{_DATE}T{_TIME}",
    "uuid": "-".join(f"{_HEX}{{{n}}}" for n in (8, 4, 4, 4, 12)),
    "ipv4": _IPV4,
    "ipv6": _ipv6(),
    "hostname": _hostname(1, 7),
    "email": f"{_ATOM}(?:\\.{_ATOM}){{0,2}}@{_hostname(2, 5)}",
    "uri": _uri(),
    "duration": _duration(),
}


# OpenAPI's numeric formats. An integer's bounds its values (two's complement, of so many
# bits); a number's (IEEE binary32 or binary64) says only how it is read, which any JSON
# number can be.
INT_FORMATS = {"int32": 32, "int64": 64}
NUMBER_FORMATS = ("float", "double")
# OpenAPI's string formats that say nothing about the text: "password" (a hint to hide it,
# pydantic's SecretStr) and "binary" (any octets; pydantic's bytes, read from any JSON string).
FREE_STRING_FORMATS = ("password", "binary")


def format_type(fmt: object, path: str) -> str:
    """The type ``fmt`` is a format of ("string", "integer" or "number"); ValueError naming
    ``path`` for a format not supported. A format of another type than the value's is left
    alone, as JSON Schema's validators leave it."""
    if isinstance(fmt, str):
        if fmt in FORMATS or fmt in FREE_STRING_FORMATS:
            return "string"
        if fmt in INT_FORMATS:
            return "integer"
        if fmt in NUMBER_FORMATS:
            return "number"
    known = ", ".join([*FORMATS, *FREE_STRING_FORMATS, *INT_FORMATS, *NUMBER_FORMATS])
    raise ValueError(f"'format' {fmt!r} at {path} is not supported: only {known} are")


def int_format_bounds(fmt: str | None, lo: int | None, hi: int | None,
                      path: str) -> tuple[int | None, int | None]:
    """lo..hi (None: unbounded) within ``fmt``'s range when it is an integer format."""
    if fmt not in INT_FORMATS:
        return lo, hi
    half = 2 ** (INT_FORMATS[fmt] - 1)
    lo = -half if lo is None else max(lo, -half)
    hi = half - 1 if hi is None else min(hi, half - 1)
    if lo > hi:
        raise ValueError(f"the bounds at {path} leave no {fmt} integer")
    return lo, hi


@functools.cache
def format_lengths(fmt: str) -> tuple[int, int | None]:
    """The shortest and longest text of ``fmt``'s regex (None: no longest)."""
    return text_lengths(parse(FORMATS[fmt]))


def format_regex(fmt: str, min_length: int, max_length: int | None, path: str) -> str:
    """The regex of the string format ``fmt``'s text when its every text is
    min_length..max_length characters long (max_length None: unbounded); ValueError naming
    ``path`` otherwise."""
    lo, hi = format_lengths(fmt)
    if lo < min_length:
        raise ValueError(f"'minLength' beside 'format' at {path} is not supported: "
                         f"{fmt} texts may be {lo} characters long")
    if max_length is not None and (hi is None or hi > max_length):
        longest = "of any length" if hi is None else f"up to {hi} characters long"
        raise ValueError(f"'maxLength' beside 'format' at {path} is not supported: "
                         f"{fmt} texts may be {longest}")
    return FORMATS[fmt]
