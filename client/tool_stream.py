"""A streamed reply that may end in tool calls: the text to show as it arrives, with the calls'
markup held back, and the calls once the reply ends.

The router streams what the model writes, call syntax included. Fed each chunk's text,
``ToolCallStream`` gives back the part that is surely content: in Hermes' and Mistral's
syntaxes, the text before the calls' marker (a tail that may be the marker's beginning waits
for the next chunk); in Llama's JSON and pythonic ones, whose replies are either all calls or
none, the text once its first characters show it is no call. ``finish()`` parses the whole
reply (client/tool_parsers.py): what it held back is shown after all when the calls do not
parse, as the non-streaming parsers make such a reply all content.
"""
from __future__ import annotations

from dataclasses import dataclass

from client.tool_calls import HERMES_OPEN, ParsedReply
from client.tool_parsers import (LLAMA4_START, MISTRAL_CALLS, PYTHON_TAG, check_syntax,
                                 parse_tool_calls)

# Where calls begin: anywhere in the reply, or only at its start (after whitespace).
_ANYWHERE = {"hermes": HERMES_OPEN, "mistral": MISTRAL_CALLS}
_AT_START = {"llama3_json": ("{", PYTHON_TAG), "pythonic": ("[", LLAMA4_START)}


@dataclass(frozen=True)
class StreamedReply:
    rest: str  # content fed but not yet given back: show it after the rest
    reply: ParsedReply  # the whole reply's content and calls


class ToolCallStream:
    """Feed it each chunk's text (``feed``), show what it returns; ``finish()`` at the end."""

    def __init__(self, syntax: str = "hermes") -> None:
        self.syntax = check_syntax(syntax)
        self._text = ""
        self._shown = 0  # characters of _text given back as content
        self._calls_at: int | None = None  # where the calls' markup began
        self._plain = False  # an at-start syntax's reply that showed it has no calls

    def feed(self, delta: str) -> str:
        """The content ``delta`` makes certain (maybe "", maybe text held from before)."""
        if not isinstance(delta, str):
            raise TypeError(f"delta must be a str, got {type(delta).__name__}")
        self._text += delta
        if self._calls_at is not None:
            return ""
        end = self._content_end()
        out, self._shown = self._text[self._shown:end], max(end, self._shown)
        return out

    def _content_end(self) -> int:
        """Where the surely-content text ends now."""
        text = self._text
        if self.syntax in _ANYWHERE:
            marker = _ANYWHERE[self.syntax]
            at = text.find(marker, max(self._shown - len(marker) + 1, 0))
            if at >= 0:
                self._calls_at = at
                return at
            return len(text) - _partial_suffix(text, marker)
        if self._plain:
            return len(text)
        head = text.lstrip()
        if not head:
            return 0
        if any(head.startswith(m) for m in _AT_START[self.syntax]):
            self._calls_at = 0
            return 0
        if any(m.startswith(head) for m in _AT_START[self.syntax]):
            return 0  # may yet be a marker
        self._plain = True
        return len(text)

    def finish(self) -> StreamedReply:
        reply = parse_tool_calls(self._text, self.syntax)
        if reply.tool_calls:
            rest = self._text[self._shown:self._calls_at]
        else:
            rest = self._text[self._shown:]
        self._shown = len(self._text)
        return StreamedReply(rest, reply)


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (held back)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
