"""multipleOf under guided_json (engine/json_multiples.py): value by value over a window of
integers and decimals, the regex matches exactly the multiples within the bounds, spelled
with as many digits after the point as multipleOf has; texts drawn from the regex far past
the window are multiples too; what cannot be written is refused; pydantic's constrained
types accept what the regex of their schema generates."""
from __future__ import annotations

import operator
import re
from decimal import Decimal
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.json_multiples import MAX_LISTED
from engine.json_schema_regex import schema_to_regex
from engine.regex_dfa import compile_regex
from tests.json_format_oracles import model_takes_what_its_regex_generates

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# (type, multipleOf, bounds): every value kind the construction has, near zero and the bounds.
CASES = [
    ("integer", 5, {}), ("integer", 10, {"minimum": -25}), ("integer", 4, {"maximum": 30}),
    ("integer", 25, {"exclusiveMinimum": -100, "exclusiveMaximum": 175}),
    ("integer", 0.5, {"minimum": -3, "maximum": 7}), ("integer", 2.5, {}),
    ("integer", 3, {"minimum": -40, "maximum": 400}), ("integer", 8, {"minimum": 990}),
    ("integer", 1000, {}), ("integer", 7, {"exclusiveMinimum": 0.5, "maximum": 99.9}),
    ("integer", 5, {"minimum": 3, "maximum": 9.5}),
    ("number", 0.01, {}), ("number", 0.01, {"minimum": 0, "maximum": 12.5}),
    ("number", 0.5, {"exclusiveMinimum": -2, "maximum": 3.25}), ("number", 0.25, {}),
    ("number", 2.5, {"minimum": -12.5}), ("number", 0.05, {"exclusiveMaximum": 1.2}),
    ("number", 1, {"minimum": -3.5}), ("number", 0.3, {"minimum": 0, "maximum": 30}),
    ("number", 5, {"maximum": -11}), ("number", 0.001, {"minimum": -0.0015, "maximum": 0.003}),
]


_COMPARE = {"minimum": operator.ge, "maximum": operator.le, "exclusiveMinimum": operator.gt,
            "exclusiveMaximum": operator.lt}


def _allowed(value: Fraction, k: Fraction, bounds: dict) -> bool:
    return (value / k).denominator == 1 and all(
        _COMPARE[kw](value, Fraction(str(bound))) for kw, bound in bounds.items())


def _places(t: str, k) -> int:
    return 0 if t == "integer" else max(0, -Decimal(repr(k)).normalize().as_tuple().exponent)


def _texts(n: int) -> set[str]:
    """n's integer text, -0 (and -0.0 ...), and n / 10, n / 100, n / 1000 spelled with 1..3
    places where exact (n = 1250: 125.0, 125.00, 125.000, 12.50, 12.500, 1.25, 1.250)."""
    out = {str(n), "-0", "-0.0", "-0.00", "-0.000"}
    sign, digits = "-" if n < 0 else "", str(abs(n))
    for shift in (1, 2, 3):
        whole, frac = digits[:-shift] or "0", digits[-shift:].zfill(shift)
        for places in range(1, 4):
            if len(frac) > places and frac[places:].strip("0"):
                continue  # not exact at this many places
            out.add(f"{sign}{whole}.{frac[:places].ljust(places, '0')}")
        out.add(f"{sign}{digits}.{'0' * shift}")
    return out


@pytest.mark.parametrize("t,k,bounds", CASES)
def test_the_regex_matches_exactly_the_multiples_within_the_bounds(t, k, bounds):
    schema = {"type": t, "multipleOf": k, **bounds}
    rx = re.compile(schema_to_regex(schema))
    dfa = compile_regex(rx.pattern)
    kf, places = Fraction(str(k)), _places(t, k)
    if t == "integer":  # an integer's multiples of a/b are those of a
        kf = Fraction(kf.numerator)
    matched = 0
    for n in range(-1200, 1201):
        for text in _texts(n):
            value = Fraction(Decimal(text))
            want = len(text.partition(".")[2]) == places and \
                not (value == 0 and text.startswith("-")) and _allowed(value, kf, bounds)
            assert bool(rx.fullmatch(text)) == want, (schema, text)
            if n % 7 == 0:  # the engine's automaton on a sample (re agrees with it elsewhere)
                assert dfa.fullmatch(text) == want, (schema, text)
            matched += want
    assert matched  # every case's window holds some


@pytest.mark.parametrize("t,k,bounds", CASES)
@SETTINGS
@given(data=st.data())
def test_texts_drawn_from_the_regex_are_multiples_within_the_bounds(t, k, bounds, data):
    schema = {"type": t, "multipleOf": k, **bounds}
    text = data.draw(st.from_regex(schema_to_regex(schema), fullmatch=True))
    kf = Fraction(str(k)) if t == "number" else Fraction(Fraction(str(k)).numerator)
    assert _allowed(Fraction(Decimal(text)), kf, bounds), text


def test_listed_multiples_stay_within_the_limit():
    # Multiples of 3 are listed when the bounds leave at most MAX_LISTED of them.
    assert schema_to_regex({"type": "integer", "multipleOf": 3, "minimum": 1,
                            "maximum": 3 * MAX_LISTED})
    with pytest.raises(ValueError, match="'multipleOf' at # is not supported"):
        schema_to_regex({"type": "integer", "multipleOf": 3, "minimum": 0,
                         "maximum": 3 * MAX_LISTED})


@pytest.mark.parametrize("schema,message", [
    ({"type": "integer", "multipleOf": 3}, "'multipleOf' at # is not supported"),
    ({"type": "number", "multipleOf": 0.3}, "'multipleOf' at # is not supported"),
    ({"type": "integer", "multipleOf": 16}, "'multipleOf' at # is not supported"),
    ({"type": "integer", "multipleOf": 0}, "'multipleOf' at # must be a number above 0"),
    ({"type": "number", "multipleOf": -0.5}, "must be a number above 0"),
    ({"type": "number", "multipleOf": "0.5"}, "must be a number above 0"),
    ({"type": "number", "multipleOf": True}, "must be a number above 0"),
    ({"type": "number", "multipleOf": float("inf")}, "must be a number above 0"),
    ({"type": "number", "multipleOf": 1e-50}, "more than 40 digits"),
    ({"type": "integer", "multipleOf": 5, "minimum": 1, "maximum": 4},
     "the bounds at # leave no multiple"),
    ({"properties": {"n": {"multipleOf": 10, "minimum": 1, "exclusiveMaximum": 10}}},
     "the bounds at #/properties/n leave no multiple"),
])
def test_what_cannot_be_written_is_refused(schema, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        schema_to_regex(schema)


def test_pydantics_constrained_numbers_accept_what_the_regex_generates():
    pydantic = pytest.importorskip("pydantic")

    class Order(pydantic.BaseModel):
        qty: int = pydantic.Field(multiple_of=5, ge=0)
        price: float = pydantic.Field(multiple_of=0.01, gt=0, le=10_000)
        step: float = pydantic.Field(multiple_of=0.25)

    model_takes_what_its_regex_generates(Order, 40)
