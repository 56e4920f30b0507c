"""Tokenizer snapshots (engine/tokenizer_snapshot.py): a cached load encodes, decodes and renders
chats exactly as transformers does, skips transformers' imports, and is never used stale."""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.chat_template import chat_prompt_ids
from engine.tokenizer import load_tokenizer
from engine.tokenizer_snapshot import cache_dir, snapshot_key, snapshot_lock
from tests.hf_oracle import hf_tokenizer

PRESETS = ["tiny-llama", "tiny-qwen2", "tiny-qwen3"]
ROOT = Path(__file__).resolve().parent.parent
TEXTS = ["", " ", "Hello world", "  leading spaces, tabs\tand\nnewlines\n\n",
         "café naïve Straße 日本語 こんにちは привет 🚀👩‍💻 🇯🇵",
         "<|begin_of_text|>inside<|end_of_text|> text <|pad|>", "x<|end_of_text|>y",
         "numbers 12345 67.89", "don't STOP me now"]
CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Ünïcödé and <|end_of_text|> in a message?"}]


@pytest.fixture
def empty_cache(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "snapshots"
    monkeypatch.setenv("PDSERVE_TOKENIZER_CACHE", str(folder))
    return folder


@pytest.fixture(scope="module", params=PRESETS)
def pair(request, preset_path, tmp_path_factory):
    """(a tokenizer loaded from its snapshot, transformers' tokenizer) for one preset."""
    path = preset_path(request.param)
    mp = pytest.MonkeyPatch()
    mp.setenv("PDSERVE_TOKENIZER_CACHE", str(tmp_path_factory.mktemp("snapshots")))
    first = load_tokenizer(path)  # transformers loads it; the snapshot is written
    cached = load_tokenizer(path)
    mp.undo()
    assert first.hf is None and cached.hf is None
    return cached, hf_tokenizer(path)


def test_a_cached_load_has_transformers_attributes(pair):
    tok, hf = pair
    assert tok.vocab_size == len(hf)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == \
        (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id)
    assert tok.all_special_ids == hf.all_special_ids
    assert tok.skipped_special_ids == {i for i, t in hf.added_tokens_decoder.items() if t.special}
    assert tok.chat_template == hf.chat_template
    assert tok.special_tokens_map == hf.special_tokens_map


@pytest.mark.parametrize("text", TEXTS)
def test_a_cached_load_encodes_and_decodes_as_transformers(pair, text):
    tok, hf = pair
    ids = tok.encode(text)
    assert ids == hf.encode(text)
    assert tok.encode_plain(text) == hf.encode(text, add_special_tokens=False)
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == \
            hf.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


@settings(max_examples=120, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=60))
def test_random_text_encodes_as_transformers(pair, text):
    tok, hf = pair
    assert tok.encode(text) == hf.encode(text)
    assert tok.encode_plain(text) == hf.encode(text, add_special_tokens=False)


def test_a_cached_load_renders_chats_as_transformers(pair):
    tok, hf = pair
    begun = CHAT + [{"role": "assistant", "content": "It is"}]  # what continuing continues
    for chat, continue_final in ((CHAT, False), (begun, True)):
        want = hf.apply_chat_template(chat, add_generation_prompt=not continue_final,
                                      continue_final_message=continue_final, tokenize=True,
                                      return_dict=False)
        assert chat_prompt_ids(tok, chat, continue_final_message=continue_final) == want


def test_the_first_load_writes_a_snapshot_the_next_one_reads(empty_cache, preset_path, caplog):
    path = preset_path("tiny-llama")
    with caplog.at_level(logging.INFO, logger="engine.tokenizer_snapshot"):
        load_tokenizer(path)
    files = list(empty_cache.glob("*.json"))
    assert [f.stem for f in files] == [snapshot_key(path)]
    assert f"tokenizer snapshot saved to {files[0]}" in caplog.text
    assert files[0].stat().st_mode & 0o777 == 0o644
    assert json.loads(files[0].read_text())["vocab_size"] == 8192
    # The child process loads from the snapshot: transformers (and the torch it pulls in)
    # are never imported.
    code = ("import sys; from engine.tokenizer import load_tokenizer; "
            f"t = load_tokenizer({str(path)!r}); "
            "print(t.encode('hi there'), 'transformers' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PDSERVE_TOKENIZER_CACHE": str(empty_cache)},
                         timeout=120, check=True).stdout.split()
    assert out[-2:] == ["False", "False"]
    assert "".join(out[:-2]) == str(hf_tokenizer(path).encode("hi there")).replace(" ", "")


