"""ModelConfig parsing: the fields read from config.json and the errors for bad folders."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from engine.loader import load_model
from engine.model_config import ModelConfig
from kernels import get_attention_backend

_SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=128, vocab_size=512)


def write_config(folder: Path, **fields) -> Path:
    base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 128,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
    base.update(fields)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in base.items()
                                                    if v is not _DROP}))
    return folder


_DROP = object()


def test_llama_defaults(tmp_path):
    cfg = ModelConfig.from_pretrained(write_config(tmp_path, eos_token_id=2, bos_token_id=1))
    assert cfg.architecture == "LlamaForCausalLM"
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    assert cfg.rope_theta == 10000.0 and cfg.rope_scaling is None
    assert cfg.eos_token_ids == [2] and cfg.bos_token_id == 1
    assert cfg.torch_dtype == torch.float32
    assert not (cfg.attention_bias or cfg.o_proj_bias or cfg.qk_norm or cfg.tie_word_embeddings)


def test_transformers_5_configs(tmp_path):
    """What transformers 5.x actually writes (rope_parameters, dtype, layer_types)."""
    LlamaConfig(**_SMALL, rope_theta=5e5, eos_token_id=[7, 9], dtype="bfloat16",
                rope_scaling={"rope_type": "linear", "factor": 2.0}).save_pretrained(tmp_path / "l")
    cfg = ModelConfig.from_pretrained(tmp_path / "l")
    assert cfg.rope_theta == 5e5
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert cfg.eos_token_ids == [7, 9] and cfg.torch_dtype == torch.bfloat16

    Qwen2Config(**_SMALL, tie_word_embeddings=True).save_pretrained(tmp_path / "q2")
    q2 = ModelConfig.from_pretrained(tmp_path / "q2")
    assert q2.architecture == "Qwen2ForCausalLM"  # from model_type: no "architectures" saved
    assert q2.attention_bias and not q2.o_proj_bias and q2.tie_word_embeddings

    Qwen3Config(**_SMALL, head_dim=32).save_pretrained(tmp_path / "q3")
    q3 = ModelConfig.from_pretrained(tmp_path / "q3")
    assert q3.qk_norm and q3.head_dim == 32 and not q3.attention_bias

    MistralConfig(**_SMALL, sliding_window=None).save_pretrained(tmp_path / "m")
    assert ModelConfig.from_pretrained(tmp_path / "m").architecture == "MistralForCausalLM"


def test_a_qwen3_config_without_head_dim_means_128_as_in_transformers(tmp_path):
    """Read as hidden_size / heads (16 here), the checkpoint's 128-wide q/k norms failed to
    load with a shape error that named neither head_dim nor its default."""
    from transformers import AutoConfig

    write_config(tmp_path, architectures=["Qwen3ForCausalLM"], model_type="qwen3")
    assert ModelConfig.from_pretrained(tmp_path).head_dim == 128
    assert AutoConfig.from_pretrained(tmp_path).head_dim == 128
    write_config(tmp_path / "llama")  # the others: hidden_size / heads
    assert ModelConfig.from_pretrained(tmp_path / "llama").head_dim == 16


def test_transformers_4_rope_layout(tmp_path):
    cfg = ModelConfig.from_pretrained(write_config(
        tmp_path, rope_theta=500000.0, torch_dtype="float16", eos_token_id=[1, 2],
        rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}))
    assert cfg.rope_theta == 500000.0 and cfg.torch_dtype == torch.float16
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.rope_scaling["factor"] == 8.0


@pytest.mark.parametrize("theta", [None, 5e5])
def test_a_rope_scaling_beside_rope_parameters_wins_as_in_transformers(tmp_path, theta):
    # A 4.x-style edit of a 5.x config.json (to stretch its context): transformers runs the
    # rope_scaling; a default rope_parameters beside it must not hide it.
    LlamaConfig(**_SMALL, rope_theta=7e4).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["rope_parameters"]["rope_type"] == "default"
    raw["rope_scaling"] = {"rope_type": "linear", "factor": 4.0}
    if theta is not None:
        raw["rope_theta"] = theta
    (tmp_path / "config.json").write_text(json.dumps(raw))
    want = AutoConfig.from_pretrained(tmp_path).rope_parameters
    cfg = ModelConfig.from_pretrained(tmp_path)
    assert cfg.rope_scaling == {"rope_type": want["rope_type"], "factor": want["factor"]}
    assert cfg.rope_theta == want["rope_theta"]

    raw["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}  # unsupported: refused, not run
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="rope scaling type 'yarn'"):
        ModelConfig.from_pretrained(tmp_path)


def test_generation_config_eos_ids_are_added(tmp_path):
    write_config(tmp_path, eos_token_id=5)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))
    assert ModelConfig.from_pretrained(tmp_path).eos_token_ids == [5, 6]


@pytest.mark.parametrize("fields, match", [
    ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture"),
    ({"architectures": _DROP, "model_type": "gpt2"}, "unsupported model_type"),
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ({"hidden_size": "64"}, "'hidden_size' must be a positive integer"),
    ({"vocab_size": _DROP}, "'vocab_size'"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling type 'yarn'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "lacks low_freq_factor"),
    ({"rope_theta": "big"}, "rope_theta"),
    ({"eos_token_id": "x"}, "eos_token_id"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 64},
     "sliding window attention is not supported"),
    # Layer 1 slides: transformers' default max_window_layers (28) would leave both layers full.
    ({"architectures": ["Qwen2ForCausalLM"], "sliding_window": 64, "use_sliding_window": True,
      "max_window_layers": 1}, "sliding window attention is not supported"),
])
def test_bad_config_fields(tmp_path, fields, match):
    with pytest.raises(ValueError, match=match) as err:
        ModelConfig.from_pretrained(write_config(tmp_path, **fields))
    assert str(tmp_path) in str(err.value)


def test_sliding_window_that_never_slides_is_accepted(tmp_path):
    # Mistral with a window as long as the model, and Qwen with the window switched off.
    write_config(tmp_path / "m", architectures=["MistralForCausalLM"], sliding_window=128)
    write_config(tmp_path / "q", architectures=["Qwen2ForCausalLM"], sliding_window=64,
                 use_sliding_window=False)
    assert ModelConfig.from_pretrained(tmp_path / "m").architecture == "MistralForCausalLM"
    assert ModelConfig.from_pretrained(tmp_path / "q").architecture == "Qwen2ForCausalLM"


def test_missing_folder(tmp_path):
    with pytest.raises(ValueError, match="does not exist") as err:
        ModelConfig.from_pretrained(tmp_path / "nope")
    assert "nope" in str(err.value)


def test_missing_config_json(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        ModelConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", ""])
def test_broken_config_json(tmp_path, text):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match="config.json"):
        ModelConfig.from_pretrained(tmp_path)


def test_load_model_without_weights(tmp_path):
    write_config(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="no weights.*pytorch_model.bin") as err:
        load_model(tmp_path, torch.float32, "cpu", get_attention_backend())
    assert str(tmp_path) in str(err.value)
