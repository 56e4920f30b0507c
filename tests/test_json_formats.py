"""guided_json's string formats (engine/json_formats.py): every text a format's regex matches
is valid by the RFC (tests/json_format_oracles.py) and within the lengths it reports; texts
drawn from the documented subset match, in Python's re and in the engine's automaton; edge
texts either way; lengths beside a format; and pydantic's own types accept what the regexes
of its schemas generate."""
from __future__ import annotations

import datetime
import ipaddress
import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.json_formats import FORMATS, format_lengths
from engine.json_schema_regex import schema_to_regex
from engine.regex_dfa import compile_regex
from engine.regex_parse import parse, text_lengths
from tests.json_format_oracles import (FORMAT_TEXTS, format_ok,
                                        model_takes_what_its_regex_generates)

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.parametrize("pattern,lengths", [
    ("abc", (3, 3)), ("a|bcd", (1, 3)), ("(?:ab)*", (0, None)), ("(?:ab){2,5}c", (5, 11)),
    ("a{0}", (0, 0)), ("(?:a+){0}", (0, 0)), ("(?:a|)b", (1, 2)), ("[0-9]+(?:x|yz)?", (1, None)),
    ("(?:(?:ab?){1,3}|c){2}", (2, 12)), ("\\u00e9\\U0001F600", (2, 2)),
])
def test_text_lengths_are_the_shortest_and_longest_match(pattern, lengths):
    assert text_lengths(parse(pattern)) == lengths


@pytest.mark.parametrize("fmt", FORMATS)
@SETTINGS
@given(data=st.data())
def test_every_text_a_formats_regex_matches_is_valid(fmt, data):
    text = data.draw(st.from_regex(FORMATS[fmt], fullmatch=True))
    assert format_ok(fmt, text), text
    lo, hi = format_lengths(fmt)
    assert lo <= len(text) <= (hi if hi is not None else len(text))


@pytest.mark.parametrize("fmt", FORMATS)
@SETTINGS
@given(data=st.data())
def test_texts_of_the_subset_match_in_re_and_in_the_automaton(fmt, data):
    text = data.draw(FORMAT_TEXTS[fmt])
    assert format_ok(fmt, text), text
    assert re.fullmatch(FORMATS[fmt], text), text
    assert compile_regex(f'"{FORMATS[fmt]}"').fullmatch(json.dumps(text)), text


GOOD = {
    "date-time": ["0001-01-01T00:00:00Z", "9999-12-31T23:59:59.999+23:59",
                  "2024-02-29T12:00:00-05:30"],
    "ipv4": ["0.0.0.0", "255.255.255.255", "192.168.1.10", "10.0.0.1"],
    "ipv6": ["::", "::1", "1::", "fe80::1:2", "1:2:3:4:5:6:7:8", "1:2:3:4:5:6:7::",
             "::2:3:4:5:6:7:8", "2001:DB8::A", "1:0:0:0:0:0:0:1", "ffff:ffff::ffff:ffff"],
    "hostname": ["localhost", "example.com", "a-b.c0.example.org", "a.b.c.d.e.f.gh",
                 "x" * 37 + ".y" + "z" * 23, "ab-c.io"],
    "email": ["a@b.co", "first.last+tag@mail.example.com", "o'h!#$%&*/=?^_`{|}~-@x.org", "a@b.c"],
    "uri": ["http://a", "https://example.com:8080/a/b?x=1&y=%20#top", "http://1.2.3.4:0/",
            "https://x.org//a//?q=/?#/?", "http://a.b/~u/(c);d=e,f@g:h"],
    "duration": ["P1Y", "P1Y2M", "P1Y2M3DT4H5M6S", "P3D", "P2M3D", "PT4H", "PT5M6S", "PT6S",
                 "P7W", "P0W", "P1DT1H"],
}
BAD = {
    "date-time": ["0000-01-01T00:00:00Z", "2023-02-29T00:00:00Z", "2020-01-01T23:59:60Z",
                  "2020-01-01t00:00:00Z", "2020-01-01T00:00:00", "2020-01-01T24:00:00Z",
                  "2020-01-01T00:00:00+24:00"],
    "ipv4": ["256.1.1.1", "01.2.3.4", "1.2.3", "1.2.3.4.5", "1.2.3.", " 1.2.3.4", "1.2.3.4a"],
    "ipv6": [":::", "1::2::3", "1:2:3:4:5:6:7:8:9", "12345::", "::g", "1:2:3:4:5:6:7",
             "fe80::1%eth0", "::1.2.3", "1:2:3:4:5:6:7:1.2.3.4"],
    "hostname": ["-a.com", "a-.com", "ab--c.com", "xn--a.com", "a..b", ".a", "a.", "a_b.com",
                 "a" * 64 + ".com", "a b"],
    "email": ["a@b", "a..b@c.com", ".a@b.com", "a.@b.com", "a@-b.com", "a b@c.com", "@c.com",
              "a@b@c.com", '"a"@b.com'],
    "uri": ["http://a:65536", "http://a b", "http://a/%zz", "http://a/%4", "http://", "a.com",
            "http://a/<b>", "http://a/\\b", "http//a", "http://-a.com"],
    "duration": ["P", "PT", "P1", "1D", "P1H", "PT1D", "P1Y1D", "PT1H1S", "P1W1D", "P1WT1H",
                 "P1.5D", "P-1D", "P1DT"],
}

