"""engine/regex_dfa.py (and engine/regex_parse.py): the guided-regex DFA against Python's ``re``.

``re.fullmatch(pattern, text, re.ASCII)`` is the oracle: random patterns from a grammar of the
supported syntax are drawn with texts built to match them, near misses of those, and random
texts, and the DFA must agree on every one. It must refuse every pattern ``re`` refuses, and of
the grammar's patterns that ``re`` accepts only those that match no text at all. Every state
the DFA reaches must be live (acceptance stays reachable), realistic patterns behave, and each
unsupported construct and limit is refused with a ValueError that names it. The DFA is built
whole when compiled: its state counts are checked on patterns small enough to count by hand,
its budgets refuse exponential patterns as they are built (and admit what is just under
them), and every regex guided_json makes for the schemas of its own tests compiles.
"""
from __future__ import annotations

import functools
import json
import random
import re
import string
import threading
import warnings

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from engine import regex_dfa
from engine.json_schema_regex import schema_to_regex
from engine.compile_cache import CompileCache
from engine.regex_dfa import (DEAD, MAX_BUILD_STEPS, MAX_DFA_STATES, MAX_NESTING, MAX_NFA_STATES,
                              MAX_PATTERN_LENGTH, MAX_REPEAT, RegexDfa, build_nfa, compile_regex)
from engine.regex_parse import MAX_CODE_POINT, Alternative, parse, parse_alternatives
from tests.test_json_schema_regex import SCHEMAS

# (pattern, the character it matches); raw { and } may combine into counts, as in re.
LITERALS = [("a", "a"), ("b", "b"), ("0", "0"), ("é", "é"), ("😀", "😀"), ("-", "-"),
            (" ", " "), ("}", "}"), ("{", "{"), ("]", "]"), ("\\.", "."), ("\\*", "*"),
            ("\\\\", "\\"), ("\\{", "{"), ("\\(", "("), ("\\|", "|"), ("\\n", "\n"), ("\\t", "\t"),
            ("\\x41", "A"), ("\\u00e9", "é"), ("\\U0001F600", "😀"), ("\\0", "\0")]
# A raw ] or ^ only where it is a member: first, they would end or negate the class.
CLASS_MEMBERS = ["a", "b", "é", "😀", "0-9", "a-c", "\\d", "\\w", "\\s", "\\D", "\\W", "-",
                 "\\^", "a^", "\\]", "\\\\", ".", "\\n", "\\x41-\\x5a"]
TEXT_CHARS = "ab0Aé😀-_ .{}*\\\n\t\v\0"
QUANTIFIERS = ["*", "+", "?", "{0}", "{1}", "{2}", "{1,}", "{,2}", "{0,2}", "{1,3}", "{,}"]


def py_fullmatch(pattern: str, text: str) -> bool:
    with warnings.catch_warnings():  # re warns of possible future set syntax like [--]
        warnings.simplefilter("ignore", FutureWarning)
        return re.fullmatch(pattern, text, re.ASCII) is not None


def py_compiles(pattern: str) -> bool:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            re.compile(pattern, re.ASCII)
        return True
    except re.error:
        return False


@functools.lru_cache(maxsize=None)
def chars_matching(pattern: str) -> tuple[str, ...]:
    """The characters of TEXT_CHARS (and a few more) that a one-character pattern matches."""
    if not py_compiles(pattern):
        return ()
    return tuple(c for c in TEXT_CHARS + "zé9" if py_fullmatch(pattern, c))


