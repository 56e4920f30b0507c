"""Builds the presets' byte-level BPE tokenizer locally, with no download.

The tokenizer is trained with the `tokenizers` library on a corpus generated in code from a
fixed seed: seeded random sentences over an embedded English word list, made-up words, numbers,
punctuation and some non-ASCII text (accents, CJK, emoji), so that merged tokens and multi-byte
UTF-8 split across tokens both occur. The byte-level alphabet covers all 256 bytes, so any
string encodes and decodes back losslessly.

Layout of the 8192 ids: 256 byte tokens and the learned merges first, then the three special
tokens at the very end (like real checkpoints, whose special tokens follow the regular vocab):
``<|begin_of_text|>`` (bos), ``<|end_of_text|>`` (eos), ``<|pad|>``.
"""
from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)
# Turns as "### role" headers, each message closed by eos. Written with the special tokens the
# vocabulary already has, so adding it changed no token id. Strict about roles, as real
# templates are, so that a conversation the template refuses is exercised too.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('roles must be system, user or assistant, got ' + message['role']) -}}"
    "{%- elif message['role'] == 'system' and not loop.first -%}"
    "{{- raise_exception('only the first message may be a system message') -}}"
    "{%- endif -%}"
    "{{- '### ' + message['role'] + '\\n' + message['content'] + eos_token + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '### assistant\\n' -}}{%- endif -%}"
)
DEFAULT_VOCAB_SIZE = 8192

_CORPUS_SEED = 20240611
_NUM_SENTENCES = 24000

_WORDS = """
the of and to in a is that for it as was with be by on not he i this are or his from at which
but have an they you were her she there one all we their has been if more when will would who
so no what out up said about into than them can only other time new some could these two may
first then do any like my now over such our man me even most made after also did many before
must through back years where much your way well down should because each just those people
how too little state good very make world still own see men work long get here between both
life being under never day same another know while last might us great old year off come
since against go came right used take three himself few house use during without again place
around however home small found thought went say part once general high upon school every
don does got united left number course war until always away something fact though water less
public put think almost hand enough far took head yet government system better set told
nothing night end why called didn eyes find going look asked later knew point next city
business give group toward young let room president side social given present several order
national possible rather second face per among form important often things looked early white
case john become large big need four within felt along children saw best church ever least
power development light thought family interest want members others mind country area done
model token server request cache prefill decode batch queue stream latency block memory
kernel tensor layer attention engine router worker client proxy sample greedy prompt output
""".split()

_NON_ASCII = """
café naïve résumé über Straße façade crème brûlée jalapeño piñata coöperate niño señor
déjà vu Zürich Ångström smörgåsbord fiancée São Paulo Kraków Dvořák
日本語 東京 中文 汉字 你好 世界 こんにちは ありがとう カタカナ 한국어 안녕하세요
привет мир Москва спасибо Ελληνικά καλημέρα שלום עולם مرحبا العالم नमस्ते हिन्दी ไทย
😀 😂 🚀 🎉 👍 ❤️ 🌍 🔥 ✨ 🤖 👩‍💻 🇯🇵 → ← ≤ ≥ ≠ ∞ ∑ π µ ° € £ ¥ © ® ™ … “ ” ‘ ’ — –
""".split()

_SYMBOLS = ["(", ")", "[", "]", "{", "}", "\"", "'", "-", "+", "=", "*", "/", "#", "@", "%",
            "&", "<", ">", ":", ";", "_", "|", "~", "^", "$", "\\", "`", "==", "->", "::", "..."]
_ONSETS = ["", "b", "br", "c", "ch", "d", "dr", "f", "fl", "g", "gr", "h", "j", "k", "l", "m",
           "n", "p", "pl", "qu", "r", "s", "sh", "st", "t", "th", "tr", "v", "w", "y", "z"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ee", "io", "ou", "y"]
_CODAS = ["", "", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "st", "ck", "x"]


@dataclass(frozen=True)
class TokenizerInfo:
    """Ids of the special tokens in the built tokenizer."""

    vocab_size: int
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int


def _pseudo_word(rng: random.Random) -> str:
    n = rng.choice((1, 2, 2, 3, 3, 4))
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(n))


def _number(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.5:
        return str(rng.randint(0, 999))
    if r < 0.8:
        return str(rng.randint(1000, 999_999))
    return f"{rng.randint(0, 99)}.{rng.randint(0, 99):02d}"


def _sentence(rng: random.Random, pseudo_words: list[str]) -> str:
    words = []
    for _ in range(rng.randint(4, 16)):
        r = rng.random()
        if r < 0.55:
            # Squared index: a few words are very common, as in real text.
            w = _WORDS[int(rng.random() ** 2 * len(_WORDS))]
        elif r < 0.80:
            w = rng.choice(pseudo_words)
        elif r < 0.88:
            w = _number(rng)
        elif r < 0.95:
            w = rng.choice(_NON_ASCII)
        else:
            w = rng.choice(_SYMBOLS) + rng.choice(_WORDS) + rng.choice(_SYMBOLS)
        if rng.random() < 0.08:
            w += ","
        words.append(w)
    words[0] = words[0].capitalize()
    text = " ".join(words) + rng.choice(".....!?:")
    return text + rng.choice(("", "", " ", "\n", "\n\n", "\t"))


def generate_corpus(seed: int = _CORPUS_SEED, num_sentences: int = _NUM_SENTENCES) -> list[str]:
    """Deterministic training text: the same list for the same arguments."""
    rng = random.Random(seed)
    pseudo_words = sorted({_pseudo_word(rng) for _ in range(6000)})
    return [_sentence(rng, pseudo_words) for _ in range(num_sentences)]


@functools.lru_cache(maxsize=4)
def _trained_json(vocab_size: int) -> str:
    num_learned = vocab_size - len(SPECIAL_TOKENS)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=num_learned,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(generate_corpus(), trainer)
    if tok.get_vocab_size() != num_learned:
        # The special-token ids below assume the merges fill the vocab exactly.
        raise RuntimeError(f"BPE training produced {tok.get_vocab_size()} tokens, "
                           f"expected {num_learned}; the corpus is too small")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)])
    return tok.to_str(pretty=True)


def build_tokenizer(out_dir: str | Path, vocab_size: int = DEFAULT_VOCAB_SIZE,
                    model_max_length: int = 2048) -> TokenizerInfo:
    """Writes tokenizer.json, tokenizer_config.json and special_tokens_map.json into out_dir.

    The folder then loads with ``transformers.AutoTokenizer.from_pretrained(out_dir)`` offline.
    Encoding adds bos (through the post-processor); the chat template is ``CHAT_TEMPLATE``.
    """
    if vocab_size < 512:
        raise ValueError(f"vocab_size must be >= 512 for a byte-level tokenizer, got {vocab_size}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok_json = _trained_json(vocab_size)
    (out / "tokenizer.json").write_text(tok_json, encoding="utf-8")
    info = _info(Tokenizer.from_str(tok_json))
    specials = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        # Cleanup would rewrite " ." as "." and break incremental detokenization.
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(out / "tokenizer_config.json", config)
    _write_json(out / "special_tokens_map.json", specials)
    return info


def _info(tok: Tokenizer) -> TokenizerInfo:
    return TokenizerInfo(vocab_size=tok.get_vocab_size(with_added_tokens=True),
                         bos_token_id=tok.token_to_id(BOS_TOKEN),
                         eos_token_id=tok.token_to_id(EOS_TOKEN),
                         pad_token_id=tok.token_to_id(PAD_TOKEN))


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n",
                    encoding="utf-8")
