"""A guided_json compile stops itself (engine/compile_budget.py): small schemas that asked
for exponential work compile in a few node visits (recursive $refs expanded once per
recursion state) or are refused by the budget (counted steps, never a clock), the automata
built while compiling are paid from it, a refusal keeps its type through if/then/else, and a
refused schema sent again is refused without compiling it (engine/compile_cache.py)."""
from __future__ import annotations

import json
import random
import re

import pytest

from engine import compile_budget, guides
from engine import json_one_of as one_of
from engine import json_schema_regex as jsr
from engine.compile_budget import NODE_STEPS, CompileBudget, TooMuchWork
from engine.json_schema_regex import schema_to_regex
from engine.json_whitespace import Punctuation
from engine.compile_cache import CompileCache
from engine.regex_dfa import TooManySteps
from engine.sampling_params import SamplingParams
from tests.test_json_schema_regex import SCHEMAS, bounded_calls


def _self_any_of(k: int) -> dict:
    return {"anyOf": [{"$ref": "#"}] * k + [{"type": "null"}]}


def _all_mutual(n: int) -> dict:
    """n definitions, each an anyOf of $refs to every one: at a depth of 3 a $ref, the
    expansions before the memo numbered about n^(3n)."""
    defs = {f"a{i}": {"anyOf": [{"$ref": f"#/$defs/a{j}"} for j in range(n)] +
                      [{"type": "null"}]} for i in range(n)}
    return {"$defs": defs, "$ref": "#/$defs/a0"}


def _enums_beside_patterns(n: int, repeat: int) -> dict:
    """n members, each an enum beside a pattern whose automaton takes thousands of steps:
    distinct patterns, so none shares another's automaton."""
    return {"type": "object", "properties": {
        f"p{i}": {"type": "string", "pattern": f"^(a|b)*a(a|b){{{repeat}}}x{{{i}}}$",
                  "enum": ["a" * (repeat + 1) + "x" * i]} for i in range(n)}}


def test_a_recursive_ref_met_from_many_branches_is_expanded_once_per_recursion_state(
        monkeypatch):
    # Before the memo: 40^4 expansions, 15 s; now each of its 4 depths once.
    calls = bounded_calls(monkeypatch, jsr._Compiler, "compile_node", limit=2000)
    assert schema_to_regex(_self_any_of(40)) == "null"
    assert len(calls) <= 4 * 42  # an anyOf, its 40 $refs and a null, at each depth
    calls.clear()
    # Mutual recursion (ran for over 20 s): each $ref once per count of each $ref open
    # around it, 1181 nodes. That grows ~8x a definition, and the budget stops the rest.
    assert schema_to_regex(_all_mutual(3)) == "null"
    calls.clear()
    # A $ref with no instance within the depth: its cut is remembered too.
    endless = {"type": "object", "required": ["x"], "properties": {"x": {"$ref": "#/$defs/D"}}}
    assert schema_to_regex({"$defs": {"D": endless},
                            "anyOf": [{"$ref": "#/$defs/D"}] * 40 + [{"type": "null"}]}) == "null"
    assert len(calls) < 60


def test_a_oneofs_check_reads_a_schema_of_allof_refs_back_to_it_once(monkeypatch):
    # Each A is three $refs to A, joined: the check that the oneOf's schemas hold different
    # values walked 3^64 of them before the compile refused the cycle.
    calls = bounded_calls(monkeypatch, one_of, "_values", limit=100)
    schema = {"$defs": {"A": {"allOf": [{"$ref": "#/$defs/A"}] * 3}},
              "oneOf": [{"type": "null"}, {"allOf": [{"type": "integer"}, {"$ref": "#/$defs/A"}]}]}
    with pytest.raises(ValueError, match="'allOf' at #/[$]defs/A/allOf/0 leads back to itself"):
        schema_to_regex(schema)
    assert len(calls) >= 3  # the walk ran (and stopped at the cycle)
    # What a schema's values were found to be is kept for the next oneOf, not forgotten.
    joined = {"allOf": [{"enum": ["a", "b"]}, {"enum": ["b", "c"]}]}
    tagged = {"oneOf": [{"$ref": "#/$defs/T"}, {"const": "a"}]}
    rx = schema_to_regex({"$defs": {"T": joined}, "type": "object",
                          "properties": {"x": tagged, "y": tagged}, "required": ["x", "y"]})
    assert re.fullmatch(rx, '{"x": "b", "y": "a"}') and not re.fullmatch(rx, '{"x": "c", "y": "a"}')


def _without_memo(monkeypatch) -> None:
    class Forgetful(dict):
        def __contains__(self, key) -> bool:
            return False

        def __setitem__(self, key, value) -> None:
            pass

    real = jsr._Compiler.__init__

    def init(self, *args):
        real(self, *args)
        self.expansions = Forgetful()
    monkeypatch.setattr(jsr._Compiler, "__init__", init)