# A pattern is drawn as a tree: ("chars", pattern, matching characters), ("group", opener,
# alternation), ("repeat", atom, quantifier text, lo, hi), ("seq", pieces), ("alt", branches).
# render() writes its text; sample() makes a text it matches (when re agrees, which a raw { or
# a stray ] in a class can change: the oracle decides, not the sample).
@st.composite
def atoms(draw, depth: int):
    kinds = ["literal"] * 3 + ["class"] * 3 + ["dot", "nothing"] + ["group"] * 4 * (depth > 0)
    kind = draw(st.sampled_from(kinds))
    if kind == "literal":
        pattern, ch = draw(st.sampled_from(LITERALS))
        return ("chars", pattern, (ch,))
    if kind == "dot":
        return ("chars", ".", chars_matching("."))
    if kind == "nothing":  # matches no character: the branch it is on can never finish
        return ("chars", draw(st.sampled_from(["[^\\d\\D]", "[^\\s\\S]"])), ())
    if kind == "class":
        members = draw(st.lists(st.sampled_from(CLASS_MEMBERS), min_size=1, max_size=3))
        lead = draw(st.sampled_from(["", "", "]"]))
        pattern = "[" + ("^" if draw(st.booleans()) else "") + lead + "".join(members) + "]"
        return ("chars", pattern, chars_matching(pattern))
    return ("group", draw(st.sampled_from(["(", "(?:"])), draw(alternations(depth - 1)))


@st.composite
def pieces(draw, depth: int):
    atom = draw(atoms(depth))
    if draw(st.integers(0, 2)) == 0:
        return atom
    q = draw(st.sampled_from(QUANTIFIERS))
    lo, hi = {"*": (0, 2), "+": (1, 3), "?": (0, 1)}.get(q, (0, 0))
    if q.startswith("{"):
        lo_text, comma, hi_text = q.strip("{}").partition(",")
        lo = int(lo_text or 0)
        hi = int(hi_text) if hi_text else lo + 2 if comma else lo
    lazy = "?" if draw(st.integers(0, 3)) == 0 else ""
    return ("repeat", atom, q + lazy, lo, hi)


@st.composite
def sequences(draw, depth: int):
    return ("seq", draw(st.lists(pieces(depth), max_size=3)))


@st.composite
def alternations(draw, depth: int):
    return ("alt", draw(st.lists(sequences(depth), min_size=1, max_size=3)))


def render(tree) -> str:
    kind = tree[0]
    if kind == "chars":
        return tree[1]
    if kind == "group":
        return tree[1] + render(tree[2]) + ")"
    if kind == "repeat":
        return render(tree[1]) + tree[2]
    return ("" if kind == "seq" else "|").join(render(t) for t in tree[1])


def sample(tree, rng) -> str:
    kind = tree[0]
    if kind == "chars":
        return rng.choice(tree[2]) if tree[2] else ""
    if kind == "group":
        return sample(tree[2], rng)
    if kind == "repeat":
        return "".join(sample(tree[1], rng) for _ in range(rng.randint(tree[3], tree[4])))
    if kind == "seq":
        return "".join(sample(t, rng) for t in tree[1])
    return sample(rng.choice(tree[1]), rng)


@st.composite
def patterns(draw, depth: int):
    """(pattern, a function of a random.Random making texts it matches), groups nested up to
    ``depth`` deep. re backtracks exponentially on quantifiers nested three deep, so the
    oracle's patterns nest less than the liveness test's."""
    tree = draw(alternations(depth))
    prefix = draw(st.sampled_from(["", "", "^", "\\A"]))
    suffix = draw(st.sampled_from(["", "", "$", "\\Z"]))
    return prefix + render(tree) + suffix, lambda rng: sample(tree, rng)


def compile_or_none(pattern: str) -> RegexDfa | None:
    """The DFA, or None when it is refused for matching no text (patterns with [^\\d\\D])."""
    try:
        return compile_regex(pattern)
    except ValueError as e:
        # Nested repeats can, rarely, draw a DFA past a budget: no example, and no flake.
        assume("simplify it" not in str(e))
        assert "matches no text" in str(e), (pattern, e)
        return None


def near_misses(text: str, data) -> list[str]:
    i = data.draw(st.integers(0, len(text)))
    ch = data.draw(st.sampled_from(TEXT_CHARS))
    return [text[:i] + ch + text[i:], text[:i] + text[i + 1:], text + ch]


