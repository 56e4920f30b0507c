"""How long guided_json schemas take to compile (engine/json_schema_regex.py), with the
compile's memo of recursive $refs and its work budget (engine/compile_budget.py) against
without them, as before: the same schemas, each compile in a child process stopped at
--limit-s. Realistic schemas first, then small ones that asked for exponential work.

    python -m bench.schema_compile [--limit-s S] [--json]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import time

REALISTIC = {
    "order (20 fields, formats)": {
        "type": "object", "required": ["id", "email", "items"],
        "properties": {
            "id": {"type": "string", "format": "uuid"},
            "email": {"type": "string", "format": "email"},
            "placed": {"type": "string", "format": "date-time"},
            "status": {"enum": ["new", "paid", "shipped", "done"]},
            "items": {"type": "array", "maxItems": 20, "items": {
                "type": "object", "required": ["sku", "qty"],
                "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                               "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                               "price": {"type": "number", "multipleOf": 0.01}}}},
            **{f"note_{i}": {"type": "string", "maxLength": 40} for i in range(14)},
            "age": {"type": "integer"}, "guardian": {"type": "string"}},
        "if": {"properties": {"age": {"minimum": 18}}},
        "then": {"properties": {"guardian": False}}},
    "expression tree (recursive)": {
        "$defs": {"Expr": {"anyOf": [
            {"type": "integer"},
            {"type": "object", "required": ["op", "args"],
             "properties": {"op": {"enum": ["+", "*", "-"]},
                            "args": {"type": "array", "maxItems": 3,
                                     "items": {"$ref": "#/$defs/Expr"}}}}]}},
        "$ref": "#/$defs/Expr"},
}


def _all_mutual(n: int) -> dict:
    defs = {f"a{i}": {"anyOf": [{"$ref": f"#/$defs/a{j}"} for j in range(n)] +
                      [{"type": "null"}]} for i in range(n)}
    return {"$defs": defs, "$ref": "#/$defs/a0"}


ADVERSARIAL = {
    "40 anyOf $refs to the root": {"anyOf": [{"$ref": "#"}] * 40 + [{"type": "null"}]},
    "3 $defs each anyOf $refs to all": _all_mutual(3),
    "6 $defs each anyOf $refs to all": _all_mutual(6),
    "oneOf beside allOf of 3 $refs back": {
        "$defs": {"A": {"allOf": [{"$ref": "#/$defs/A"}] * 3}},
        "oneOf": [{"type": "null"}, {"allOf": [{"type": "integer"}, {"$ref": "#/$defs/A"}]}]},
    "40 enums beside distinct patterns": {"type": "object", "properties": {
        f"p{i}": {"type": "string", "pattern": f"^(a|b)*a(a|b){{11}}x{{{i}}}$",
                  "enum": ["a" * 12 + "x" * i]} for i in range(40)}},
}


def _without_guards() -> None:
    """The compiler as before: no memo of recursive $refs or of oneOf's values, no budget."""
    from engine import compile_budget
    from engine import json_schema_regex as jsr

    class Forgetful(dict):
        def __contains__(self, key) -> bool:
            return False

        def __setitem__(self, key, value) -> None:
            pass

    class ForgetValues(dict):
        def get(self, key, default=None):
            return default if key[0] == "values" else super().get(key, default)

    init = jsr._Compiler.__init__

    def unguarded(self, *args):
        init(self, *args)
        self.expansions = Forgetful()
        self.kinds_memo = ForgetValues()
        self.budget = compile_budget.CompileBudget(10 ** 18)
    jsr._Compiler.__init__ = unguarded


def _compile(schema: dict, guarded: bool, out) -> None:
    from engine import json_schema_regex as jsr
    from engine.json_whitespace import Punctuation

    if not guarded:
        _without_guards()
    compiler = jsr._Compiler(schema, Punctuation.around(None))
    t = time.perf_counter()
    try:
        rx = compiler.node(schema, "#", 0)
        outcome = f"regex of {len(rx)} chars"
    except ValueError as e:
        outcome = f"refused: {type(e).__name__}"
    out.send((time.perf_counter() - t, outcome, compiler.budget.spent))


def _timed(schema: dict, guarded: bool, limit_s: float) -> dict:
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_compile, args=(schema, guarded, send))
    proc.start()
    ready = recv.poll(limit_s)
    if not ready:
        proc.kill()
        proc.join()
        return {"seconds": None, "outcome": f"over {limit_s:g} s", "steps": None}
    seconds, outcome, steps = recv.recv()
    proc.join()
    return {"seconds": seconds, "outcome": outcome, "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit-s", type=float, default=30.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    for kind, schemas in (("realistic", REALISTIC), ("adversarial", ADVERSARIAL)):
        for name, schema in schemas.items():
            now = _timed(schema, True, args.limit_s)
            before = _timed(schema, False, args.limit_s)
            rows.append({"kind": kind, "schema": name, "now": now, "before": before})
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'schema':<38} {'now':>9} {'steps':>9}  {'before':>9}  ratio  outcome now")
    for r in rows:
        print(_row(r, args.limit_s))


def _row(r: dict, limit_s: float) -> str:
    """One schema's line: a compile stopped at the limit shows as over it, either side (the
    budget stops the guarded compile first, but not on a host slow enough)."""
    now, before = r["now"], r["before"]

    def shown(t: dict) -> str:
        return f"{t['seconds']:.3f}s" if t["seconds"] is not None else f">{limit_s:g}s"

    if now["seconds"] is None:
        ratio = "?"
    else:
        base = before["seconds"] if before["seconds"] is not None else limit_s
        x = base / max(now["seconds"], 1e-6)
        ratio = ("" if before["seconds"] is not None else ">") + \
            (f"{x:.2f}x" if x < 10 else f"{x:.0f}x")
    steps = now["steps"] if now["steps"] is not None else "-"
    return (f"{r['schema']:<38} {shown(now):>9} {steps:>9}  {shown(before):>9}  {ratio:>6}  "
            f"{now['outcome']}")


if __name__ == "__main__":
    main()
