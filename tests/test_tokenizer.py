"""The built tokenizer, the Tokenizer wrapper and incremental detokenization."""
from __future__ import annotations

import json

import pytest
from hypothesis import assume, HealthCheck, given, settings
from hypothesis import strategies as st

from engine import tokenizer_builder
from engine.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer
from engine.tokenizer_builder import BOS_TOKEN, CHAT_TEMPLATE, EOS_TOKEN, build_tokenizer

FFFD = "\ufffd"
PROPERTY = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def tok(tok_dir) -> Tokenizer:
    return load_tokenizer(tok_dir)


@pytest.fixture(scope="session")
def hf_tok(tok_dir):
    """transformers' tokenizer for the same folder: the oracle."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)


def stream(tok: Tokenizer, prompt: list[int], output: list[int], stop: list[str] | None = None,
           include: bool = False) -> tuple[list[str], IncrementalDetokenizer]:
    """Feeds output one token at a time the way the engine does; returns the deltas."""
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = []
    for t in output:
        detok.update([t])
        hit = detok.check_stop(stop, include) if stop else None
        deltas.append(detok.take_delta())
        if hit is not None:
            break
    deltas.append(detok.finish())
    return deltas, detok


def byte_token_ids(hf_tok) -> list[int]:
    """Id of the single-byte token for each byte value 0..255 (GPT-2's byte-to-char map)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return hf_tok.convert_tokens_to_ids([chars[b] for b in range(256)])


def split_char(tok: Tokenizer) -> tuple[str, list[int]]:
    """A character the tokenizer spells with several byte tokens."""
    for ch in "龘鱻䨻𠜎𝕏":
        ids = tok.encode(ch)[1:]
        if len(ids) > 1:
            return ch, ids
    raise AssertionError("every candidate character is a single token")


# ---------------------------------------------------------------- the tokenizer itself

def test_special_tokens_and_vocab(tok, hf_tok):
    assert tok.vocab_size == 8192
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (8189, 8190, 8191)
    assert sorted(tok.all_special_ids) == [8189, 8190, 8191]
    assert hf_tok.convert_ids_to_tokens([8189, 8190]) == [BOS_TOKEN, EOS_TOKEN]


@pytest.mark.parametrize("text", [
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces, tabs\tand\nnewlines\n\n",
    "café naïve Straße 日本語 こんにちは привет 🚀👩‍💻 🇯🇵 x",
    "",
])
def test_encode_decode_round_trip(tok, text):
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == BOS_TOKEN + text


@pytest.mark.parametrize("length", [10, 5000])  # both of encode's paths
def test_a_lone_surrogate_is_a_value_error(tok, length):
    """The in-process API takes any str: the tokenizers library raised TypeError for a lone
    surrogate (a crash to a caller catching ValueError for bad input)."""
    with pytest.raises(ValueError, match="not valid Unicode: surrogates not allowed"):
        tok.encode("a" * length + "\ud800")


def test_common_words_are_merged(tok):
    # Trained merges, not bytes: a frequent word is one token, multi-byte text is compressed.
    assert len(tok.encode(" the")) == 2
    text = "the model server decodes a batch of tokens"
    assert len(tok.encode(text)) < len(text.encode()) // 2


def test_ids_outside_the_tokenizer_decode_to_nothing(tok):
    ids = tok.encode("hi there")[1:]
    assert tok.decode([151000] + ids + [8192, -1]) == "hi there"


def test_autotokenizer_loads_the_folder_offline(tok_dir, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf = AutoTokenizer.from_pretrained(str(tok_dir))
    assert hf.bos_token == BOS_TOKEN and hf.eos_token == EOS_TOKEN and hf.pad_token_id == 8191
    assert hf.decode(hf("naïve 日本")["input_ids"], skip_special_tokens=True) == "naïve 日本"
    assert hf.chat_template == CHAT_TEMPLATE


def test_training_is_deterministic(tmp_path, tok_dir):
    tokenizer_builder._trained_json.cache_clear()  # retrain instead of reusing the cache
    build_tokenizer(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / name).read_bytes() == (tok_dir / name).read_bytes(), name


def test_load_tokenizer_errors_name_the_folder(tmp_path, tok_dir):
    missing = tmp_path / "missing"
    with pytest.raises(ValueError, match="missing"):
        load_tokenizer(missing)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no tokenizer files.*empty"):
        load_tokenizer(empty)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{not json")
    (broken / "tokenizer_config.json").write_text((tok_dir / "tokenizer_config.json").read_text())
    with pytest.raises(ValueError, match="broken"):
        load_tokenizer(broken)


# ---------------------------------------------------------------- incremental detokenizer

@PROPERTY
@given(text=st.text(max_size=40))
def test_incremental_matches_full_decode(tok, text):
    # Special-token literals in the text encode to special ids, which decoding skips.
    assume(not any(t in text for t in ("<|", "|>")))
    ids = tok.encode(text)[1:]
    deltas, detok = stream(tok, tok.encode("Q: "), ids)
    assert "".join(deltas) == detok.output_text == tok.decode(ids) == text
    if FFFD not in text:
        assert not any(FFFD in d for d in deltas)


@PROPERTY
@given(ids=st.lists(st.integers(min_value=0, max_value=8300), max_size=40))
def test_arbitrary_ids_stream_a_prefix_of_the_final_text(tok, ids):
    # Random ids (like a random-weight model's) include lone bytes, specials, unknown ids.
    final = tok.decode(ids)
    detok = IncrementalDetokenizer(tok, tok.encode("prompt"))
    emitted = ""
    for t in ids:
        detok.update([t])
        emitted += detok.take_delta()
        assert final.startswith(emitted)
    emitted += detok.finish()
    assert emitted == detok.output_text == final


@PROPERTY
@given(data=st.data())
def test_byte_soup_in_chunks(tok, hf_tok, data):
    # Mostly single-byte tokens, fed in chunks of several tokens (as the decode role does):
    # valid characters, cut characters and invalid bytes all mixed, so long runs end in U+FFFD.
    byte_ids = byte_token_ids(hf_tok)
    lead = st.sampled_from([byte_ids[b] for b in (0xC3, 0xE6, 0xF0, 0xF0, 0x9F)])
    cont = st.sampled_from([byte_ids[b] for b in (0x80, 0x97, 0x98, 0xA5, 0xBF)])
    ids = data.draw(st.lists(st.one_of(lead, cont, cont, st.integers(0, 8191)), max_size=40))
    final = tok.decode(ids)
    detok = IncrementalDetokenizer(tok, tok.encode("prompt"))
    emitted, i = "", 0
    while i < len(ids):
        n = data.draw(st.integers(1, 6))
        detok.update(ids[i:i + n])
        emitted += detok.take_delta()
        assert final.startswith(emitted)
        i += n
    emitted += detok.finish()
    assert emitted == detok.output_text == final


def test_byte_tokens_cover_all_bytes(tok, hf_tok):
    byte_ids = byte_token_ids(hf_tok)
    assert len(set(byte_ids)) == 256
    assert tok.decode(byte_ids[0xE6:0xE7] + byte_ids[0x97:0x98] + byte_ids[0xA5:0xA6]) == "日"


def test_split_character_is_held_until_complete(tok):
    ch, ids = split_char(tok)
    deltas, _ = stream(tok, tok.encode("a"), ids)
    assert deltas == [""] * (len(ids) - 1) + [ch, ""]


def test_unfinished_character_is_flushed_by_finish(tok):
    ch, ids = split_char(tok)
    deltas, detok = stream(tok, tok.encode("a"), tok.encode("ok")[1:] + ids[:-1])
    assert "".join(deltas[:-1]) == "ok"
    assert deltas[-1] == tok.decode(ids[:-1]) and deltas[-1].endswith(FFFD)
    assert detok.output_text == "ok" + deltas[-1]


def test_invalid_bytes_do_not_stall_the_stream(tok):
    # A run of continuation bytes never completes a character: it must not be held forever.
    _, ids = split_char(tok)
    byte_ids = ids[-1:] * 20  # the last piece of a split character: continuation bytes only
    deltas, detok = stream(tok, tok.encode("a"), byte_ids)
    assert "".join(deltas[:-1]), "nothing was released before finish()"
    assert detok.output_text == tok.decode(byte_ids)


def test_prompt_ending_inside_a_character(tok):
    ch, ids = split_char(tok)
    deltas, detok = stream(tok, tok.encode("x")[:1] + ids[:1], ids[1:] + tok.encode(" ok")[1:])
    assert "".join(deltas) == detok.output_text == tok.decode(ids[1:] + tok.encode(" ok")[1:])


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("hi")[1:] + [tok.eos_token_id]
    assert "".join(stream(tok, [tok.bos_token_id], ids)[0]) == "hi"
    detok = IncrementalDetokenizer(tok, [tok.bos_token_id], skip_special_tokens=False)
    detok.update(ids)
    assert detok.finish() == "hi" + EOS_TOKEN


# ---------------------------------------------------------------- stop strings

@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundaries(tok, include):
    text = "Hello world, the model server"
    ids = tok.encode(text)[1:]
    stop = "lo wor"
    # The stop string starts inside one token and ends inside another.
    assert all(stop not in tok.decode([t]) for t in ids)
    deltas, detok = stream(tok, [tok.bos_token_id], ids, stop=[stop], include=include)
    expected = "Hello wor" if include else "Hel"
    assert detok.stop_str == stop
    assert "".join(deltas) == detok.output_text == expected
    assert len(deltas) < len(ids) + 1  # stopped at the token that completed it


@PROPERTY
@given(data=st.data())
def test_deltas_never_pass_a_stop_string(tok, data):
    text = data.draw(st.text(min_size=1, max_size=30))
    # Special-token literals in the text encode to special ids, which decoding skips.
    assume(not any(t in text for t in ("<|", "|>")))
    i = data.draw(st.integers(0, len(text) - 1))
    j = data.draw(st.integers(i + 1, min(len(text), i + 5)))
    stop, include = text[i:j], data.draw(st.booleans())
    start = text.find(stop)
    ids = tok.encode(text)[1:]
    emitted = ""
    detok = IncrementalDetokenizer(tok, [tok.bos_token_id])
    for t in ids:
        detok.update([t])
        hit = detok.check_stop([stop], include)
        emitted += detok.take_delta()
        assert emitted == text[:len(emitted)] and len(emitted) <= start + include * len(stop)
        if hit is not None:
            break
    emitted += detok.finish()
    assert detok.stop_str == stop
    assert emitted == detok.output_text == text[:start + len(stop) if include else start]


def test_partial_stop_at_the_end_is_released_by_finish(tok):
    ids = tok.encode("the end")[1:]
    deltas, detok = stream(tok, [tok.bos_token_id], ids, stop=["end!"])
    assert detok.stop_str is None
    assert "".join(deltas[:-1]) == "the " and deltas[-1] == "end"


def test_earliest_stop_string_wins(tok):
    detok = IncrementalDetokenizer(tok, [tok.bos_token_id])
    detok.update(tok.encode("Hello world")[1:])
    assert detok.check_stop(["world", "llo"], False) == "llo"
    assert detok.finish() == "He"
    with pytest.raises(RuntimeError):
        detok.update([100])


def test_detokenizer_json_config_has_no_cleanup(tok_dir):
    # clean_up_tokenization_spaces would make decode(a + b) != decode(a) + decode(b).
    assert json.loads((tok_dir / "tokenizer_config.json").read_text())[
        "clean_up_tokenization_spaces"] is False


def test_the_held_back_stop_prefix_is_the_longest_by_definition():
    import random

    from engine.tokenizer import _partial_stop_len

    def longest(text, stop):  # every suffix of text against every proper prefix
        return max((n for s in stop for n in range(1, min(len(s) - 1, len(text)) + 1)
                    if text.endswith(s[:n])), default=0)

    rng = random.Random(1)
    for _ in range(20000):
        text = "".join(rng.choice("ab c") for _ in range(rng.randint(0, 12)))
        stop = ["".join(rng.choice("ab c") for _ in range(rng.randint(1, 8)))
                for _ in range(rng.randint(1, 3))]
        assert _partial_stop_len(text, stop) == longest(text, stop), (text, stop)


@pytest.fixture(scope="session")
def byte_fallback_tok(tmp_path_factory) -> Tokenizer:
    """A Llama-2-style tokenizer (SentencePiece spaces, byte fallback, leading space
    stripped), with a handful of words and the 256 byte tokens."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁": 3, "a": 4, "x": 5, "▁a": 6, "▁x": 7,
             "S": 8, "ay": 9, "▁S": 10, "▁Say": 11, "y": 12}
    vocab.update({f"<0x{b:02X}>": 13 + b for b in range(256)})
    merges = [("▁", "x"), ("▁", "a"), ("a", "y"), ("▁", "S"), ("▁S", "ay")]
    backend = Backend(models.BPE(vocab, merges, byte_fallback=True, unk_token="<unk>"))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                               normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    folder = tmp_path_factory.mktemp("byte_fallback")
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
         "unk_token": "<unk>", "clean_up_tokenization_spaces": False}))
    return load_tokenizer(folder)


def test_stray_bytes_after_a_byte_fallback_character_stream_one_fffd_each(byte_fallback_tok):
    # Such a decoder renders a run of byte tokens that is not UTF-8 as a whole as one U+FFFD
    # per token, bytes of characters already streamed included: no prefix of the new text.
    tok = byte_fallback_tok
    byte = {b: 13 + b for b in range(256)}
    ni = [byte[0xE6], byte[0x97], byte[0xA5]]  # "日" in byte tokens
    prompt = tok.encode_plain("Say") + [3] + ni  # 3: "▁"
    assert tok.decode(prompt) == "Say 日"
    assert stream(tok, prompt, [byte[0xE6]])[1].output_text == FFFD  # a character cut short
    deltas, detok = stream(tok, prompt, [byte[0x97], 7])  # a stray byte, then " x"
    assert detok.output_text == FFFD + " x" == tok.decode([byte[0x97], 7])
    # In the output too: "日" stays as streamed; only the bytes after it become U+FFFD.
    deltas, detok = stream(tok, tok.encode_plain("Say"), ni + [byte[0xE6], byte[0x9C]])
    assert detok.output_text == "日" + FFFD * 2 and "".join(deltas) == detok.output_text


def test_a_long_text_is_encoded_without_holding_the_gil(tok, hf_tok):
    """The router tokenizes a large prompt in a worker thread so that its event loop goes on:
    that needs the encode to let go of the GIL, which tokenizers' encode does not do (its
    encode_batch does). Another thread keeps running while a long text is encoded."""
    import threading

    text = "the quick brown fox jumps over the lazy dog, " * 40_000  # 1.8M characters
    ticks, started = [], threading.Event()
    done = threading.Event()

    def other_thread():
        started.set()
        while not done.is_set():
            ticks.append(1)
            threading.Event().wait(0.001)

    thread = threading.Thread(target=other_thread)
    thread.start()
    started.wait()
    before = len(ticks)
    ids = tok.encode_plain(text)
    during = len(ticks) - before
    done.set()
    thread.join()
    assert ids == hf_tok.encode(text, add_special_tokens=False)
    assert during >= 20  # with the GIL held the whole encode long, it ran once at most