@settings(max_examples=120, deadline=None)
@given(st.data())
def test_agrees_with_python_re(data):
    pattern, matching = data.draw(patterns(1))
    if not py_compiles(pattern):
        with pytest.raises(ValueError):
            compile_regex(pattern)
        return
    built = matching(data.draw(st.randoms(use_true_random=False)))
    texts = [built, *near_misses(built, data), data.draw(st.text(TEXT_CHARS, max_size=8))]
    dfa = compile_or_none(pattern)
    if dfa is None:  # refused as matching nothing: re must match none of them either
        assert not any(py_fullmatch(pattern, text) for text in texts), pattern
        return
    # The parser refuses by the size it predicts, so the prediction must be the built size.
    assert len(build_nfa(parse(pattern)).target) == parse(pattern).size + 1  # + accepting
    for text in texts:
        expected = py_fullmatch(pattern, text)
        assert dfa.fullmatch(text) == expected, (pattern, text)
        if expected:  # no prefix of a match is a dead end, and stepping agrees with walking
            state = dfa.start
            for ch in text:
                assert state != DEAD, (pattern, text)
                assert dfa.walk(state, ch) == dfa.step(state, ch)
                state = dfa.step(state, ch)
            assert dfa.is_accepting(state)


def representatives(pattern: str) -> list[str]:
    """One character from each run of code points that every NFA edge treats alike."""
    nfa = build_nfa(parse(pattern))  # its ranges cover every distinction, whatever the DFA's
    cuts = {0}
    for los, his in zip(nfa.los, nfa.his):
        cuts.update(los)
        cuts.update(hi + 1 for hi in his if hi < MAX_CODE_POINT)
    return [chr(c) for c in sorted(cuts)]


def reaches_acceptance(dfa: RegexDfa, state: int, alphabet: list[str]) -> bool:
    seen, frontier = {state}, [state]
    while frontier:
        s = frontier.pop()
        if dfa.is_accepting(s):
            return True
        for ch in alphabet:
            t = dfa.step(s, ch)
            if t != DEAD and t not in seen:
                seen.add(t)
                frontier.append(t)
    return False


@settings(max_examples=80, deadline=None)
@given(patterns(2))
def test_every_reached_state_is_live(drawn):
    pattern = drawn[0]
    dfa = compile_or_none(pattern) if py_compiles(pattern) else None
    if dfa is None:
        return
    alphabet = representatives(pattern)
    seen, frontier = {dfa.start}, [dfa.start]
    while frontier and len(seen) < 60:
        s = frontier.pop()
        assert reaches_acceptance(dfa, s, alphabet), (pattern, s)
        for ch in alphabet:
            t = dfa.step(s, ch)
            if t != DEAD and t not in seen:
                seen.add(t)
                frontier.append(t)


def test_branches_that_cannot_finish_are_trimmed():
    # [^\s\S] matches nothing: the 'b' it follows leads nowhere, so 'b' is DEAD at once.
    dfa = compile_regex(r"a(?:b[^\s\S]|c)*")
    a = dfa.walk(dfa.start, "a")
    assert dfa.is_accepting(a)
    assert dfa.step(a, "b") == DEAD
    assert dfa.step(a, "c") == a
    assert dfa.step(DEAD, "a") == DEAD and dfa.walk(DEAD, "") == DEAD
    assert not dfa.is_accepting(DEAD)
    assert dfa.walk(dfa.start, "acbc") == DEAD  # and walk stops at the first dead character


