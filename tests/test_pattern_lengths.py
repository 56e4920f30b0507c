"""A pattern cut down to a length range (engine/pattern_lengths.py), for guided_json's
``pattern`` beside ``minLength``/``maxLength``: over every text of up to 7 characters from a
small alphabet, what the cut pattern matches the pattern matches too, within the lengths (for
random patterns and ranges); where the pattern is one repeat of one class the cut is exact;
through a schema, every text drawn from the regex is a valid instance; pydantic's
constrained strings accept what the regex of their schema generates."""
from __future__ import annotations

import itertools
import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.json_schema_regex import schema_to_regex
from engine.json_string_pattern import _regex
from engine.pattern_lengths import fit_lengths
from engine.regex_parse import parse, text_lengths
from tests.json_format_oracles import model_takes_what_its_regex_generates

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TEXTS = ["".join(t) for n in range(8) for t in itertools.product("abc", repeat=n)]


@st.composite
def patterns(draw, depth: int = 3) -> str:
    """Small regexes over a, b, c: literals, classes, groups, alternation, quantifiers."""
    if depth == 0 or draw(st.integers(0, 3)) == 0:
        return draw(st.sampled_from(["a", "b", "c", "[ab]", "[a-c]", "[bc]"]))
    kind = draw(st.sampled_from(["concat", "alt", "repeat"]))
    if kind == "concat":
        return "".join(draw(st.lists(patterns(depth - 1), min_size=2, max_size=3)))
    if kind == "alt":
        return "(?:" + "|".join(draw(st.lists(patterns(depth - 1), min_size=2, max_size=3))) \
            + ")"
    lo = draw(st.integers(0, 2))
    hi = draw(st.sampled_from([None, lo, lo + 1, lo + 3]))
    quantifier = f"{{{lo},}}" if hi is None else f"{{{lo},{hi}}}"
    return f"(?:{draw(patterns(depth - 1))}){quantifier}"


@SETTINGS
@given(pattern=patterns(), lo=st.integers(0, 6), extra=st.sampled_from([None, 0, 1, 2, 4]))
def test_what_the_cut_matches_the_pattern_matches_within_the_lengths(pattern, lo, extra):
    hi = None if extra is None else lo + extra
    tree = parse(pattern)
    fitted = fit_lengths(tree, lo, hi)
    whole = re.compile(pattern)
    if fitted is None:
        return
    cut = re.compile(_regex(fitted))
    found = [t for t in TEXTS if cut.fullmatch(t)]
    for text in found:
        assert whole.fullmatch(text) and lo <= len(text) <= (hi if hi is not None else 99), \
            (pattern, lo, hi, _regex(fitted), text)
    shortest, longest = text_lengths(fitted)
    assert lo <= shortest and (hi is None or (longest is not None and longest <= hi))
    if longest is not None and longest <= 7:
        assert found  # a cut that is not None matches something


@pytest.mark.parametrize("pattern", ["[abc]+", "[abc]*", "(?:[abc]){2,}", "[ab]?[abc]{0,5}"])
@pytest.mark.parametrize("lo,hi", [(0, 3), (2, 5), (4, 4), (1, None), (6, 7)])
def test_one_repeat_of_a_class_is_cut_exactly(pattern, lo, hi):
    whole = re.compile(pattern)
    fitted = fit_lengths(parse(pattern), lo, hi)
    want = [t for t in TEXTS if whole.fullmatch(t) and lo <= len(t) <= (hi or 99)
            and set(t) <= set("abc")]
    if pattern.startswith("[ab]?"):  # two parts: a subset, both parts sharing the room
        assert fitted is not None
        return
    assert [t for t in TEXTS if re.fullmatch(_regex(fitted), t)] == want


def test_a_concatenation_shares_the_room_evenly():
    fitted = fit_lengths(parse("[a-z]+-[0-9]+"), 5, 9)
    assert re.fullmatch(_regex(fitted), "abcd-1234") and re.fullmatch(_regex(fitted), "ab-12")
    assert not re.fullmatch(_regex(fitted), "abcde-123")  # valid, past a's share of the room


SCHEMA = {"type": "object", "required": ["user", "tag"], "properties": {
    "user": {"type": "string", "pattern": "^[a-z_][a-z0-9_]*$", "minLength": 3, "maxLength": 12},
    "tag": {"type": "string", "pattern": "^(?:x|yz)+$", "minLength": 4}}}


@settings(SETTINGS, max_examples=40)
@given(data=st.data())
def test_every_text_a_schemas_regex_matches_has_the_pattern_and_the_lengths(data):
    value = json.loads(data.draw(st.from_regex(schema_to_regex(SCHEMA), fullmatch=True)))
    assert re.fullmatch("[a-z_][a-z0-9_]*", value["user"]) and 3 <= len(value["user"]) <= 12
    assert re.fullmatch("(?:x|yz)+", value["tag"]) and len(value["tag"]) >= 4


def test_an_open_end_takes_any_characters_within_the_lengths():
    # Every JSON string of up to 6 characters from a few (a quote and a backslash escaped):
    # those the regex matches hold the pattern somewhere and are short enough.
    from engine.regex_dfa import compile_regex

    dfa = compile_regex(schema_to_regex({"type": "string", "pattern": "[0-9]{2}",
                                         "maxLength": 6}))
    found = []
    for n in range(8):
        for chars in itertools.product('a1"\\', repeat=n):
            value = "".join(chars)
            if dfa.fullmatch(json.dumps(value)):
                assert re.search("[0-9]{2}", value) and len(value) <= 6, value
                found.append(value)
    assert {"11", 'a11"', "\\11\\"} <= set(found)


def test_a_cut_past_the_largest_count_compiles_in_pieces():
    from engine.regex_dfa import compile_regex

    dfa = compile_regex(schema_to_regex({"type": "string", "pattern": "^[A-Z]+$",
                                         "maxLength": 2500}))
    assert dfa.fullmatch('"' + "Q" * 2500 + '"') and dfa.fullmatch('"Q"')
    assert not dfa.fullmatch('"' + "Q" * 2501 + '"') and not dfa.fullmatch('""')


def test_pydantics_constrained_strings_accept_what_the_regex_generates():
    pydantic = pytest.importorskip("pydantic")

    class Account(pydantic.BaseModel):
        handle: str = pydantic.Field(pattern=r"^@[a-z0-9_]+$", min_length=4, max_length=16)
        zip: str = pydantic.Field(pattern=r"^\d{5}(?:-\d{4})?$", max_length=10)
        ref: str = pydantic.Field(pattern=r"^[A-Z]{3}[0-9]+$", min_length=5, max_length=8)

    model_takes_what_its_regex_generates(Account, 40)