# Valid, and left out of the subset the regexes generate (engine/json_formats.py).
OUTSIDE = {
    "ipv6": ["::ffff:192.0.2.1", "64:ff9b::10.0.0.1", "1:2:3:4:5:6:1.2.3.4"],
    "hostname": ["a" * 38 + ".com", "a.b.c.d.e.f.g.h", "example.c" + "o" * 24, "1.2.3.4"],
    "email": ["a" * 21 + "@b.co", "a.b.c.d@x.org"],
    "uri": ["http://a.com/" + "x" * 256, "http://a.com/?" + "x" * 128],
    "duration": ["P1234567D"],
}


@pytest.mark.parametrize("fmt", OUTSIDE)
def test_the_subset_leaves_out_what_it_says(fmt):
    for text in OUTSIDE[fmt]:
        assert format_ok(fmt, text) and not re.fullmatch(FORMATS[fmt], text), text


@pytest.mark.parametrize("fmt", GOOD)
def test_edge_texts_match_where_they_are_valid(fmt):
    dfa = compile_regex(f'"{FORMATS[fmt]}"')
    for text in GOOD[fmt]:
        assert format_ok(fmt, text) and re.fullmatch(FORMATS[fmt], text), text
        assert dfa.fullmatch(json.dumps(text)), text
    for text in BAD[fmt]:
        assert not format_ok(fmt, text), text
        assert not re.fullmatch(FORMATS[fmt], text) and not dfa.fullmatch(json.dumps(text)), text


def test_bounded_formats_stay_within_their_rfcs_lengths():
    assert format_lengths("hostname")[1] <= 253
    assert format_lengths("email")[1] <= 254
    assert format_lengths("uri")[1] <= 2083
    for fmt, lengths in [("date", (10, 10)), ("uuid", (36, 36)), ("ipv4", (7, 15)),
                         ("ipv6", (2, 39)), ("time", (9, None)),
                         ("duration", (3, 44))]:
        assert format_lengths(fmt) == lengths, fmt


def test_a_schema_of_twenty_formatted_fields_compiles_into_the_engines_automaton():
    # The regexes are kept small for this: each bounded character of a URL is automaton
    # states, and the compiler refuses patterns over 16384 characters or 50000 states.
    props = {f"{fmt}_{i}": {"type": "string", "format": fmt}
             for fmt in ("uri", "email", "hostname", "ipv6", "date-time") for i in range(4)}
    schema = {"type": "object", "properties": props, "required": list(props)}
    dfa = compile_regex(schema_to_regex(schema))
    value = {k: GOOD[k.split("_")[0]][-1] for k in props}
    assert dfa.fullmatch(json.dumps(value)) and dfa.fullmatch(json.dumps(value, indent=None,
                                                                          separators=",:"))