def _outcome(schema) -> str:
    try:
        return "regex " + schema_to_regex(schema)
    except ValueError as e:
        return f"{type(e).__name__}: {e}"


def _random_recursive(rng: random.Random, n: int, depth: int):
    r = rng.random()
    if depth > 2 or r < 0.25:
        return rng.choice([{"$ref": f"#/$defs/d{rng.randrange(n)}"}, {"$ref": "#"},
                           {"type": "integer"}, {"type": "null"}, {"enum": ["a", "b"]}])
    if r < 0.45:
        return {"anyOf": [_random_recursive(rng, n, depth + 1)
                          for _ in range(rng.randint(1, 3))]}
    if r < 0.6:
        props = {f"p{i}": _random_recursive(rng, n, depth + 1)
                 for i in range(rng.randint(1, 3))}
        required = [rng.choice(list(props))] if rng.random() < 0.5 else []
        return {"type": "object", "properties": props, "required": required}
    if r < 0.75:
        return {"type": "array", "items": _random_recursive(rng, n, depth + 1),
                "minItems": rng.randint(0, 1), "maxItems": rng.randint(1, 3)}
    if r < 0.85:
        inner = _random_recursive(rng, n, depth + 1)
        return {**inner, "nullable": True}
    return {"oneOf": [{"type": "string"}, _random_recursive(rng, n, depth + 1)]}


def _recursive_schemas() -> list:
    rng = random.Random(7)
    schemas = []
    for _ in range(150):
        n = rng.randint(1, 4)
        schemas.append({"$defs": {f"d{i}": _random_recursive(rng, n, 0) for i in range(n)},
                        **_random_recursive(rng, n, 0)})
    return schemas + [s for s in SCHEMAS.values()] + [_self_any_of(4), _all_mutual(2)]


def test_the_memo_changes_no_regex_and_no_refusal(monkeypatch):
    schemas = _recursive_schemas()
    remembered = [_outcome(s) for s in schemas]
    assert sum(o.startswith("regex") for o in remembered) > len(schemas) // 2
    assert any("Cut" in o for o in remembered)  # cut recursions are memoized too
    _without_memo(monkeypatch)
    assert [_outcome(s) for s in schemas] == remembered


def test_work_past_the_budget_refuses_the_schema_after_a_bounded_number_of_nodes(monkeypatch):
    calls = bounded_calls(monkeypatch, jsr._Compiler, "compile_node",
                          limit=compile_budget.MAX_COMPILE_STEPS // NODE_STEPS + 2)
    with pytest.raises(TooMuchWork, match=r"more than 4000000 steps to compile \(passed at "):
        schema_to_regex(_all_mutual(6))
    assert len(calls) > 1000  # refused by the budget, not by a limit met on the way


def test_automata_built_while_compiling_are_paid_from_the_budget(monkeypatch):
    schema = _enums_beside_patterns(6, 6)
    compiler = jsr._Compiler(schema, Punctuation.around(None))
    compiler.node(schema, "#", 0)
    built = sum(d.build_steps for d in compiler.automata.values())
    assert len(compiler.automata) == 6 and built > 6 * 1000
    assert compiler.budget.spent > built
    # A budget of what the automata cost refuses the schema at the last one's build: the
    # error is the budget's (TooMuchWork), not the automaton's own limit (TooManySteps).
    monkeypatch.setattr(compile_budget, "MAX_COMPILE_STEPS", built)
    with pytest.raises(TooMuchWork, match=rf"more than {built} steps to compile"):
        schema_to_regex(schema)
    monkeypatch.setattr(compile_budget, "MAX_COMPILE_STEPS", 10 * compiler.budget.spent)
    assert schema_to_regex(schema)
    # The names' automaton of propertyNames, which declared members are matched on.
    named = {"type": "object", "properties": {"ab": {"type": "integer"}},
             "propertyNames": {"pattern": "^(a|b)*a(a|b){6}$"}}
    compiler = jsr._Compiler(named, Punctuation.around(None))
    compiler.node(named, "#", 0)
    [dfa] = compiler.automata.values()
    assert dfa.build_steps > 1000 and compiler.budget.spent > dfa.build_steps


def test_an_automaton_is_built_once_for_every_member_with_the_same_regex(monkeypatch):
    members = {f"p{i}": {"type": "string", "pattern": "^(a|b)*a(a|b){6}$",
                         "enum": ["a" * 7, "c"]} for i in range(20)}
    calls = bounded_calls(monkeypatch, jsr, "RegexDfa", limit=3)
    rx = schema_to_regex({"type": "object", "properties": members, "required": ["p0"]})
    assert len(calls) == 1
    assert re.fullmatch(rx, json.dumps({"p0": "a" * 7, "p3": "a" * 7}))
    assert not re.fullmatch(rx, json.dumps({"p0": "c"}))


def test_an_automaton_past_its_own_limit_is_still_refused_as_the_pattern(monkeypatch):
    monkeypatch.setattr(jsr, "MAX_BUILD_STEPS", 100)  # below what the compile has left
    with pytest.raises(TooManySteps, match="more than 100 steps"):
        schema_to_regex(_enums_beside_patterns(1, 6))


def test_an_if_keeps_the_budget_refusal_as_it_is(monkeypatch):
    monkeypatch.setattr(compile_budget, "MAX_COMPILE_STEPS", 5 * NODE_STEPS)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}},
              "if": {"properties": {"a": {"const": 1}}},
              "then": {"required": ["a"]}}
    with pytest.raises(TooMuchWork, match=rf"more than {5 * NODE_STEPS} steps") as e:
        schema_to_regex(schema)
    assert "'if' at" not in str(e.value)