REALISTIC = [
    (r'"([^"\\]|\\.)*"', ['""', '"abc"', r'"a\"b"', r'"\\"', '"é😀"'],
     ['"', '"a', r'"\"', '"a"b"', 'abc']),
    (r"-?(0|[1-9]\d*)", ["0", "-0", "7", "-120", "99999"], ["", "-", "01", "1.5", "--1", "٣"]),
    (r"[\w.+-]+@[\w-]+(\.[\w-]+)+", ["a.b+c@ex-ample.co.uk", "x@y.z"],
     ["@x.y", "a@b", "a@b.", "é@x.y", "a b@x.y"]),
    (r"\d{4}-\d{2}-\d{2}", ["2024-01-31", "0000-00-00"],
     ["2024-1-31", "2024-01-311", "abcd-01-01"]),
    (r"(?P<year>\d{4})-(?P<month>0[1-9]|1[0-2])", ["2024-12", "1999-01"], ["2024-13", "2024-00"]),
    (r"[\u4e00-\u9fff]+(、[\u4e00-\u9fff]+)*", ["你好", "你好、世界"], ["你好、", "hello", "你a"]),
    (r"(😀|🎉)+ [^\n]*", ["😀🎉 party! 🚀", "🎉 "], ["😀", "🚀 x", "😀 a\nb"]),
    (r"\U0001F600{2,3}", ["😀😀", "😀😀😀"], ["😀", "😀😀😀😀"]),
    (r"(yes|no|maybe)", ["yes", "no", "maybe"], ["", "y", "yesno"]),
    (r"a{x}b{}c{1,", ["a{x}b{}c{1,"], ["ac"]),
    (r"^\s*\{\s*\"name\"\s*:\s*\"[^\"]{1,20}\"\s*\}$", ['{"name": "Ann"}', ' { "name":"x" }'],
     ['{"name": ""}', '{"name": "Ann"']),
    (".*", ["", "anything 😀 at all"], ["two\nlines"]),
    ("", [""], ["a"]),
    ("a|", ["a", ""], ["b"]),
    (r"[]a-]+[^]]", ["]-ab", "a-é"], ["]]", "a]"]),
    (r"^ab|c$|\Ad\Z|e", ["ab", "c", "d", "e"], ["abc", "", "cd", "ab\n"]),
    (r"\x41\u00e9\0\01\t[\b]", ["Aé\0\1\t\b"], ["Aé\0\1\t"]),
]


@pytest.mark.parametrize("pattern,good,bad", REALISTIC)
def test_realistic_patterns(pattern, good, bad):
    dfa = compile_regex(pattern)
    for text in good:
        assert py_fullmatch(pattern, text), (pattern, text)  # the table itself is right
        assert dfa.fullmatch(text), (pattern, text)
    for text in bad:
        assert not py_fullmatch(pattern, text), (pattern, text)
        assert not dfa.fullmatch(text), (pattern, text)


CATEGORIES = [r"\d", r"\D", r"\w", r"\W", r"\s", r"\S", ".", r"[^\w\s]", r"[\d\s-]"]
SOME_CHARS = [chr(c) for c in range(128)] + ["é", "ß", "٣", "\u00a0", "\u2028", "😀",
                                             "\U0010ffff"]


@pytest.mark.parametrize("pattern", CATEGORIES)
def test_categories_have_their_ascii_meanings(pattern):
    dfa = compile_regex(pattern)
    for ch in SOME_CHARS:
        assert dfa.fullmatch(ch) == py_fullmatch(pattern, ch), (pattern, ch)


def test_compiled_automata_are_cached_whole_and_shared():
    assert compile_regex(r"\d+x") is compile_regex(r"\d+x")
    pattern = r"(a|b)*a(a|b){6}"  # exponential: a state per choice of which of the last 7 are a
    dfa = RegexDfa(build_nfa(parse(pattern)))  # a fresh one, outside the cache
    assert dfa.num_states == 2 ** 7  # all made at once, before any step
    texts = [format(i * 2654435761 % 4096, "012b").replace("0", "a").replace("1", "b")
             for i in range(300)]
    results: list[list[bool]] = []

    def run():
        results.append([dfa.fullmatch(t) for t in texts])

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expected = [py_fullmatch(pattern, t) for t in texts]
    assert len(results) == 4 and all(r == expected for r in results)
    assert dfa.num_states == 2 ** 7  # stepping makes nothing