def test_a_changed_file_is_a_new_key_and_a_fresh_snapshot(empty_cache, preset_path, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(preset_path("tiny-llama"), folder)
    before = load_tokenizer(folder)
    key = snapshot_key(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert snapshot_key(folder) != key
    after = load_tokenizer(folder)
    assert before.chat_template != after.chat_template == config["chat_template"]
    assert len(list(empty_cache.glob("*.json"))) == 2


def test_a_damaged_snapshot_is_replaced(empty_cache, preset_path, caplog):
    path = preset_path("tiny-llama")
    want = load_tokenizer(path).encode("damaged")
    snapshot = empty_cache / f"{snapshot_key(path)}.json"
    snapshot.write_text('{"format": 1, "vocab_size"')
    with caplog.at_level(logging.WARNING, logger="engine.tokenizer_snapshot"):
        assert load_tokenizer(path).encode("damaged") == want
    assert "ignoring the tokenizer snapshot" in caplog.text
    assert json.loads(snapshot.read_text())["vocab_size"] == 8192


def test_a_snapshot_that_does_not_build_is_replaced(empty_cache, preset_path, caplog):
    path = preset_path("tiny-llama")
    want = load_tokenizer(path).encode("damaged")
    snapshot = empty_cache / f"{snapshot_key(path)}.json"
    raw = json.loads(snapshot.read_text())
    snapshot.write_text(json.dumps({**raw, "backend_json": '{"model": 3}'}))
    with caplog.at_level(logging.WARNING, logger="engine.tokenizer"):
        assert load_tokenizer(path).encode("damaged") == want
    assert "ignoring the tokenizer snapshot of" in caplog.text
    assert json.loads(snapshot.read_text())["backend_json"] == raw["backend_json"]


def test_an_unwritable_cache_only_costs_the_snapshot(tmp_path, monkeypatch, preset_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("PDSERVE_TOKENIZER_CACHE", str(blocker / "snapshots"))
    assert cache_dir() == blocker / "snapshots"
    with caplog.at_level(logging.WARNING, logger="engine.tokenizer_snapshot"):
        tok = load_tokenizer(preset_path("tiny-llama"))
    assert tok.encode("still works") == hf_tokenizer(preset_path("tiny-llama")).encode(
        "still works")
    assert "cannot write the tokenizer snapshot" in caplog.text


def test_a_class_that_encodes_its_own_way_keeps_transformers(empty_cache, preset_path,
                                                             monkeypatch):
    from transformers import AutoTokenizer

    path = preset_path("tiny-llama")
    hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)

    class Reversing(type(hf)):
        def encode(self, text, *args, **kwargs):
            return super().encode(text[::-1], *args, **kwargs)

    hf.__class__ = Reversing
    monkeypatch.setattr("engine.tokenizer.load_hf_tokenizer", lambda folder: hf)
    tok = load_tokenizer(path)
    assert tok.hf is hf
    assert tok.encode("abc def") == hf.encode("abc def") != hf_tokenizer(path).encode("abc def")
    assert not empty_cache.exists() or not list(empty_cache.glob("*.json"))


def test_a_backend_that_cannot_be_serialized_keeps_transformers(empty_cache, preset_path,
                                                                monkeypatch):
    from tokenizers.pre_tokenizers import PreTokenizer

    class Words:  # a pre-tokenizer written in Python: tokenizers cannot save it
        def pre_tokenize(self, pretok):
            pretok.split(lambda i, s: s.split(" ", "removed"))

    path = preset_path("tiny-llama")
    hf = hf_tokenizer(path).__class__.from_pretrained(str(path), local_files_only=True)
    hf.backend_tokenizer.pre_tokenizer = PreTokenizer.custom(Words())
    monkeypatch.setattr("engine.tokenizer.load_hf_tokenizer", lambda folder: hf)
    tok = load_tokenizer(path)
    assert tok.hf is hf
    assert tok.encode("one two") == hf.encode("one two")
    assert tok.chat_template == hf.chat_template
    assert not empty_cache.exists() or not list(empty_cache.glob("*.json"))


def test_processes_starting_together_load_through_transformers_once(empty_cache, preset_path):
    # The test holds the lock while two processes start, so both find no snapshot; released,
    # one loads through transformers and writes it, the other waits and reads it.
    path = preset_path("tiny-llama")
    code = ("import sys; from engine.tokenizer import load_tokenizer; "
            f"t = load_tokenizer({str(path)!r}); "
            "print(t.encode('together'), 'transformers' in sys.modules)")
    env = {**os.environ, "PDSERVE_TOKENIZER_CACHE": str(empty_cache)}
    with snapshot_lock(snapshot_key(path)) as held:
        assert held
        procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for _ in range(2)]
        time.sleep(3)  # time to reach the lock; arriving later changes nothing checked below
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    lines = [out.split() for out, _ in outs]
    assert sorted(line[-1] for line in lines) == ["False", "True"]
    want = str(hf_tokenizer(path).encode("together")).replace(" ", "")
    assert all("".join(line[:-1]) == want for line in lines)


def test_a_loader_that_hangs_is_waited_for_only_so_long(empty_cache, preset_path, monkeypatch,
                                                         caplog):
    monkeypatch.setattr("engine.tokenizer_snapshot.LOCK_WAIT_S", 0.3)
    path = preset_path("tiny-llama")
    with snapshot_lock(snapshot_key(path)) as held, \
            caplog.at_level(logging.WARNING, logger="engine.tokenizer_snapshot"):
        assert held
        tok = load_tokenizer(path)
    assert tok.encode("late") == hf_tokenizer(path).encode("late")
    assert "loading it here too" in caplog.text
