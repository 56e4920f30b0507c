"""What each string ``format`` of guided_json means (engine/json_formats.py), written from the
RFCs without regexes where it can be: ``format_ok`` checks a text, ``FORMAT_TEXTS`` draws texts
within the subset the regexes generate (hypothesis strategies)."""
from __future__ import annotations

import datetime
import ipaddress
import re
import string
import urllib.parse
import uuid

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

_LDH = set(string.ascii_letters + string.digits + "-")
_ATEXT = set(string.ascii_letters + string.digits + "!#$%&'*+/=?^_`{|}~-")
_PCHARS = set(string.ascii_letters + string.digits + "._~!$&'()*+,;=:@-")


def _hostname_ok(s: str) -> bool:
    """RFC 1123 (and RFC 5891's reserved "--" in a label's 3rd and 4th characters)."""
    return len(s) <= 253 and all(0 < len(x) <= 63 and set(x) <= _LDH and "-" not in x[0] + x[-1]
                                 and x[2:4] != "--" for x in s.split("."))


def _email_ok(s: str) -> bool:
    local, at, domain = s.rpartition("@")
    return bool(at) and len(s) <= 254 and len(local) <= 64 and "." in domain and \
        all(atom and set(atom) <= _ATEXT for atom in local.split(".")) and _hostname_ok(domain)


def _escaped_ok(text: str, extra: str) -> bool:
    """RFC 3986 characters (pchar and ``extra``), a % only before two hex digits."""
    allowed = _PCHARS | set(extra)
    head, *escaped = text.split("%")
    return set(head) <= allowed and all(
        len(p) >= 2 and set(p[:2]) <= set(string.hexdigits) and set(p[2:]) <= allowed
        for p in escaped)


def _uri_ok(s: str) -> bool:
    u = urllib.parse.urlsplit(s)
    try:
        port = u.port
    except ValueError:
        return False
    host = u.netloc.rsplit(":", 1)[0] if port is not None else u.netloc
    return len(s) <= 2083 and u.scheme in ("http", "https") and s.startswith(u.scheme + "://") \
        and (format_ok("ipv4", host) or _hostname_ok(host)) and \
        (port is not None or ":" not in u.netloc) and \
        all(_escaped_ok(part, "/?") for part in (u.path, u.query, u.fragment))


def _duration_ok(s: str) -> bool:
    """RFC 3339 appendix A: units in order, none skipped between the first and the last of
    the date's (Y M D) or the time's (H M S); weeks alone; a T before at least one unit."""
    m = re.fullmatch(r"P((?:[0-9]+[YMWD])*)(?:T((?:[0-9]+[HMS])+))?", s)
    if not m:
        return False
    date = "".join(re.findall(r"[A-Z]", m[1]))
    time = None if m[2] is None else "".join(re.findall(r"[A-Z]", m[2]))
    if time is not None and time not in ("H", "HM", "HMS", "M", "MS", "S"):
        return False
    if date == "W":
        return time is None
    return date in ("D", "M", "MD", "Y", "YM", "YMD") or (not date and time is not None)


def format_ok(fmt: str, s: str) -> bool:
    if fmt in ("password", "binary", "int32", "int64", "float", "double"):
        return True  # OpenAPI's: no constraint on a string's text
    if fmt in ("ipv4", "ipv6"):
        try:
            return "%" not in s and bool(ipaddress.ip_address(s).version == int(fmt[-1]))
        except ValueError:
            return False
    checks = {"hostname": _hostname_ok, "email": _email_ok, "uri": _uri_ok,
              "duration": _duration_ok}
    if fmt in checks:
        return checks[fmt](s)
    if fmt == "uuid":
        try:
            return len(s) == 36 and s[8] + s[13] + s[18] + s[23] == "----" and bool(uuid.UUID(s))
        except ValueError:
            return False
    if fmt == "date-time":
        return s.count("T") == 1 and all(format_ok(f, p) for f, p in
                                         zip(("date", "time"), s.split("T")))
    if fmt == "date":
        m = re.fullmatch(r"([0-9]{4})-([0-9]{2})-([0-9]{2})", s)
        try:  # Python's dates, from year 1: RFC 3339's year 0 is left out
            return bool(m) and bool(datetime.date(int(m[1]), int(m[2]), int(m[3])))
        except ValueError:
            return False
    m = re.fullmatch(r"([0-9]{2}):([0-9]{2}):([0-9]{2})(\.[0-9]+)?(Z|[+-]([0-9]{2}):([0-9]{2}))",
                     s)
    return bool(m) and int(m[1]) < 24 and int(m[2]) < 60 and int(m[3]) < 60 and \
        (m[5] == "Z" or int(m[6]) < 24 and int(m[7]) < 60)