REFUSED = [
    (r"(a)\1", "backreference"), (r"(?P<x>a)(?P=x)", "backreference"),
    ("(?=a)a", "lookahead"), ("(?!a)b", "lookahead"), ("(?<=a)b", "lookbehind"),
    ("(?<!a)b", "lookbehind"), ("(?i)a", "inline flags"), ("(?i:a)", "inline flags"),
    ("a(?s)", "inline flags"), (r"\bfoo", "word boundary"), (r"a\B", "word boundary"),
    ("(?>a)", "atomic"), ("a*+", "possessive"), ("a++", "possessive"), ("a?+", "possessive"),
    ("a{2}+", "possessive"), ("(a)(?(1)b|c)", "conditional"), ("(?#note)a", "comment"),
    ("a^", "anchor ^"), ("(^a)", "anchor ^"), ("(?:a|^b)", "anchor ^"), ("a|b$c", "anchor $"), ("a$b", "anchor $"), ("(a$)", "anchor $"),
    (r"a\Ab", r"anchor \A"), (r"\Za", r"anchor \Z"), ("*a", "nothing to repeat"),
    ("a|*b", "nothing to repeat"), ("(+a)", "nothing to repeat"), ("^*", "nothing to repeat"),
    ("{2}", "nothing to repeat"), ("a**", "after another"), ("a{2}{3}", "after another"),
    ("a*??", "after another"), ("(a", "never closed"), ("a)", "without a '('"),
    ("[a", "unterminated"), ("[]", "unterminated"), ("[a\\", "unterminated"),
    ("[z-a]", "backwards"), (r"[a-\d]", "class at one end"), (r"[\w-z]", "class at one end"),
    (r"\q", r"escape \q"), (r"\N{DIGIT ONE}", r"escape \N"), ("ab\\", "lone backslash"),
    (r"\x4", "hex digits"), (r"\u12g4", "hex digits"), (r"\U00110000", "past the last"),
    (r"[\9]", r"escape \9"), (r"[\777]", "octal"), ("a{3,2}", "minimum over its maximum"),
    ("(?P<1a>x)", "group name"), ("(?P<a", "group name"), ("(?P<a>x)(?P<a>y)", "two groups"),
    ("(?<n>x)", "unknown group extension"), ("(?", "unknown group extension"),
    (r"[^\s\S]", "matches no text"), (r"a[^\d\D]b", "matches no text"),
]


