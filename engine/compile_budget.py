"""The work one guided_json schema's compile may do (engine/json_schema_regex.py).

A schema is a client's, and small schemas can ask for exponential work: a ``$ref`` back to
the root from each of 40 ``anyOf`` branches is expanded 40^4 times at a recursion depth of 3,
and each of a thousand properties may hold an enum whose automaton takes a quarter of a
second to build. The router compiles a guide in a pool thread to refuse it before placing the
request, and nothing can stop a thread: the compile has to stop itself. It counts its work in
one unit, an automaton build step (engine/regex_dfa.py), and is refused with ``TooMuchWork``
once that passes ``MAX_COMPILE_STEPS``. Counting, not a clock: the same schema is accepted or
refused on every machine and under any load.
"""
from __future__ import annotations

# About 2 to 2.5 s of one core of the 2-core test machine when spent (the schemas of
# tests/test_compile_budget.py); the largest schemas of the tests compile in ~470 nodes, a
# few per cent of it.
MAX_COMPILE_STEPS = 4_000_000
# A schema node compiled costs about what ~25 automaton build steps do (~13 us against
# ~0.5 us, measured on $refs recursing into each other), plus a step per 64 characters of
# the regex it returns (copied and scanned by the nodes above it).
NODE_STEPS = 25
CHARS_PER_STEP = 64
# A schema read without compiling it (oneOf's checks that its schemas exclude each other).
WALK_STEPS = 5


class TooMuchWork(ValueError):
    """A schema whose compile passes its budget: refused as a whole, never read as a cut
    branch or an unsatisfiable variant to leave out."""


class CompileBudget:
    def __init__(self, limit: int | None = None) -> None:
        limit = MAX_COMPILE_STEPS if limit is None else limit
        if limit < 0:
            raise ValueError(f"a compile budget must be at least 0 steps, not {limit}")
        self.limit = limit
        self.spent = 0

    @property
    def left(self) -> int:
        return max(self.limit - self.spent, 0)

    def spend(self, steps: int, path: str) -> None:
        self.spent += steps
        if self.spent > self.limit:
            self.refuse(path)

    def refuse(self, path: str) -> None:
        self.spent = max(self.spent, self.limit + 1)
        raise TooMuchWork(f"the schema takes more than {self.limit} steps to compile (passed "
                          f"at {path}); simplify it (recursive $refs reached from many "
                          "places, or many enums beside patterns, multiply the work)")

    def enter(self, path: str) -> None:
        """A schema node begun (charged before its work: a node may end in a cut)."""
        self.spend(NODE_STEPS, path)

    def walk(self, path: str) -> None:
        """A schema read by a check that compiles nothing."""
        self.spend(WALK_STEPS, path)

    def produced(self, regex: str, path: str) -> None:
        """A schema node that compiled to ``regex``."""
        self.spend(len(regex) // CHARS_PER_STEP, path)
