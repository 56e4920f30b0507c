"""Hypothesis strategies for requests from outside: per SamplingParams field, the values a
server must accept and anything the wire can carry (tests/test_router_fuzz.py,
tests/test_worker_fuzz.py)."""
from __future__ import annotations

import json
import math

from hypothesis import strategies as st

INT32 = st.integers(-2**31, 2**31 - 1)
INT64 = st.integers(-2**63, 2**63 - 1)
WILD_INTS = st.one_of(st.sampled_from([-1, 0, 1, 2, 20, 21, 64, 65, 8191, 8192, 2**31 - 1]),
                      INT32)
WILD_FLOATS = st.one_of(st.sampled_from([0.0, -0.0, 1e-9, 1.0, 2.0, 2.5, 100.0, 101.0, -1.0,
                                         math.inf, -math.inf, math.nan, 1e308]),
                        st.floats(allow_nan=True, allow_infinity=True))
WILD_IDS = st.lists(st.one_of(st.integers(0, 8300), INT64), max_size=8)
IDS = st.integers(0, 8191)  # tiny-llama's vocabulary
WORDS = st.text(min_size=1, max_size=10).filter(str.strip)


_SCHEMAS = [{"type": "integer", "minimum": -5, "maximum": 500}, {"enum": ["a", 1, None]},
            {"type": "object", "properties": {"a": {"type": "boolean"},
                                              "b": {"type": "string", "maxLength": 3}},
             "required": ["a"]},
            {"type": "array", "items": {"type": "number"}, "maxItems": 2},
            {"type": "object", "properties": {"p": {"type": "number", "minimum": 0,
                                                    "exclusiveMaximum": 1},
                                              "s": {"type": "string", "pattern": "^[a-c]{1,3}$"}},
             "required": ["p", "s"]}]
_BAD_SCHEMAS = ['{"type": "string", "pattern": "(a"}', '{"$ref": "#/$defs/x"}', "false",
                '{"type": "integer", "minimum": 3, "maximum": 1}', "[]", "{" * 200]


def _floats(lo: float, hi: float):
    return st.floats(lo, hi, allow_nan=False, allow_infinity=False)


# Per field: values the router must accept, and anything the wire can carry.
FIELDS = {
    "max_tokens": (st.integers(1, 4), INT32),
    "temperature": (_floats(0.0, 2.0), WILD_FLOATS),
    "top_k": (st.one_of(st.just(-1), st.integers(0, 50)), WILD_INTS),
    "top_p": (_floats(0.05, 1.0), WILD_FLOATS),
    "min_p": (_floats(0.0, 1.0), WILD_FLOATS),
    "seed": (INT64, INT64),
    "stop": (st.lists(WORDS, max_size=3), st.lists(st.text(max_size=10), max_size=3)),
    "stop_token_ids": (st.lists(IDS, max_size=3), WILD_IDS),
    "ignore_eos": (st.booleans(), st.booleans()),
    "logprobs": (st.integers(0, 20), WILD_INTS),
    "include_stop_str_in_output": (st.booleans(), st.booleans()),
    "skip_special_tokens": (st.booleans(), st.booleans()),
    "repetition_penalty": (_floats(0.5, 3.0), WILD_FLOATS),
    "presence_penalty": (_floats(-2.0, 2.0), WILD_FLOATS),
    "frequency_penalty": (_floats(-2.0, 2.0), WILD_FLOATS),
    "min_tokens": (st.integers(0, 1), INT32),
    "logit_bias": (st.dictionaries(IDS, _floats(-100.0, 100.0), max_size=3),
                   st.dictionaries(st.one_of(st.integers(0, 8300), INT64), WILD_FLOATS,
                                   max_size=3)),
    "n": (st.integers(1, 3), INT32),
    "allowed_token_ids": (st.lists(IDS, max_size=4), WILD_IDS),
    "priority": (st.just(0), WILD_INTS),  # the workers run fcfs: anything else is refused
    "truncate_prompt_tokens": (st.integers(1, 64), WILD_INTS),
    "prompt_logprobs": (st.integers(0, 5), WILD_INTS),
    "bad_words": (st.lists(WORDS, max_size=3), st.lists(st.text(max_size=10), max_size=3)),
    # Valid alone: beside ignore_eos or allowed_token_ids it is the client's INVALID_ARGUMENT.
    "guided_choice": (st.lists(WORDS, max_size=3), st.lists(st.text(max_size=12), max_size=4)),
    # Any text is a pattern, most not valid (INVALID_ARGUMENT), some matching nothing tokens
    # can spell.
    "guided_regex": (st.sampled_from([r"[a-z]{1,6}", r"\d{1,3}(\.\d)?", "yes|no", "(ab)*c?",
                                      "日本|🚀+", r'"[^"]{0,4}"']),
                     st.text(max_size=16)),
    "guided_json": (st.sampled_from([json.dumps(s) for s in _SCHEMAS]),
                    st.one_of(st.text(max_size=16), st.sampled_from(_BAD_SCHEMAS))),
}