def test_lengths_beside_a_format_are_taken_when_every_text_meets_them():
    date = schema_to_regex({"type": "string", "format": "date"})
    assert schema_to_regex({"type": "string", "format": "date", "minLength": 10,
                            "maxLength": 10}) == date
    uri = {"type": "string", "format": "uri"}
    assert schema_to_regex({**uri, "minLength": 1, "maxLength": 2083}) == schema_to_regex(uri)
    for bad in [{"format": "date", "maxLength": 9}, {"format": "date", "minLength": 11},
                {"format": "duration", "maxLength": 40}, {"format": "time", "maxLength": 99},
                {"format": "email", "minLength": 6}]:
        with pytest.raises(ValueError, match="beside 'format'"):
            schema_to_regex({"type": "string", **bad})


@pytest.mark.parametrize("schema,good,bad", [
    ({"type": "integer", "format": "int32"}, ["2147483647", "-2147483648", "0"],
     ["2147483648", "-2147483649", "99999999999"]),
    ({"type": "integer", "format": "int64"}, [str(2 ** 63 - 1), str(-2 ** 63)],
     [str(2 ** 63), str(-2 ** 63 - 1)]),
    ({"format": "int32", "minimum": -5}, ["-5", "2147483647"], ["-6", "2147483648", '"1"']),
    ({"type": "integer", "format": "int32", "exclusiveMaximum": 1e12}, ["2147483647"],
     ["2147483648"]),
    # A format of another type is left alone: any integer, and only dates for strings.
    ({"type": ["string", "integer"], "format": "date"}, ["123456789012345678901", '"2024-02-29"'],
     ['"x"', '"2023-02-29"']),
    ({"type": "string", "format": "int64", "maxLength": 2}, ['"ab"', '""'], ['"abc"', "1"]),
    ({"type": "number", "format": "float"}, ["1e400", "-0.5", "3"], ['"1"']),
    ({"type": "number", "format": "double"}, ["1.5E-7"], ["NaN"]),
    ({"type": "string", "format": "password", "minLength": 2}, [r'"h\u00e9"', '"ab"'], ['"a"']),
    ({"type": "string", "format": "binary"}, ['""', r'"\u0000"'], ["0", '"\x00"']),
])
def test_openapis_formats_bound_integers_and_leave_the_others(schema, good, bad):
    rx = re.compile(schema_to_regex(schema))
    for text in good:
        assert rx.fullmatch(text), text
    for text in bad:
        assert not rx.fullmatch(text), text


@pytest.mark.parametrize("schema,message", [
    ({"type": "integer", "format": "uint8"}, "'format' 'uint8' at # is not supported"),
    ({"type": "boolean", "format": ["date"]}, "'format' ['date'] at #"),
    ({"properties": {"a": {"format": "iri"}}}, "'format' 'iri' at #/properties/a"),
    ({"type": "integer", "format": "int32", "minimum": 2 ** 31}, "leave no int32 integer"),
])
def test_formats_of_no_type_here_are_refused(schema, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        schema_to_regex(schema)


def test_pydantics_types_accept_what_the_regex_of_their_schema_generates():
    pydantic = pytest.importorskip("pydantic")

    class Host(pydantic.BaseModel):
        url: pydantic.HttpUrl
        any_url: pydantic.AnyUrl
        v4: ipaddress.IPv4Address
        v6: ipaddress.IPv6Address
        took: datetime.timedelta
        day: datetime.date
        at: datetime.datetime
        secret: pydantic.SecretStr
        raw: bytes

    assert Host.model_json_schema()["properties"]["url"]["maxLength"] == 2083  # taken beside
    model_takes_what_its_regex_generates(Host, 40)