@pytest.mark.parametrize("pattern,message", REFUSED)
def test_unsupported_or_invalid_patterns_are_refused(pattern, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        compile_regex(pattern)


def test_limits():
    # Long in text, few in states: as a schema's regex is.
    wide = "[" + string.ascii_letters + string.digits + "]"
    longest = wide * (MAX_PATTERN_LENGTH // len(wide)) + "b" * (MAX_PATTERN_LENGTH % len(wide))
    assert len(longest) == MAX_PATTERN_LENGTH and compile_regex(longest).fullmatch(
        "x" * (MAX_PATTERN_LENGTH // len(wide)) + "b" * (MAX_PATTERN_LENGTH % len(wide)))
    with pytest.raises(ValueError, match="characters long"):
        compile_regex(longest + "b")
    assert compile_regex(f"a{{{MAX_REPEAT}}}").fullmatch("a" * MAX_REPEAT)
    over = MAX_REPEAT + 1
    for pattern in (f"a{{{over}}}", f"a{{0,{over}}}", f"a{{{over},}}"):
        with pytest.raises(ValueError, match="over the limit"):
            compile_regex(pattern)
    # Refused by the parser, from the size the tree would expand to: no NFA state is made.
    for huge in ("(a{1000}){1000}", "((a{100}){100}){100}", "(?:[ab]{1000}){51}",
                 "(x{1000}|y{1000}){26}", "(a{0,1000}){50}", "a{1000}" * 51, "(a+b{999}){50}"):
        with pytest.raises(ValueError, match="too large"):
            parse(huge)
    with pytest.raises(ValueError, match="too large"):
        compile_regex("(a{1000}){1000}")
    exact = f"(?:a{{1000}}){{{MAX_NFA_STATES // 1000}}}"  # exactly the limit: accepted
    assert compile_regex(exact).fullmatch("a" * MAX_NFA_STATES)
    nested = "(" * MAX_NESTING + "a" + ")" * MAX_NESTING
    assert compile_regex(nested).fullmatch("a")
    with pytest.raises(ValueError, match="nested"):
        compile_regex("(" + nested + ")")
    with pytest.raises(ValueError, match="string"):
        compile_regex(None)


def reachable(dfa: RegexDfa, alphabet: list[str], most: int) -> list[int]:
    seen, frontier = [dfa.start], [dfa.start]
    while frontier and len(seen) < most:
        for ch in alphabet:
            t = dfa.step(frontier[0], ch)
            if t != DEAD and t not in seen and len(seen) < most:
                seen.append(t)
                frontier.append(t)
        frontier.pop(0)
    return seen


@pytest.mark.parametrize("pattern", [r"[a-c]x|\u00e9y|[^\x00-\u3000]z", r"(\d|[\u4e00-\u9fff])+",
                                     ".", r'"(?:[^"\\\x00-\x1f]|\\u[0-9a-f]{4}|é\d)*"'])
def test_accepts_some_says_whether_any_character_in_a_span_goes_on(pattern):
    dfa = compile_regex(pattern)
    rng = random.Random(3)
    for state in reachable(dfa, representatives(pattern), 6):
        for _ in range(25):
            lo = rng.choice([0, 0x22, 0x61, 0xE0, 0x2FFF, 0x3000, 0x4DFF, 0x9FFF, 0x10FFFE,
                             rng.randrange(0x110000)])
            hi = min(0x10FFFF, lo + rng.choice([0, 1, 3, 64, 4096]))
            want = any(dfa.step(state, chr(c)) != DEAD for c in range(lo, hi + 1))
            assert dfa.accepts_some(state, lo, hi) == want, (state, lo, hi)
    assert not dfa.accepts_some(DEAD, 0, 0x10FFFF)


# --- the whole automaton: its size and its budgets ---

STATE_COUNTS = [
    ("a{5}", 6),  # after 0 to 5 a's
    ("a*", 1), ("", 1), ("a|b", 2), ("(ab)*", 2), ("[ab]{0,3}", 4), ("(?:a?){3}", 4),
    (r"\d{3}-\d{4}", 9), (r"a[^\s\S]|b", 2),  # the branch that cannot finish makes no state
    (".*a.{3}", 16),  # which of the last four characters were a
    ("(a|b)*a(a|b){9}", 2 ** 10),
]


@pytest.mark.parametrize("pattern,states", STATE_COUNTS)
def test_state_counts(pattern, states):
    assert compile_regex(pattern).num_states == states


# (a|b)*a(a|b){500} needs a state per set of a's among the last 501 characters, .*a.{300}
# one per set of a's among the last 301.
@pytest.mark.parametrize("pattern", ["(a|b)*a(a|b){500}", ".*a.{300}"])
def test_exponential_patterns_are_refused_by_the_budgets(pattern):
    with pytest.raises(ValueError, match=f"more than {MAX_DFA_STATES} states; simplify it"):
        compile_regex(pattern)


def test_patterns_just_under_the_budgets_compile_and_just_over_are_refused():
    # Exactly MAX_DFA_STATES states (as many as the NFA has character states, plus one).
    exact = f"(?:a{{1000}}){{{MAX_NFA_STATES // 1000}}}"
    assert compile_regex(exact).num_states == MAX_DFA_STATES
    # a{0,1400} the long way: the k-th state holds the 1400 - k optional a's still ahead,
    # which takes 98.5% of MAX_BUILD_STEPS; 20 more a's pass it.
    assert compile_regex("(?:a?){1000}(?:a?){400}").num_states == 1401
    with pytest.raises(ValueError, match=f"more than {MAX_BUILD_STEPS} steps; simplify it"):
        compile_regex("(?:a?){1000}(?:a?){420}")


def test_the_budgets_admit_exactly_what_fits_and_stop_the_build_there(monkeypatch):
    nfa = build_nfa(parse("(a|b)*a(a|b){6}"))
    steps = regex_dfa._Determinizer(nfa).steps
    monkeypatch.setattr(regex_dfa, "MAX_DFA_STATES", 2 ** 7)
    monkeypatch.setattr(regex_dfa, "MAX_BUILD_STEPS", steps)
    # Not the automata and refusals of other tests.
    monkeypatch.setattr(regex_dfa, "_AUTOMATA", CompileCache(kept=1, refused=1))
    assert RegexDfa(nfa).num_states == 2 ** 7
    with pytest.raises(ValueError, match="more than 128 states"):
        compile_regex("(a|b)*a(a|b){500}")  # would not finish: refused at state 129
    with pytest.raises(ValueError, match=f"more than {steps} steps"):
        compile_regex("[" + "".join(chr(0x4E00 + 2 * i) for i in range(3000)) + "]{1000}")
    monkeypatch.setattr(regex_dfa, "MAX_BUILD_STEPS", steps - 1)
    with pytest.raises(ValueError, match=f"more than {steps - 1} steps"):
        RegexDfa(nfa)
    monkeypatch.setattr(regex_dfa, "MAX_BUILD_STEPS", steps)
    monkeypatch.setattr(regex_dfa, "MAX_DFA_STATES", 2 ** 7 - 1)
    with pytest.raises(ValueError, match="more than 127 states"):
        RegexDfa(nfa)


SCHEMA_TEXTS = ["{}", "[]", "null", "1", '"x"', '{"a": 1}', '[1, [2, {"b": null}]]',
                '{"id": 1, "name": "Ann", "addresses": []}', '{"kind": "cat", "lives": 9}']


@pytest.mark.parametrize("name", [*SCHEMAS, "string_1000"])
def test_every_schema_regex_of_guided_json_compiles_within_the_budgets(name):
    schema = SCHEMAS.get(name, {"type": "string", "maxLength": 1000})
    pattern = schema_to_regex(schema)
    dfa = compile_regex(pattern)
    for text in SCHEMA_TEXTS + [json.dumps("é" * 1000), json.dumps("é" * 1001)]:
        assert dfa.fullmatch(text) == py_fullmatch(pattern, text), (name, text)


def test_a_refused_pattern_is_refused_again_from_memory(monkeypatch):
    from engine import regex_dfa

    pattern = "(a|b)*a(a|b){500}"
    with pytest.raises(ValueError, match="simplify it") as first:
        compile_regex(pattern)
    # Not built again: the budget is not even reached a second time.
    monkeypatch.setattr(regex_dfa, "build_nfa", lambda tree: pytest.fail("built again"))
    with pytest.raises(ValueError) as again:
        compile_regex(pattern)
    assert str(again.value) == str(first.value)


def test_top_level_alternatives_carry_their_own_anchors():
    alts = parse_alternatives("^a|(b|c)|d$|\\Ae\\Z|f\\$|g\\\\$")
    assert [(a.starts, a.ends) for a in alts] == [(True, False), (False, False), (False, True),
                                                  (True, True), (False, False), (False, True)]
    assert [a.node for a in alts[:2]] == [parse("a"), parse("b|c")]
    assert [a.node for a in alts[4:]] == [parse("f\\$"), parse("g\\\\")]
    assert parse_alternatives("") == [Alternative(parse(""), False, False)]
