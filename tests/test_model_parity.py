"""Our model + loader + torch attention against Hugging Face transformers on tiny checkpoints.

Each test builds a tiny HF model from a transformers config class, saves it, loads it with
``engine.loader.load_model`` and compares logits: whole-prompt prefill, chunked prefill over a
cached prefix followed by decodes, and several sequences in one flattened batch.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from engine.loader import load_model
from engine.model_config import ModelConfig
from kernels import get_attention_backend
from tests.paged_batch import PagedBatcher, random_tokens

VOCAB = 512
ATOL = 1e-4
_COMMON = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, vocab_size=VOCAB,
               initializer_range=0.1, max_position_embeddings=256, rms_norm_eps=1e-6)

# name -> (HF model class, config)
MODELS = {
    "llama-gqa": lambda: (LlamaForCausalLM, LlamaConfig(
        **_COMMON, num_attention_heads=4, num_key_value_heads=2)),
    "llama-mqa-tied": lambda: (LlamaForCausalLM, LlamaConfig(
        **_COMMON, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True)),
    "llama3-rope-bias": lambda: (LlamaForCausalLM, LlamaConfig(
        **_COMMON, num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
        mlp_bias=True, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "llama-linear-rope": lambda: (LlamaForCausalLM, LlamaConfig(
        **_COMMON, num_attention_heads=4, num_key_value_heads=4,
        rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "mistral-head-dim": lambda: (MistralForCausalLM, MistralConfig(
        **_COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        sliding_window=None)),
    "qwen2-tied": lambda: (Qwen2ForCausalLM, Qwen2Config(
        **_COMMON, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3": lambda: (Qwen3ForCausalLM, Qwen3Config(
        **_COMMON, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
        tie_word_embeddings=False)),
}


def build_hf(name: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cls, config = MODELS[name]()
    model = cls(config).eval()
    # HF initialises biases to 0 and norms to 1; random values make them count.
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in pname else 0.0))
    return model


def save_hf(model: torch.nn.Module, folder: Path, **kwargs) -> Path:
    model.save_pretrained(folder, **kwargs)
    return folder


@torch.inference_mode()
def hf_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    return hf(torch.tensor([tokens])).logits[0].float()  # [len, vocab]


def load(folder: Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    model = load_model(folder, dtype, device, get_attention_backend("torch", device))
    return model, ModelConfig.from_pretrained(folder)


@pytest.mark.parametrize("name", list(MODELS))
def test_prefill_chunked_prefill_and_decode_match_hf(name, tmp_path):
    hf = build_hf(name)
    model, cfg = load(save_hf(hf, tmp_path))
    tokens = random_tokens(40, seed=1)
    expected = hf_logits(hf, tokens)
    assert expected.std() > 0.1  # non-degenerate outputs

    # (1) the whole prompt in one prefill
    whole = PagedBatcher(model, cfg).step([("a", tokens[:36])])
    assert whole.dtype == torch.float32 and whole.shape == (36, VOCAB)
    torch.testing.assert_close(whole, expected[:36], atol=ATOL, rtol=0)

    # (2) two chunks (the second over a cached prefix ending mid-block), then decodes
    batcher = PagedBatcher(model, cfg, seed=1)
    got = [batcher.step([("a", tokens[:21])]), batcher.step([("a", tokens[21:36])])]
    for t in range(36, 40):
        got.append(batcher.step([("a", [tokens[t]])], num_decodes=1))
    torch.testing.assert_close(torch.cat(got), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["llama-gqa", "qwen3"])
def test_several_sequences_in_one_batch(name, tmp_path):
    hf = build_hf(name, seed=2)
    model, cfg = load(save_hf(hf, tmp_path))
    seqs = {"a": random_tokens(30, 3), "b": random_tokens(13, 4), "c": random_tokens(20, 5)}
    expected = {s: hf_logits(hf, toks) for s, toks in seqs.items()}
    batcher = PagedBatcher(model, cfg, seed=2)

    def check(logits, parts):
        offset = 0
        for seq_id, lo, hi in parts:
            torch.testing.assert_close(logits[offset:offset + hi - lo],
                                       expected[seq_id][lo:hi], atol=ATOL, rtol=0)
            offset += hi - lo

    # Step 1: two prompts of different lengths. Step 2: b decodes while a and c prefill.
    check(batcher.step([("a", seqs["a"][:17]), ("b", seqs["b"][:12])]),
          [("a", 0, 17), ("b", 0, 12)])
    check(batcher.step([("b", seqs["b"][12:13]), ("a", seqs["a"][17:29]), ("c", seqs["c"][:19])],
                       num_decodes=1),
          [("b", 12, 13), ("a", 17, 29), ("c", 0, 19)])
    # Step 3: all three decode together.
    check(batcher.step([("a", seqs["a"][29:30]), ("c", seqs["c"][19:20])], num_decodes=2),
          [("a", 29, 30), ("c", 19, 20)])


def test_sharded_checkpoint(tmp_path):
    hf = build_hf("qwen2-tied", seed=3)
    folder = save_hf(hf, tmp_path, max_shard_size="100KB")
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("model-*.safetensors"))) > 1
    model, cfg = load(folder)
    tokens = random_tokens(25, seed=6)
    logits = PagedBatcher(model, cfg).step([("a", tokens)])
    torch.testing.assert_close(logits, hf_logits(hf, tokens), atol=ATOL, rtol=0)


def test_bfloat16_checkpoint_with_float32_compute(tmp_path):
    hf = build_hf("llama-gqa", seed=4)
    save_hf(hf.to(torch.bfloat16), tmp_path)
    # The bf16-rounded weights computed in fp32 (reloaded, so HF's RoPE table is fp32 too).
    hf = type(hf).from_pretrained(tmp_path, dtype=torch.float32).eval()
    model, cfg = load(tmp_path, torch.float32)
    assert cfg.torch_dtype == torch.bfloat16
    assert model.model.embed_tokens.weight.dtype == torch.float32
    tokens = random_tokens(20, seed=7)
    logits = PagedBatcher(model, cfg).step([("a", tokens)])
    torch.testing.assert_close(logits, hf_logits(hf, tokens), atol=ATOL, rtol=0)


def test_bfloat16_compute_is_close(tmp_path):
    hf = build_hf("qwen3", seed=5)
    model, cfg = load(save_hf(hf, tmp_path), torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.bfloat16
    batcher = PagedBatcher(model, cfg)
    assert batcher.kv_cache.dtype == torch.bfloat16
    tokens = random_tokens(20, seed=8)
    logits = batcher.step([("a", tokens)])
    expected = hf_logits(hf, tokens)
    assert logits.dtype == torch.float32
    # bf16 has ~3 significant digits; the argmax mostly agrees.
    assert (logits - expected).abs().max() < 0.1 * expected.abs().max()
    assert (logits.argmax(-1) == expected.argmax(-1)).float().mean() > 0.8


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["llama-gqa", "qwen3"])
def test_cuda_matches_hf(name, tmp_path):
    hf = build_hf(name, seed=9)
    model, cfg = load(save_hf(hf, tmp_path), torch.float32, "cuda")
    tokens = random_tokens(40, seed=12)
    batcher = PagedBatcher(model, cfg)
    got = [batcher.step([("a", tokens[:21]), ("b", tokens[:9])]),
           batcher.step([("b", tokens[9:10]), ("a", tokens[21:40])], num_decodes=1)]
    expected = hf_logits(hf, tokens)
    # TF32 matmuls may be on: a looser bound than on the CPU.
    torch.testing.assert_close(got[0][:21], expected[:21], atol=2e-2, rtol=0)
    torch.testing.assert_close(got[0][21:], expected[:9], atol=2e-2, rtol=0)
    torch.testing.assert_close(got[1][:1], expected[9:10], atol=2e-2, rtol=0)
    torch.testing.assert_close(got[1][1:], expected[21:40], atol=2e-2, rtol=0)


# ---- checkpoint errors ------------------------------------------------------------------


def test_missing_and_unexpected_weights_are_listed(tmp_path):
    folder = save_hf(build_hf("llama-gqa"), tmp_path)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError) as err:
        load(folder)
    message = str(err.value)
    assert "model.layers.1.self_attn.k_proj.weight" in message
    assert "model.layers.0.mlp.extra.weight" in message
    assert str(folder) in message


def test_wrong_weight_shape(tmp_path):
    folder = save_hf(build_hf("llama-gqa"), tmp_path)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 64)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match="up_proj.weight.*shape"):
        load(folder)


def test_no_weights_file(tmp_path):
    save_hf(build_hf("llama-gqa"), tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no weights"):
        load(tmp_path)


def test_corrupt_weights_file(tmp_path):
    save_hf(build_hf("llama-gqa"), tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ValueError, match="cannot read weights file"):
        load(tmp_path)


def test_truncated_weights_file(tmp_path):
    save_hf(build_hf("llama-gqa"), tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(ValueError, match="model.safetensors"):
        load(tmp_path)


def test_index_naming_missing_shard(tmp_path):
    folder = save_hf(build_hf("qwen2-tied"), tmp_path, max_shard_size="100KB")
    next(folder.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(ValueError, match="do not exist"):
        load(folder)
    (folder / "model.safetensors.index.json").write_text("{broken")
    with pytest.raises(ValueError, match="not a valid safetensors index"):
        load(folder)


def test_bind_kv_cache_checks_shape(tmp_path):
    model, cfg = load(save_hf(build_hf("llama-gqa"), tmp_path))
    with pytest.raises(ValueError, match="kv cache shape"):
        model.bind_kv_cache(torch.zeros(4, cfg.num_hidden_layers, 2, 16, 3, cfg.head_dim))
    with pytest.raises(ValueError, match="kv cache shape"):  # the old layer-major order
        model.bind_kv_cache(torch.zeros(cfg.num_hidden_layers, 2, 4, 16,
                                        cfg.num_key_value_heads, cfg.head_dim))


def test_config_round_trip_fields(tmp_path):
    save_hf(build_hf("llama3-rope-bias"), tmp_path)
    cfg = ModelConfig.from_pretrained(tmp_path)
    assert cfg.architecture == "LlamaForCausalLM"
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.rope_theta == 500000.0
    assert cfg.attention_bias and cfg.o_proj_bias and cfg.mlp_bias and not cfg.qk_norm
    raw = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in raw  # transformers 5.x layout