_TIMES = st.tuples(st.times(), st.sampled_from(["Z", "+05:30", "-00:00", "+23:59"])).map(
    lambda t: t[0].isoformat() + t[1])


def _labels(first: str, most: int):
    """Hostname labels of at most ``most`` characters, the first one of the class ``first``."""
    return st.from_regex(f"{first}(?:[A-Za-z0-9-]{{0,{most - 2}}}[A-Za-z0-9])?",
                         fullmatch=True).filter(lambda x: x[2:4] != "--")


def _hostnames(least: int, most: int):
    """Names of least..most labels within the format's subset (engine/json_formats.py)."""
    return st.tuples(st.lists(_labels("[A-Za-z0-9]", 37), min_size=least - 1,
                              max_size=most - 1), _labels("[A-Za-z]", 24)).map(
        lambda t: ".".join([*t[0], t[1]]))


_ESCAPED = st.lists(st.sampled_from(sorted(_PCHARS)) | st.integers(0, 255).map("%{:02x}".format),
                    max_size=8).map("".join)
_URIS = st.builds(
    lambda scheme, host, port, segments, query, fragment:
        f"{scheme}://{host}{port}{''.join('/' + x for x in segments)}{query}{fragment}",
    st.sampled_from(["http", "https"]), _hostnames(1, 7) | st.ip_addresses(v=4).map(str),
    st.just("") | st.integers(0, 65535).map(":{}".format), st.lists(_ESCAPED, max_size=4),
    st.just("") | _ESCAPED.map("?{}".format), st.just("") | _ESCAPED.map("#{}".format))


def _duration(date: str, time: str | None, counts: list[int]) -> str:
    text = "P" + "".join(f"{n}{unit}" for n, unit in zip(counts, date))
    return text if time is None else text + "T" + "".join(f"{n}{u}" for n, u in zip(counts, time))


_DURATIONS = st.integers(0, 999_999).map("P{}W".format) | st.builds(
    _duration, st.sampled_from(["", "D", "M", "MD", "Y", "YM", "YMD"]),
    st.sampled_from([None, "H", "HM", "HMS", "M", "MS", "S"]),
    st.lists(st.integers(0, 999_999), min_size=3, max_size=3)).filter(lambda d: d != "P")
FORMAT_TEXTS = {"date": st.dates().map(str), "time": _TIMES,
            "date-time": st.tuples(st.dates(), _TIMES).map(lambda t: f"{t[0]}T{t[1]}"),
            "uuid": st.uuids().flatmap(lambda u: st.sampled_from([str(u), str(u).upper()])),
            "ipv4": st.ip_addresses(v=4).map(str),
            "ipv6": st.ip_addresses(v=6).flatmap(  # the hex forms: no dotted quad
                lambda a: st.sampled_from([str(a), a.exploded, str(a).upper()])).filter(
                lambda text: "." not in text),
            "hostname": _hostnames(1, 7),
            "email": st.builds("{}@{}".format, st.lists(st.text(sorted(_ATEXT), min_size=1,
                                                                max_size=20),
                                                        min_size=1, max_size=3).map(".".join),
                               _hostnames(2, 5)),
            "uri": _URIS, "duration": _DURATIONS}


def model_takes_what_its_regex_generates(model, examples: int) -> re.Pattern:
    """Draws ``examples`` texts from the guided_json regex of a pydantic model's schema and
    validates each with the model (its own parsers: URLs, dates, constrained numbers);
    returns the compiled regex."""
    from engine.json_schema_regex import schema_to_regex

    rx = re.compile(schema_to_regex(model.model_json_schema()))

    @settings(max_examples=examples, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(text=st.from_regex(rx, fullmatch=True))
    def check(text):
        model.model_validate_json(text)

    check()
    return rx
