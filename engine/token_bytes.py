"""The bytes each token adds to the output text, for guided decoding (engine/guided_regex.py).

A guide walks every candidate token's text through an automaton, so it needs each token's
own bytes, not ``decode([id])``: a byte-level BPE token may hold half of a multi-byte
character, which decodes alone to U+FFFD. The vocabulary's strings are mapped back to bytes
the way the tokenizer's decoder does:

- byte-level (GPT-2, Llama 3, Qwen): each character of a token string stands for one byte
  through GPT-2's printable byte alphabet;
- SentencePiece-style (Llama 2, Mistral; decoders Metaspace or Replace + ByteFallback):
  ``▁`` is a space and ``<0xHH>`` is the byte HH;
- anything else: the token decoded alone, when that is whole text.

Special tokens (bos, eos, pad, chat markers) give None: guidance never samples them; the
guide adds eos itself where the text may end. The texts are those the engine's detokenizer
renders after a prompt (engine/tokenizer.py), where a SentencePiece word's leading space is
kept, so the guided text is what the client receives.
"""
from __future__ import annotations

import functools
import json

from engine.tokenizer import Tokenizer

_SPIECE_SPACE = "\u2581"


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in for each byte, inverted: character -> byte.

    Printable Latin-1 bytes stand for themselves; the rest (controls, space, ...) take the
    code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def _decoder_kinds(decoder: dict | None) -> set[str]:
    """The decoder types in a tokenizer.json decoder (a Sequence's members included)."""
    if not decoder:
        return set()
    kinds = {decoder.get("type", "")}
    for member in decoder.get("decoders", []) or []:
        kinds |= _decoder_kinds(member)
    return kinds


def _byte_level(token: str) -> bytes | None:
    alphabet = _byte_level_alphabet()
    try:
        return bytes(alphabet[c] for c in token)
    except KeyError:  # not the byte alphabet's: a vocabulary the model does not decode
        return None


def _sentencepiece(token: str) -> bytes:
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        try:
            return bytes([int(token[3:5], 16)])
        except ValueError:
            pass
    return token.replace(_SPIECE_SPACE, " ").encode("utf-8")


def token_byte_strings(tokenizer: Tokenizer) -> list[bytes | None]:
    """Per token id in ``[0, tokenizer.vocab_size)``, the bytes it adds to the text; None for
    special tokens and ids the tokenizer does not spell."""
    backend = tokenizer.backend
    kinds = _decoder_kinds(json.loads(backend.to_str()).get("decoder"))
    if "ByteLevel" in kinds:
        spell = _byte_level
    elif kinds & {"Metaspace", "ByteFallback"}:
        spell = _sentencepiece
    else:
        spell = None
    added = backend.get_added_tokens_decoder()
    special = set(tokenizer.all_special_ids) | {i for i, t in added.items() if t.special}
    out: list[bytes | None] = []
    for i in range(tokenizer.vocab_size):
        token = backend.id_to_token(i)
        if i in special or token is None:
            out.append(None)
        elif i in added:  # written as its text, outside the decoder's alphabet
            out.append(added[i].content.encode("utf-8") or None)
        elif spell is not None:
            out.append(spell(token) or None)
        else:
            text = backend.decode([i], skip_special_tokens=False)
            out.append(text.encode("utf-8") if text and "\ufffd" not in text else None)
    return out
