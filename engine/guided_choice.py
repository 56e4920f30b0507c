"""``SamplingParams.guided_choice`` (vLLM's guided_choice): the output is one of the given texts.

Each choice becomes its token sequence (as the tokenizer spells the text on its own). At
every step only the tokens that continue some choice the output so far begins may be
sampled, and once the output is a whole choice the model's end-of-sequence token may be too
(and only it, unless a longer choice goes on from there): the request ends with finish reason
"stop" on one of the choices. Unlike vLLM's, which guides by the text through a grammar, one
spelling per choice is followed, so the output is always that choice's tokens, never another
tokenization of the same text. The mask depends on the output alone, so a request that moves
to another engine (its first token sampled by a prefill worker, a migration) goes on there.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.tokenizer import Tokenizer


def tokenize_choices(tokenizer: Tokenizer, choices: Sequence[str]) -> list[list[int]]:
    """The token sequences of ``choices``, each once; ValueError when they cannot guide (the
    model's tokenizer and eos are checked by engine/guides.py)."""
    if not choices:
        return []
    seqs: list[list[int]] = []
    for choice in choices:
        ids = tokenizer.encode_plain(choice)
        if not ids:
            raise ValueError(f"guided_choice {choice!r} has no tokens")
        if ids not in seqs:
            seqs.append(ids)
    return seqs


def check_choice_prefix(seqs: list[list[int]], output_token_ids: Sequence[int]) -> None:
    """ValueError when an output resumed or moved here begins none of the choices."""
    out = list(output_token_ids)
    if seqs and not any(seq[:len(out)] == out for seq in seqs):
        raise ValueError("the output so far begins none of guided_choice's choices")


def allowed_by_choices(seqs: list[list[int]], output_token_ids: Sequence[int],
                       eos_token_ids: Sequence[int]) -> list[int]:
    """The token ids the next sampled token may be, given the output so far."""
    if output_token_ids and output_token_ids[-1] in eos_token_ids:
        # Sampled once the output was a whole choice, yet it went on (min_tokens held the end
        # back): it adds no text, so the choice stays whole, and only eos follows.
        return list(eos_token_ids)
    n = len(output_token_ids)
    out = list(output_token_ids)
    allowed: dict[int, None] = {}
    finished = False
    for seq in seqs:
        if len(seq) < n or seq[:n] != out:
            continue
        if len(seq) == n:
            finished = True
        else:
            allowed[seq[n]] = None
    if finished:
        allowed.update(dict.fromkeys(eos_token_ids))
    return list(allowed)


@dataclass
class ChoiceCursor:
    """A request's guided_choice: the allowed tokens follow from its output alone."""
    seqs: list[list[int]]
    eos_token_ids: list[int]

    def allowed(self, output_token_ids: Sequence[int]) -> list[int]:
        return allowed_by_choices(self.seqs, output_token_ids, self.eos_token_ids)
