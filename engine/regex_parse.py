"""The regular-expression parser behind ``engine.regex_dfa``: pattern text to a small syntax tree.

The syntax is a subset of Python ``re`` (see ``engine/regex_dfa.py`` for the whole list), parsed
the way ``re`` parses it, so that where both accept a pattern they mean the same language. The
pattern comes from API clients, so everything else is refused with a ValueError that names the
construct and its position, and the work is bounded before anything large is built: the
pattern's length, each repeat count, the depth of group nesting, and the number of NFA states
the tree will expand to. Every node knows that state count (``size``), computed from its
children as it is made, so ``(a{1000}){1000}`` is refused when its outer repeat is parsed,
before a single state exists.

Characters are code points; a character set is a sorted tuple of disjoint, non-adjacent
inclusive ``(lo, hi)`` ranges, so a negated class is a handful of ranges, not a million members.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# A client's guided_regex is bounded at 16384 characters where sampling params are built; a
# schema's regex is long in text and small in states (one JSON string character is a class
# of ~150 characters), so for it the NFA and DFA budgets are what bind.
MAX_PATTERN_LENGTH = 200_000
MAX_REPEAT = 1000
MAX_NFA_STATES = 50_000
MAX_NESTING = 100  # group depth; the parser and the NFA builder recurse once per level

MAX_CODE_POINT = 0x10FFFF
Ranges = tuple[tuple[int, int], ...]


def normalize(ranges) -> Ranges:
    """Sorted, merged (overlapping or adjacent) ranges."""
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((lo, hi) for lo, hi in out)


def negate(ranges: Ranges) -> Ranges:
    """Every code point not in the (normalized) ``ranges``."""
    out, nxt = [], 0
    for lo, hi in ranges:
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= MAX_CODE_POINT:
        out.append((nxt, MAX_CODE_POINT))
    return tuple(out)


# re.ASCII meanings: the engine's oracle is re.fullmatch(pattern, text, re.ASCII).
_DIGIT: Ranges = ((48, 57),)
_WORD: Ranges = ((48, 57), (65, 90), (95, 95), (97, 122))
_SPACE: Ranges = ((9, 13), (32, 32))  # \t \n \v \f \r and space
CATEGORIES: dict[str, Ranges] = {
    "d": _DIGIT, "D": negate(_DIGIT), "w": _WORD, "W": negate(_WORD),
    "s": _SPACE, "S": negate(_SPACE),
}
ANY_BUT_NEWLINE: Ranges = ((0, 9), (11, MAX_CODE_POINT))
_SIMPLE_ESCAPES = {"a": 7, "f": 12, "n": 10, "r": 13, "t": 9, "v": 11}
_HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}
_OCT = "01234567"


@dataclass
class Chars:
    """One character from ``ranges``."""
    ranges: Ranges
    size: int = field(init=False, default=1)


@dataclass
class Concat:
    items: tuple
    size: int = field(init=False)

    def __post_init__(self):
        self.size = sum(item.size for item in self.items)


@dataclass
class Alt:
    items: tuple
    size: int = field(init=False)

    def __post_init__(self):
        self.size = 1 + sum(item.size for item in self.items)


@dataclass
class Repeat:
    """``item`` between ``lo`` and ``hi`` times (``hi`` None: unbounded)."""
    item: object
    lo: int
    hi: int | None
    size: int = field(init=False)

    def __post_init__(self):
        # What engine/regex_dfa.py builds: lo copies then (hi - lo) optional ones, each behind a
        # branch state; unbounded, the last copy loops back through one branch state.
        s = self.item.size
        if self.hi is None:
            self.size = s * max(self.lo, 1) + 1
        else:
            self.size = s * self.lo + (s + 1) * (self.hi - self.lo)


Node = Chars | Concat | Alt | Repeat


@dataclass(frozen=True)
class Alternative:
    """One top-level alternative of a pattern, and whether an anchor (``^``/``\\A``,
    ``$``/``\\Z``) tied it to the start and to the end of the text."""
    node: Node
    starts: bool
    ends: bool


def parse(pattern: str) -> Node:
    """The syntax tree of ``pattern``; ValueError when it is invalid, unsupported or too large."""
    return _parser(pattern).parse()


def parse_alternatives(pattern: str) -> list[Alternative]:
    """``pattern``'s top-level alternatives, each with its anchors: under fullmatch anchors
    change nothing, but a search (JSON Schema's ``pattern``) leaves an unanchored end open."""
    parser = _parser(pattern)
    parser.parse()
    return [Alternative(node, *anchors) for node, anchors in zip(parser.top_branches,
                                                                parser.top_anchors)]


def text_lengths(node: Node) -> tuple[int, int | None]:
    """The shortest and longest text ``node`` matches, in characters (None: no longest)."""
    if isinstance(node, Chars):
        return 1, 1
    if isinstance(node, Repeat):
        lo, hi = text_lengths(node.item)
        top = None if hi is None or node.hi is None else hi * node.hi
        return lo * node.lo, (0 if node.hi == 0 else top)
    spans = [text_lengths(item) for item in node.items]
    his = [hi for _, hi in spans]
    if isinstance(node, Alt):
        return min(lo for lo, _ in spans), None if None in his else max(his)
    return sum(lo for lo, _ in spans), None if None in his else sum(his)


def _parser(pattern: str) -> _Parser:
    if not isinstance(pattern, str):
        raise ValueError(f"the regex must be a string, not {type(pattern).__name__}")
    if len(pattern) > MAX_PATTERN_LENGTH:
        raise ValueError(f"the regex is {len(pattern)} characters long; at most "
                         f"{MAX_PATTERN_LENGTH} are allowed")
    return _Parser(pattern)


class _Parser:
    def __init__(self, text: str):
        self.text = text
        self.pos = 0
        self.depth = 0
        self.branch_start = 0  # where the top-level alternative being read began
        self.top_branches: list[Node] = []
        self.top_anchors: list[list[bool]] = [[False, False]]  # (starts, ends) per alternative
        self.names: set[str] = set()

    def error(self, what: str, pos: int | None = None) -> ValueError:
        return ValueError(f"bad regex at position {self.pos if pos is None else pos}: {what}")

    def peek(self) -> str:
        return self.text[self.pos:self.pos + 1]

    def sized(self, node: Node) -> Node:
        if node.size > MAX_NFA_STATES:
            raise ValueError(f"the regex is too large: with its counted repeats expanded it "
                             f"needs over {MAX_NFA_STATES} automaton states")
        return node

    def parse(self) -> Node:
        node = self.alternation()
        if self.pos < len(self.text):  # only a ')' stops the top-level alternation early
            raise self.error("')' without a '('")
        return node

    def alternation(self) -> Node:
        branches = [self.sequence()]
        while self.peek() == "|":
            self.pos += 1
            if self.depth == 0:
                self.branch_start = self.pos
                self.top_anchors.append([False, False])
            branches.append(self.sequence())
        if self.depth == 0:
            self.top_branches = branches
        return branches[0] if len(branches) == 1 else self.sized(Alt(tuple(branches)))

    def sequence(self) -> Node:
        items = []
        while self.pos < len(self.text) and self.peek() not in "|)":
            if self.quantifier_here() is not None:  # a quantifier with no atom before it
                raise self.error("a quantifier with nothing to repeat")
            atom = self.atom()
            if atom is not None:  # None: an accepted anchor, which matches no character
                items.append(self.quantified(atom))
        return items[0] if len(items) == 1 else self.sized(Concat(tuple(items)))

    def quantifier_here(self) -> tuple[int, int | None, int] | None:
        """(lo, hi, end) of the quantifier at pos, or None. Like ``re``, a ``{`` that does not
        open a well-formed ``{n}``, ``{n,}``, ``{,m}`` or ``{n,m}`` is a literal ``{``."""
        ch, pos, text = self.peek(), self.pos, self.text
        if ch in ("*", "+", "?"):
            return {"*": (0, None), "+": (1, None), "?": (0, 1)}[ch] + (pos + 1,)
        if ch != "{":
            return None
        end = pos + 1
        while end < len(text) and "0" <= text[end] <= "9":
            end += 1
        lo_text, hi_text, comma = text[pos + 1:end], None, text[end:end + 1] == ","
        if comma:
            hi_end = end + 1
            while hi_end < len(text) and "0" <= text[hi_end] <= "9":
                hi_end += 1
            hi_text, end = text[end + 1:hi_end], hi_end
        if text[end:end + 1] != "}" or not (lo_text or comma):
            return None
        lo = int(lo_text) if lo_text else 0
        hi = lo if not comma else int(hi_text) if hi_text else None
        if max(lo, hi or 0) > MAX_REPEAT:
            raise self.error(f"repeat count {max(lo, hi or 0)} is over the limit of {MAX_REPEAT}")
        if hi is not None and hi < lo:
            raise self.error(f"repeat {{{lo},{hi}}} has its minimum over its maximum")
        return lo, hi, end + 1

    def quantified(self, atom: Node) -> Node:
        q = self.quantifier_here()
        if q is None:
            return atom
        lo, hi, self.pos = q
        if self.peek() == "?":  # lazy: under fullmatch, the same language as greedy
            self.pos += 1
        elif self.peek() == "+":
            raise self.error("possessive quantifiers (*+, ++, ?+, {n}+) are not supported")
        if self.quantifier_here() is not None:
            raise self.error("a quantifier right after another (like a** or a{2}{3})")
        return self.sized(Repeat(atom, lo, hi))

    def atom(self) -> Node | None:
        ch, start = self.peek(), self.pos
        if ch == "(":
            return self.group()
        if ch == "[":
            return Chars(self.char_class())
        self.pos += 1
        if ch == ".":
            return Chars(ANY_BUT_NEWLINE)
        if ch == "^" or ch == "$":
            return self.anchor(ch, start)
        if ch == "\\":
            return self.escape(start)
        return Chars(((ord(ch), ord(ch)),))

    def anchor(self, name: str, start: int) -> None:
        # Under fullmatch, an anchor at the very start or end of a top-level alternative is a
        # no-op (each alternative spans the whole text; a trailing $ may match before a final
        # newline, but fullmatch must still reach the end, so the newline would need matching
        # too). Anywhere else it would need real zero-width assertions.
        if name in ("^", "\\A") and start == self.branch_start:
            self.top_anchors[-1][0] = True
            return None
        if name in ("$", "\\Z") and (self.pos == len(self.text)
                                      or (self.depth == 0 and self.peek() == "|")):
            self.top_anchors[-1][1] = True
            return None
        where = "start" if name in ("^", "\\A") else "end"
        raise self.error(f"anchor {name} is only supported at the very {where} of the pattern "
                         "or of an alternative outside groups", start)

    def escape(self, start: int) -> Node | None:
        if self.pos >= len(self.text):
            raise self.error("a lone backslash at the end", start)
        c = self.text[self.pos]
        self.pos += 1
        if c in "AZ":
            return self.anchor("\\" + c, start)
        if c in "bB":
            raise self.error(f"word boundary \\{c} is not supported", start)
        if c in "123456789":
            raise self.error(f"backreference \\{c} is not supported (write a character by "
                             f"its code, like \\x41)", start)
        if c in CATEGORIES:
            return Chars(CATEGORIES[c])
        cp = self.char_escape(c, start, in_class=False)
        return Chars(((cp, cp),))

    def char_escape(self, c: str, start: int, in_class: bool) -> int:
        """The code point of the escape ``\\c...`` (c already read) that is one character."""
        if c in _SIMPLE_ESCAPES:
            return _SIMPLE_ESCAPES[c]
        if c == "b" and in_class:  # as in re: backspace inside a class
            return 8
        if c in _HEX_ESCAPES:
            digits = self.take(_HEX_ESCAPES[c], "0123456789abcdefABCDEF")
            if len(digits) != _HEX_ESCAPES[c]:
                raise self.error(f"escape \\{c} needs {_HEX_ESCAPES[c]} hex digits", start)
            if int(digits, 16) > MAX_CODE_POINT:
                raise self.error(f"escape \\{c}{digits} is past the last code point", start)
            return int(digits, 16)
        if c == "0" or (in_class and c in _OCT):  # octal, up to three digits in all, as in re
            value = int(c + self.take(2, _OCT), 8)
            if value > 0o377:
                raise self.error(f"octal escape {self.text[start:self.pos]} is over \\377", start)
            return value
        if c.isascii() and c.isalnum():
            raise self.error(f"unknown or unsupported escape \\{c}", start)
        return ord(c)  # an escaped punctuation (or non-ASCII) character is itself

    def take(self, most: int, allowed: str) -> str:
        end = self.pos
        while end < len(self.text) and end - self.pos < most and self.text[end] in allowed:
            end += 1
        taken, self.pos = self.text[self.pos:end], end
        return taken

    def char_class(self) -> Ranges:
        start, text = self.pos, self.text
        self.pos += 1
        negated = self.peek() == "^"
        self.pos += negated
        members: list[tuple[int, int]] = []
        first = True
        while True:
            if self.pos >= len(text):
                raise self.error("unterminated character class", start)
            if text[self.pos] == "]" and not first:  # as in re, a leading ] is a member
                self.pos += 1
                break
            first = False
            item_start = self.pos
            lo = self.class_item()
            if self.peek() != "-" or text[self.pos + 1:self.pos + 2] in ("]", ""):
                members.extend(lo)
                continue
            self.pos += 1  # the range's '-'
            hi = self.class_item()
            bad = text[item_start:self.pos]
            if len(lo) != 1 or lo[0][0] != lo[0][1] or len(hi) != 1 or hi[0][0] != hi[0][1]:
                raise self.error(f"range {bad} has a class at one end", item_start)
            if hi[0][0] < lo[0][0]:
                raise self.error(f"range {bad} runs backwards", item_start)
            members.append((lo[0][0], hi[0][0]))
        ranges = normalize(members)
        return negate(ranges) if negated else ranges

    def class_item(self) -> Ranges:
        """One member of a class: a character or a \\d-style category, as ranges."""
        start = self.pos
        ch = self.text[self.pos]
        self.pos += 1
        if ch != "\\":
            return ((ord(ch), ord(ch)),)
        if self.pos >= len(self.text):
            raise self.error("unterminated character class", start)
        c = self.text[self.pos]
        self.pos += 1
        if c in CATEGORIES:
            return CATEGORIES[c]
        if c in "89":
            raise self.error(f"unknown escape \\{c} in a class", start)
        cp = self.char_escape(c, start, in_class=True)
        return ((cp, cp),)

    def group(self) -> Node:
        start = self.pos
        if self.depth >= MAX_NESTING:
            raise self.error(f"groups nested more than {MAX_NESTING} deep", start)
        self.pos += 1
        if self.peek() == "?":
            self.group_extension(start)
        self.depth += 1
        node = self.alternation()
        self.depth -= 1
        if self.peek() != ")":
            raise self.error("'(' never closed", start)
        self.pos += 1
        return node

    def group_extension(self, start: int) -> None:
        """Read what follows ``(?``: only ``(?:`` and ``(?P<name>`` are supported."""
        text, after = self.text, self.text[self.pos + 1:self.pos + 4]
        if after.startswith(":"):
            self.pos += 2
            return
        if after.startswith("P<"):
            close = text.find(">", self.pos + 3)
            name = text[self.pos + 3:close] if close >= 0 else ""
            if close < 0 or not name.isidentifier():
                raise self.error("bad group name (expected (?P<name>...))", start)
            if name in self.names:
                raise self.error(f"two groups named {name!r}", start)
            self.names.add(name)
            self.pos = close + 1
            return
        refused = [("P=", "named backreferences (?P=name)"), ("=", "lookaheads (?=...)"),
                   ("!", "negative lookaheads (?!...)"), ("<=", "lookbehinds (?<=...)"),
                   ("<!", "negative lookbehinds (?<!...)"), (">", "atomic groups (?>...)"),
                   ("(", "conditionals (?(...)...)"), ("#", "comments (?#...)")]
        for prefix, what in refused:
            if after.startswith(prefix):
                raise self.error(f"{what} are not supported", start)
        if after[:1] and after[0] in "aiLmsux-":
            raise self.error("inline flags like (?i) are not supported", start)
        raise self.error(f"unknown group extension (?{after[:1]}", start)
