"""``SamplingParams.bad_words`` (vLLM's): words the output must not contain.

A word becomes token sequences (as written, and with a leading space, since most tokenizers
spell a word differently at the start of the text and after a space). A sequence's last token
is banned at a step where the output so far ends with the rest of it, so the sequence can
never be completed; a one-token sequence is banned at every step. Only the output is matched,
as in vLLM: a prompt ending in the first half of a word does not ban its second half.
"""
from __future__ import annotations

from collections.abc import Sequence

from engine.tokenizer import Tokenizer


def tokenize_bad_words(tokenizer: Tokenizer | None, words: Sequence[str]) -> list[list[int]]:
    """The token sequences of ``words``, each spelled both ways, without repeats."""
    if not words:
        return []
    if tokenizer is None:
        raise ValueError("bad_words need a model with a tokenizer")
    seqs: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tokenizer.encode_plain(text)
            if ids and ids not in seqs:
                seqs.append(ids)
    return seqs


def bad_word_bans(seqs: list[list[int]], output_token_ids: Sequence[int]) -> list[int]:
    """The token ids the next sampled token must not be, given the output so far."""
    banned = []
    n = len(output_token_ids)
    for seq in seqs:
        head = len(seq) - 1
        if head == 0 or (n >= head and list(output_token_ids[n - head:]) == seq[:-1]):
            banned.append(seq[-1])
    return banned