def test_the_schemas_of_the_tests_use_a_small_part_of_the_budget():
    for name, schema in SCHEMAS.items():
        compiler = jsr._Compiler(schema, Punctuation.around(None))
        compiler.node(schema, "#", 0)
        assert compiler.budget.spent < compile_budget.MAX_COMPILE_STEPS // 50, name


def test_the_budget_refuses_past_its_limit_and_stays_refused():
    budget = CompileBudget(100)
    budget.spend(100, "#")
    assert budget.left == 0
    with pytest.raises(TooMuchWork, match="more than 100 steps to compile .passed at #/x"):
        budget.spend(1, "#/x")
    with pytest.raises(TooMuchWork):
        budget.spend(0, "#/y")
    with pytest.raises(ValueError, match="at least 0 steps"):
        CompileBudget(-1)


def test_a_refused_schema_sent_again_is_refused_without_compiling(monkeypatch):
    monkeypatch.setattr(guides, "_SCHEMAS", CompileCache(kept=64, refused=2))
    calls = bounded_calls(monkeypatch, guides, "schema_to_regex", limit=100)
    bad = [json.dumps({"type": "object", "properties": {"a": {"pattern": "("}}, "title": f"t{i}"})
           for i in range(3)]
    for text in [bad[0], bad[0], bad[1], bad[0]]:
        with pytest.raises(ValueError, match="'pattern' at #/properties/a"):
            guides.check_guide(SamplingParams(guided_json=text))
    assert len(calls) == 2
    for text in [bad[2], bad[0]]:  # two kept: the third refusal pushes the first out
        with pytest.raises(ValueError):
            guides.check_guide(SamplingParams(guided_json=text))
    assert len(calls) == 4
    good = json.dumps({"type": "integer", "minimum": 3})
    for _ in range(2):
        guides.check_guide(SamplingParams(guided_json=good))
    assert len(calls) == 5


def test_a_compile_cache_keeps_results_and_refusals_apart_and_each_to_its_count():
    cache = CompileCache(kept=2, refused=1)
    compiled = []

    def compile_(text):
        compiled.append(text)
        if text.startswith("bad"):
            raise ValueError(f"no {text}")
        return text.upper()

    for text in ["a", "b", "a", "c", "a", "b"]:  # "a" used lately stays; "b" goes for "c"
        assert cache.call(text, lambda: compile_(text)) == text.upper()
    assert compiled == ["a", "b", "c", "b"]
    for text in ["bad1", "bad1", "bad2", "bad1"]:
        with pytest.raises(ValueError, match=f"no {text}"):
            cache.call(text, lambda: compile_(text))
    assert compiled[4:] == ["bad1", "bad2", "bad1"]
    assert (cache.num_results, cache.num_refusals) == (2, 1)
    assert cache.call("a", lambda: compile_("a")) == "A" and compiled[-1] == "bad1"
    with pytest.raises(ValueError, match="at least 1 result and 1 refusal"):
        CompileCache(kept=0, refused=1)
    with pytest.raises(ValueError, match="at least 1 result and 1 refusal"):
        CompileCache(kept=1, refused=0)


def test_the_bench_times_both_compilers_and_stops_a_compile_at_its_limit():
    from bench.schema_compile import ADVERSARIAL, REALISTIC, _row, _timed

    order = REALISTIC["order (20 fields, formats)"]
    now, before = _timed(order, True, 60), _timed(order, False, 60)
    assert now["outcome"] == before["outcome"] and now["outcome"].startswith("regex of")
    assert now["steps"] > 0
    loop = ADVERSARIAL["40 anyOf $refs to the root"]
    assert _timed(loop, False, 0.5) == {"seconds": None, "outcome": "over 0.5 s",
                                        "steps": None}
    assert _timed(loop, True, 60)["outcome"] == "regex of 4 chars"
    # Its table names a compile stopped at the limit on either side, the guarded one too.
    over = {"seconds": None, "outcome": "over 0.5 s", "steps": None}
    done = {"seconds": 0.25, "outcome": "regex of 4 chars", "steps": 9}
    assert ">2.00x" in _row({"schema": "s", "now": done, "before": over}, 0.5)
    line = _row({"schema": "s", "now": over, "before": done}, 0.5)
    assert ">0.5s" in line and "0.250s" in line and "?" in line
