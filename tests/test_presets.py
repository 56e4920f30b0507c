"""Built-in presets: generated locally, loadable by transformers, deterministic, race-safe."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.presets import PRESETS, default_cache_dir, list_presets, make_model, resolve_model

REPO = Path(__file__).resolve().parent.parent
TINY = ["tiny-llama", "tiny-qwen2", "tiny-qwen3"]
# Parameter counts the presets promise, roughly.
TINY_PARAMS = {"tiny-llama": (30e6, 34e6), "tiny-qwen2": (26e6, 30e6), "tiny-qwen3": (32e6, 36e6)}


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("preset-cache")


@pytest.fixture(scope="session")
def built(cache_dir) -> dict[str, Path]:
    """Each tiny preset generated through resolve_model into a private cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PDSERVE_CACHE_DIR", str(cache_dir))
        return {name: resolve_model(name) for name in TINY}


def file_hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.iterdir()) if p.is_file() and not p.name.startswith(".")}


def test_preset_list():
    assert list_presets() == list(PRESETS)
    assert {*TINY, "qwen3-0.6b-shape"} <= set(list_presets())


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("PDSERVE_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert default_cache_dir() == Path.home() / ".cache" / "pdserve" / "models"


@pytest.mark.parametrize("name", TINY)
def test_tiny_preset_loads_in_transformers(built, name, monkeypatch):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spec, path = PRESETS[name], built[name]
    assert path.name == name
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= {p.name for p in path.iterdir()}
    config = AutoConfig.from_pretrained(path)
    assert config.architectures == [spec.architecture]
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.intermediate_size, config.vocab_size,
            config.max_position_embeddings) == (512, 8, 8, 4, 1408, 8192, 2048)
    assert config.tie_word_embeddings == (name != "tiny-llama")
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert config.bos_token_id == tokenizer.bos_token_id
    assert config.eos_token_id == tokenizer.eos_token_id
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tokenizer.eos_token_id

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    num_params = sum(p.numel() for p in model.parameters())
    low, high = TINY_PARAMS[name]
    assert low <= num_params <= high, num_params
    attn = model.model.layers[0].self_attn
    if name == "tiny-qwen2":
        assert attn.q_proj.bias is not None and attn.q_proj.bias.abs().sum() > 0
    if name == "tiny-qwen3":
        assert attn.q_proj.weight.shape == (8 * 128, 512)
        assert not torch.all(attn.q_norm.weight == 1)

    # Random weights must still give a non-degenerate greedy continuation.
    ids = torch.tensor([tokenizer.encode("Once upon a time")])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                             do_sample=False, eos_token_id=None, pad_token_id=spec.vocab_size - 1)
    new = out[0, ids.shape[1]:].tolist()
    assert len(set(new)) >= 16, new


def test_make_model_is_deterministic(built, tmp_path):
    # Built again in this process, and once in another (by resolve_model above).
    again = make_model("tiny-qwen2", tmp_path / "again")
    assert file_hashes(again) == file_hashes(built["tiny-qwen2"])


def test_resolve_model_reuses_the_cache(built, cache_dir, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(cache_dir))
    before = (built["tiny-llama"] / "model.safetensors").stat().st_ino
    assert resolve_model("tiny-llama") == built["tiny-llama"]
    assert (built["tiny-llama"] / "model.safetensors").stat().st_ino == before
    assert not [p for p in cache_dir.iterdir() if ".tmp-" in p.name]


def test_resolve_model_rebuilds_an_incomplete_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    partial = tmp_path / "tiny-qwen2"
    partial.mkdir()
    (partial / "config.json").write_text("{}")  # e.g. left by an older, interrupted build
    assert resolve_model("tiny-qwen2") == partial
    assert (partial / "model.safetensors").is_file()


def test_resolve_model_existing_folder_as_is(tmp_path):
    assert resolve_model(str(tmp_path)) == tmp_path


def test_unknown_names_list_the_presets(tmp_path):
    with pytest.raises(ValueError, match="no-such-model.*tiny-llama.*qwen3-0.6b-shape"):
        resolve_model("no-such-model")
    with pytest.raises(ValueError, match="no-such-model"):
        resolve_model(str(tmp_path / "no-such-model"))
    with pytest.raises(ValueError, match="unknown preset 'nope'.*tiny-qwen3"):
        make_model("nope", tmp_path / "out")


_RESOLVE = ("import os, sys; from engine.presets import resolve_model; "
            "p = resolve_model('tiny-qwen2'); "
            "print(p, os.stat(p / 'model.safetensors').st_ino)")


# The slow tier (7 s): two processes racing to make one preset in a cold cache (its fcntl
# lock); every cluster start has several processes resolve a preset at once, in a warm one.
@pytest.mark.slow
def test_concurrent_resolve_from_two_processes(tmp_path, built):
    env = {**os.environ, "PDSERVE_CACHE_DIR": str(tmp_path), "TOKENIZERS_PARALLELISM": "false"}
    procs = [subprocess.Popen([sys.executable, "-c", _RESOLVE], cwd=REPO, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err
    lines = {out.strip().splitlines()[-1] for out, _ in results}
    # Same folder and the same file: built once, never replaced under the other process.
    assert len(lines) == 1, lines
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tiny-qwen2.lock", "tiny-qwen2"]
    # And identical to the build made in the test process.
    assert file_hashes(tmp_path / "tiny-qwen2") == file_hashes(built["tiny-qwen2"])


@pytest.mark.slow
def test_qwen3_0_6b_shape(tmp_path):
    from safetensors import safe_open
    from transformers import AutoConfig

    path = make_model("qwen3-0.6b-shape", tmp_path / "q")
    config = AutoConfig.from_pretrained(path)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.head_dim, config.intermediate_size,
            config.vocab_size, config.max_position_embeddings) == \
        (1024, 28, 16, 8, 128, 3072, 151936, 40960)
    assert config.tie_word_embeddings and config.rope_parameters["rope_theta"] == 1e6
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    num_params = 0
    for shard in shards:
        with safe_open(path / shard, framework="pt") as f:
            for key in f.keys():
                t = f.get_slice(key)
                assert t.get_dtype() == "BF16"
                num_params += int(torch.Size(t.get_shape()).numel())
    assert 590e6 <= num_params <= 600e6, num_params
