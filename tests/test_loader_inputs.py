"""Inputs of a model folder checked against Hugging Face transformers: template files that are
not UTF-8, the layers config.json marks sliding, and a tied head that the checkpoint stores
apart, decided alike on every tensor-parallel rank."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import (AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM,
                          MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)

from engine.chat_template import load_chat_template
from engine.loader import load_model
from engine.model_config import ModelConfig
from engine.parallel_state import TPGroup, tp_group_scope
from engine.tokenizer import load_tokenizer
from kernels import get_attention_backend
from tests.paged_batch import random_tokens
from tests.test_model_checks import edit_weights, hf_model, ours_logits
from tests.test_model_config import write_config
from tests.test_model_parity import ATOL, hf_logits

NOT_UTF8 = b"\xe9t\xe9"  # "été" in Latin-1


# ---- template files that are not UTF-8 ----------------------------------------------------


def test_operator_template_file_not_utf8_is_named(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_bytes(b"{{ '" + NOT_UTF8 + b"' }}")
    with pytest.raises(ValueError, match="is not UTF-8") as e:
        load_chat_template(str(path))
    assert str(path) in str(e.value)


def _break_tokenizer_config(folder: Path) -> None:
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = "{{ 'PLACEHOLDER' }}"
    path.write_bytes(json.dumps(config).encode().replace(b"PLACEHOLDER", NOT_UTF8))


def _write_bad(name: str):
    def write(folder: Path) -> None:
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_bytes(b"{{ '" + NOT_UTF8 + b"' }}")
    return write


@pytest.mark.parametrize("name, breaks", [
    ("chat_template.jinja", _write_bad("chat_template.jinja")),
    ("additional_chat_templates/tool_use.jinja", _write_bad("additional_chat_templates/"
                                                            "tool_use.jinja")),
    ("tokenizer_config.json", _break_tokenizer_config),
], ids=["chat_template.jinja", "additional_chat_templates", "tokenizer_config.json"])
def test_model_template_file_not_utf8_is_named(tmp_path, monkeypatch, preset_path, name,
                                               breaks):
    monkeypatch.setenv("PDSERVE_TOKENIZER_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    shutil.copytree(preset_path("tiny-llama"), folder)
    breaks(folder)
    with pytest.raises(UnicodeDecodeError):  # transformers refuses the folder too
        AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    with pytest.raises(ValueError, match="is not UTF-8") as e:
        load_tokenizer(folder)
    assert str(folder / name) in str(e.value)


# ---- layer_types: sliding layers that never slide are served, the others refused ----------

_FULL = ["full_attention", "full_attention"]
_SLIDING = ["sliding_attention", "sliding_attention"]
_MIXED = ["full_attention", "sliding_attention"]
# The tiny models' max_position_embeddings: a window this long never hides a token.
_POSITIONS = 256
_PROMPT = 40  # longer than the short windows below, so a window would change the logits

# (HF classes, config fields, edits to the saved config.json, whether transformers 5.x runs the
# config itself). It cannot where a layer marked sliding has no window: its mask and cache
# code then fail on the null window, while its attention layers attend in full.
_SERVED = {
    "qwen2-window-off": (Qwen2ForCausalLM, Qwen2Config, dict(
        use_sliding_window=False, layer_types=_SLIDING), {"sliding_window": 8}, False),
    "qwen3-window-off-mixed": (Qwen3ForCausalLM, Qwen3Config, dict(
        use_sliding_window=False, layer_types=_MIXED), {"sliding_window": 8}, False),
    "qwen2-window-as-long-as-the-model": (Qwen2ForCausalLM, Qwen2Config, dict(
        use_sliding_window=True, sliding_window=_POSITIONS, layer_types=_SLIDING), {}, True),
    "qwen3-window-on-no-sliding-layer": (Qwen3ForCausalLM, Qwen3Config, dict(
        use_sliding_window=True, sliding_window=8, layer_types=_FULL), {}, True),
    # AutoModel loads a Mistral config with layer_types as Ministral, which follows them.
    "mistral-no-sliding-layer": (MistralForCausalLM, MistralConfig, dict(
        sliding_window=8, layer_types=_FULL), {}, True),
    "mistral-window-as-long-as-the-model": (MistralForCausalLM, MistralConfig, dict(
        sliding_window=_POSITIONS, layer_types=_SLIDING), {}, True),
    "mistral-null-window": (MistralForCausalLM, MistralConfig, dict(
        sliding_window=None, layer_types=_SLIDING), {}, False),
    "llama-window-as-long-as-the-model": (LlamaForCausalLM, LlamaConfig, dict(
        sliding_window=_POSITIONS, layer_types=_SLIDING), {}, True),
}
_REFUSED = {
    "qwen2-one-sliding-layer": (Qwen2ForCausalLM, Qwen2Config, dict(
        use_sliding_window=True, sliding_window=8, layer_types=_MIXED), "1 of 2 layers"),
    "qwen3-all-sliding": (Qwen3ForCausalLM, Qwen3Config, dict(
        use_sliding_window=True, sliding_window=8, layer_types=_SLIDING), "2 of 2 layers"),
    "mistral-one-sliding-layer": (MistralForCausalLM, MistralConfig, dict(
        sliding_window=8, layer_types=_MIXED), "1 of 2 layers"),
    # LlamaAttention takes no window, but generate's cache keeps only the window's keys on
    # these layers (and vLLM slides them): neither is full attention.
    "llama-sliding-layers": (LlamaForCausalLM, LlamaConfig, dict(
        sliding_window=8, layer_types=_SLIDING), "2 of 2 layers"),
}


def _save(tmp_path: Path, cls, config_cls, fields: dict, edits: dict | None = None):
    hf = hf_model(cls, config_cls, seed=7, max_position_embeddings=_POSITIONS, **fields)
    folder = tmp_path / "m"
    hf.save_pretrained(folder)
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **(edits or {})}))
    return hf, folder


def _full_attention_twin(hf, cls, config_cls, fields: dict):
    """The same weights under a config with no window and no sliding layer."""
    fields = {**fields, "sliding_window": None, "layer_types": None}
    twin = cls(config_cls(**{**hf.config.to_dict(), **fields})).eval()
    twin.load_state_dict(hf.state_dict())
    return twin


@torch.inference_mode()
def _generate_logits(hf, tokens: list[int], prefill: int = 8) -> torch.Tensor:
    """Logits as generate() computes them: a prefill, then one token at a time from the
    cache. [len(tokens) - prefill + 1, vocab], for positions prefill - 1 on."""
    out = hf(torch.tensor([tokens[:prefill]]), use_cache=True)
    rows = [out.logits[0, -1]]
    for token in tokens[prefill:]:
        out = hf(torch.tensor([[token]]), cache=out.cache, use_cache=True)
        rows.append(out.logits[0, -1])
    return torch.stack(rows).float()


def _reloaded(folder: Path):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", list(_SERVED))
def test_layers_marked_sliding_that_attend_in_full_are_served(tmp_path, name):
    cls, config_cls, fields, edits, hf_runs = _SERVED[name]
    hf, folder = _save(tmp_path, cls, config_cls, fields, edits)
    tokens = random_tokens(_PROMPT, seed=8)
    got = ours_logits(folder, tokens)
    want = hf_logits(_full_attention_twin(hf, cls, config_cls, fields), tokens)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    if hf_runs:
        reloaded = _reloaded(folder)
        torch.testing.assert_close(got, hf_logits(reloaded, tokens), atol=ATOL, rtol=0)
        torch.testing.assert_close(_generate_logits(reloaded, tokens), want[7:], atol=ATOL,
                                   rtol=0)


@pytest.mark.parametrize("name", list(_REFUSED))
def test_layers_that_slide_are_refused(tmp_path, name):
    cls, config_cls, fields, layers = _REFUSED[name]
    hf, folder = _save(tmp_path, cls, config_cls, fields)
    tokens = random_tokens(_PROMPT, seed=8)
    # transformers' generate does not attend in full here: serving it in full would be wrong.
    full = hf_logits(_full_attention_twin(hf, cls, config_cls, fields), tokens)
    assert not torch.allclose(_generate_logits(_reloaded(folder), tokens), full[7:],
                              atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="sliding window attention is not supported") as e:
        ModelConfig.from_pretrained(folder)
    assert f"{folder}/config.json" in str(e.value) and layers in str(e.value)


@pytest.mark.parametrize("layer_types, match", [
    (["full_attention"], "'layer_types' has 1 entries for num_hidden_layers=2"),
    (["full_attention", "linear_attention"], "layer type 'linear_attention' is not supported"),
    (["full_attention", 3], "layer type 3 is not supported"),
])
def test_malformed_layer_types(tmp_path, layer_types, match):
    with pytest.raises(ValueError, match=match) as e:
        ModelConfig.from_pretrained(write_config(tmp_path, layer_types=layer_types))
    assert f"{tmp_path}/config.json" in str(e.value)


# ---- a tied head the checkpoint stores apart, under tensor parallelism ---------------------


def _rank_models(folder: Path, dtype: torch.dtype = torch.float32, tp_size: int = 2):
    backend = get_attention_backend("torch", "cpu")
    models = []
    for rank in range(tp_size):
        with tp_group_scope(TPGroup(rank, tp_size)):
            models.append(load_model(folder, dtype, "cpu", backend))
    return models


def _is_tied(model) -> bool:
    return model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("row", [3, 400], ids=["rank-0-slice", "rank-1-slice"])
def test_every_rank_unties_a_head_that_differs_anywhere(tmp_path, row):
    hf_model(tie_word_embeddings=True).save_pretrained(tmp_path)
    head = {}

    def store_head(tensors):
        head["w"] = tensors["model.embed_tokens.weight"].clone()
        head["w"][row] += 1.0  # one row, held by one rank of two
        tensors["lm_head.weight"] = head["w"]

    edit_weights(tmp_path, store_head)
    models = _rank_models(tmp_path)
    assert not any(_is_tied(m) for m in models)
    for rank, m in enumerate(models):  # vocab 512: rank r holds rows [256 r, 256 (r + 1))
        torch.testing.assert_close(m.lm_head.weight, head["w"][256 * rank:256 * (rank + 1)],
                                   atol=0, rtol=0)


def test_every_rank_stays_tied_to_a_head_equal_in_the_compute_dtype(tmp_path):
    hf_model(tie_word_embeddings=True).save_pretrained(tmp_path)
    # Different in float32, equal once both are cast to bfloat16.
    edit_weights(tmp_path, lambda t: t.__setitem__(
        "lm_head.weight", t["model.embed_tokens.weight"].bfloat16().float()))
    assert all(_is_tied(m) for m in _rank_models(tmp_path, torch.bfloat16))
    assert not any(_is_tied(m) for m in _rank_models(tmp_path, torch.float32))
