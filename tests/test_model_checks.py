"""What a checkpoint folder may hold, checked against Hugging Face transformers: stop ids inside
the vocabulary, a tied config whose checkpoint stores its own head, the sliding window a config
implies, which weights file wins, a broken shard index, tokenizer files, chat-template failures
and the engine's own config fields."""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM,
                          Qwen2Config)

from engine.chat_template import chat_prompt_ids
from engine.config import EngineConfig
from engine.model_config import ModelConfig
from engine.setup import resolve_engine
from engine.tokenizer import load_tokenizer
from tests.paged_batch import PagedBatcher, random_tokens
from tests.test_model_config import _DROP, write_config
from tests.test_model_parity import ATOL, hf_logits, load

_SMALL = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, vocab_size=512,
              initializer_range=0.1, max_position_embeddings=256, rms_norm_eps=1e-6,
              num_attention_heads=4, num_key_value_heads=2)


def hf_model(cls=LlamaForCausalLM, config_cls=LlamaConfig, seed: int = 0, **fields):
    torch.manual_seed(seed)
    model = cls(config_cls(**{**_SMALL, **fields})).eval()
    # HF initialises biases to 0 and norms to 1; random values make them count.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    return model


def ours_logits(folder: Path, tokens: list[int]) -> torch.Tensor:
    model, cfg = load(folder)
    return PagedBatcher(model, cfg).step([("a", tokens)])


def hf_reloaded_logits(folder: Path, tokens: list[int]) -> torch.Tensor:
    return hf_logits(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(),
                     tokens)


def edit_weights(folder: Path, edit) -> None:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


# ---- eos ids must lie in the vocabulary -------------------------------------------------


@pytest.mark.parametrize("eos", [512, -1, [2, 9999]])
def test_config_eos_outside_vocab_is_refused(tmp_path, eos):
    with pytest.raises(ValueError, match="eos_token_id .* outside the model's vocabulary") as e:
        ModelConfig.from_pretrained(write_config(tmp_path, eos_token_id=eos))
    assert f"{tmp_path}/config.json" in str(e.value)


@pytest.mark.parametrize("eos", [[2, 600], -3])
def test_generation_config_eos_outside_vocab_is_refused(tmp_path, eos):
    write_config(tmp_path, eos_token_id=2)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    with pytest.raises(ValueError, match="outside the model's vocabulary") as e:
        ModelConfig.from_pretrained(tmp_path)
    assert f"{tmp_path}/generation_config.json" in str(e.value)


def test_eos_at_vocab_edges_is_accepted(tmp_path):
    write_config(tmp_path, eos_token_id=[0, 511])
    assert ModelConfig.from_pretrained(tmp_path).eos_token_ids == [0, 511]


# ---- tie_word_embeddings with a stored lm_head ------------------------------------------


def test_tied_config_with_a_different_stored_head_uses_it_as_hf_does(tmp_path, caplog):
    folder = tmp_path / "m"
    hf_model(tie_word_embeddings=True).save_pretrained(folder)
    edit_weights(folder, lambda t: t.__setitem__(
        "lm_head.weight", torch.randn_like(t["model.embed_tokens.weight"])))
    tokens = random_tokens(30, seed=1)
    with caplog.at_level(logging.WARNING, logger="engine.models.llama"):
        model, cfg = load(folder)
    assert "different lm_head.weight" in caplog.text
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    got = PagedBatcher(model, cfg).step([("a", tokens)])
    torch.testing.assert_close(got, hf_reloaded_logits(folder, tokens), atol=ATOL, rtol=0)


def test_tied_config_with_an_equal_stored_head_stays_tied(tmp_path):
    hf_model(tie_word_embeddings=True).save_pretrained(tmp_path)
    edit_weights(tmp_path, lambda t: t.__setitem__(
        "lm_head.weight", t["model.embed_tokens.weight"].clone()))
    model, _ = load(tmp_path)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_tied_config_with_only_the_head_stored_fills_the_embedding(tmp_path):
    hf_model(tie_word_embeddings=True, seed=3).save_pretrained(tmp_path)
    edit_weights(tmp_path, lambda t: t.__setitem__(
        "lm_head.weight", t.pop("model.embed_tokens.weight")))
    tokens = random_tokens(30, seed=2)
    torch.testing.assert_close(ours_logits(tmp_path, tokens),
                               hf_reloaded_logits(tmp_path, tokens), atol=ATOL, rtol=0)


# ---- sliding window: what transformers' config classes imply ----------------------------


def hf_slides(folder: Path) -> bool:
    """Whether transformers masks some layer of this config with a window shorter than the
    model's positions (Mistral: every layer; Qwen2/3: the layers marked sliding_attention)."""
    config = AutoConfig.from_pretrained(folder)
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return False
    return window is not None and window < config.max_position_embeddings


@pytest.mark.parametrize("fields", [
    dict(model_type="mistral", max_position_embeddings=32768, sliding_window=_DROP),
    dict(model_type="mistral", max_position_embeddings=4096, sliding_window=_DROP),
    dict(model_type="mistral", max_position_embeddings=32768, sliding_window=None),
    dict(model_type="mistral", max_position_embeddings=32768, sliding_window=32768),
    dict(model_type="qwen2", max_position_embeddings=8192, use_sliding_window=True,
         max_window_layers=0),
    dict(model_type="qwen2", max_position_embeddings=8192, use_sliding_window=True,
         sliding_window=64),
    dict(model_type="qwen2", max_position_embeddings=8192, sliding_window=64),
    dict(model_type="qwen3", max_position_embeddings=8192, use_sliding_window=True,
         sliding_window=64, max_window_layers=1),
    dict(model_type="qwen3", max_position_embeddings=8192, use_sliding_window=True,
         sliding_window=64, max_window_layers=2),
], ids=lambda f: ",".join(f"{k}={'absent' if v is _DROP else v}" for k, v in f.items()))
def test_sliding_window_refused_exactly_where_hf_slides(tmp_path, fields):
    # No "architectures": the model type picks the class, for HF and here alike.
    write_config(tmp_path, architectures=_DROP, **fields)
    if hf_slides(tmp_path):
        with pytest.raises(ValueError, match="sliding window attention is not supported"):
            ModelConfig.from_pretrained(tmp_path)
    else:
        ModelConfig.from_pretrained(tmp_path)


def test_llama_ignores_sliding_window_as_hf_does(tmp_path):
    hf = hf_model(sliding_window=4)  # LlamaAttention takes no window: full attention
    hf.save_pretrained(tmp_path)
    tokens = random_tokens(30, seed=4)
    torch.testing.assert_close(ours_logits(tmp_path, tokens), hf_logits(hf, tokens),
                               atol=ATOL, rtol=0)


@pytest.mark.parametrize("window", ["64", True, 0])
def test_malformed_sliding_window(tmp_path, window):
    with pytest.raises(ValueError, match="'sliding_window' must be a positive integer"):
        ModelConfig.from_pretrained(write_config(
            tmp_path, architectures=["MistralForCausalLM"], sliding_window=window))


# ---- which weights files are read ---------------------------------------------------------


def test_single_file_wins_over_an_index_as_in_hf(tmp_path):
    hf_model(seed=5).save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    single = hf_model(seed=6)
    single.save_pretrained(tmp_path / "single")
    (tmp_path / "single" / "model.safetensors").rename(tmp_path / "model.safetensors")
    tokens = random_tokens(30, seed=5)
    got = ours_logits(tmp_path, tokens)
    torch.testing.assert_close(got, hf_reloaded_logits(tmp_path, tokens), atol=ATOL, rtol=0)
    torch.testing.assert_close(got, hf_logits(single, tokens), atol=ATOL, rtol=0)


@pytest.mark.parametrize("shard", [1, ["model-00001-of-00002.safetensors"], "", None,
                                   "../model-00001-of-00002.safetensors", "/etc/hostname",
                                   "sub/model.safetensors", ".."])
def test_index_entries_must_name_a_shard_in_the_folder(tmp_path, shard):
    hf_model().save_pretrained(tmp_path, max_shard_size="100KB")
    index = tmp_path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["lm_head.weight"] = shard
    index.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="weight_map entry 'lm_head.weight' must name a shard "
                                         "file in the model folder") as e:
        load(tmp_path)
    assert str(index) in str(e.value)


# ---- tokenizer files ------------------------------------------------------------------------


def test_vocab_and_merges_only_tokenizer_is_the_engines_too(tmp_path, preset_path):
    from tokenizers import Tokenizer as BackendTokenizer

    Qwen2Config(**{**_SMALL, "vocab_size": 8192}).save_pretrained(tmp_path)
    backend = BackendTokenizer.from_file(str(preset_path("tiny-llama") / "tokenizer.json"))
    backend.model.save(str(tmp_path))  # vocab.json + merges.txt, nothing else
    assert {"vocab.json", "merges.txt"} <= {p.name for p in tmp_path.iterdir()}
    routers = load_tokenizer(tmp_path)
    engines = resolve_engine(EngineConfig(str(tmp_path), device="cpu")).tokenizer
    assert engines is not None
    assert engines.encode("hello world") == routers.encode("hello world")


def test_folder_without_tokenizer_files_has_none(tmp_path):
    write_config(tmp_path)
    assert resolve_engine(EngineConfig(str(tmp_path), device="cpu")).tokenizer is None


# ---- chat-template failures ---------------------------------------------------------------


@pytest.fixture(scope="module")
def tok(preset_path):
    return load_tokenizer(preset_path("tiny-llama"))


@pytest.mark.parametrize("template, kind", [
    ("{{ messages[0]['content'] + 1 }}", "TypeError"),
    ("{{ 1 // 0 }}", "ZeroDivisionError"),
    ("{{ messages|length + 'x' }}", "TypeError"),
])
def test_template_runtime_errors_are_bad_requests(tok, template, kind):
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match=f"chat template failed on the conversation: {kind}"):
        chat_prompt_ids(tok, msgs, chat_template=template)


def test_errors_outside_the_template_stay_errors(tok, monkeypatch):
    def broken_renderer(**kwargs):
        raise TypeError("renderer called wrongly")

    monkeypatch.setattr("engine.chat_template.chat_renderer", lambda: broken_renderer)
    with pytest.raises(TypeError, match="renderer called wrongly"):
        chat_prompt_ids(tok, [{"role": "user", "content": "hi"}], chat_template="{{ 1 }}")


# ---- clear errors for malformed config.json fields ----------------------------------------


@pytest.mark.parametrize("fields, match", [
    ({"rope_scaling": "linear"}, "'rope_scaling' must be an object"),
    ({"rope_scaling": ["linear", 2]}, "'rope_scaling' must be an object"),
    ({"rope_parameters": [1, 2]}, "'rope_parameters' must be an object"),
    ({"num_key_value_heads": True}, "'num_key_value_heads' must be a positive integer"),
    ({"num_key_value_heads": 0}, "'num_key_value_heads' must be a positive integer"),
    ({"num_key_value_heads": "2"}, "'num_key_value_heads' must be a positive integer"),
    ({"layer_types": 5}, "'layer_types' must be a list"),
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True,
      "max_window_layers": "1"}, "'max_window_layers' must be a non-negative integer"),
])
def test_malformed_config_fields(tmp_path, fields, match):
    with pytest.raises(ValueError, match=match) as e:
        ModelConfig.from_pretrained(write_config(tmp_path, **fields))
    assert f"{tmp_path}/config.json" in str(e.value)


def test_absent_or_null_kv_heads_mean_mha(tmp_path):
    assert ModelConfig.from_pretrained(write_config(
        tmp_path / "a", num_key_value_heads=_DROP)).num_key_value_heads == 4
    assert ModelConfig.from_pretrained(write_config(
        tmp_path / "n", num_key_value_heads=None)).num_key_value_heads == 4


# ---- EngineConfig fields --------------------------------------------------------------------


@pytest.mark.parametrize("field, value, match", [
    ("kv_cache_memory_gib", math.inf, "kv_cache_memory_gib must be a finite number"),
    ("kv_cache_memory_gib", math.nan, "kv_cache_memory_gib must be a finite number"),
    ("kv_cache_memory_gib", "1", "kv_cache_memory_gib must be a finite number"),
    ("kv_cache_memory_gib", 0, "kv_cache_memory_gib must be > 0"),
    ("gpu_memory_utilization", "0.9", "gpu_memory_utilization must be a finite number"),
    ("gpu_memory_utilization", True, "gpu_memory_utilization must be a finite number"),
    ("tp_startup_timeout_s", "5", "tp_startup_timeout_s must be a finite number"),
    ("tp_startup_timeout_s", math.inf, "tp_startup_timeout_s must be a finite number"),
    ("tp_idle_ping_interval_s", "5", "tp_idle_ping_interval_s must be a finite number"),
    ("tp_idle_ping_interval_s", None, "tp_idle_ping_interval_s must be a finite number"),
    ("tp_idle_ping_interval_s", -1, r"tp_idle_ping_interval_s must be seconds in \[0, 86400\]"),
    ("tp_idle_ping_interval_s", 1e9, r"tp_idle_ping_interval_s must be seconds in \[0, 86400\]"),
    ("tp_idle_ping_timeout_s", 0, "tp_idle_ping_timeout_s must be > 0"),
    ("tp_idle_ping_timeout_s", math.nan, "tp_idle_ping_timeout_s must be a finite number"),
    ("tp_idle_ping_timeout_s", 1e9, "tp_idle_ping_timeout_s must be at most 86400"),
    ("kv_lease_timeout_s", None, "kv_lease_timeout_s must be a finite number"),
    ("kv_lease_timeout_s", 1e300, "kv_lease_timeout_s must be at most 86400"),
    ("attention_backend", None, "attention_backend must be one of"),
    ("attention_backend", "flash", "attention_backend must be one of"),
    ("kv_transfer_timeout_s", "30", "kv_transfer_timeout_s must be a finite number"),
    ("kv_quarantine_s", None, "kv_quarantine_s must be a finite number"),
    ("kv_quarantine_s", -1, "kv_quarantine_s must be >= 0"),
    ("seed", "x", "seed must be an integer"),
    ("seed", 1.0, "seed must be an integer"),
    ("seed", True, "seed must be an integer"),
    ("seed", 2 ** 64, "seed must be an integer in"),
    ("seed", -(2 ** 63) - 1, "seed must be an integer in"),
    ("device", "meta", "device must be auto, cpu, cuda or cuda:N"),
    ("device", "cuda:x", "device must be auto, cpu, cuda or cuda:N"),
    ("device", "xpu", "device must be auto, cpu, cuda or cuda:N"),
    ("device", None, "device must be auto, cpu, cuda or cuda:N"),
    ("enable_prefix_caching", "false", "enable_prefix_caching must be true or false"),
    ("enforce_eager", 1, "enforce_eager must be true or false"),
    ("detokenize", None, "detokenize must be true or false"),
])
def test_engine_config_refuses(field, value, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig("tiny-llama", **{field: value})


@pytest.mark.parametrize("field, value", [
    ("seed", -1), ("seed", -(2 ** 63)), ("seed", 2 ** 64 - 1), ("device", "cuda:1"),
    ("device", "cpu"), ("kv_cache_memory_gib", 1), ("kv_quarantine_s", 0),
    ("tp_idle_ping_interval_s", 0), ("tp_idle_ping_timeout_s", 0.05),
])
def test_engine_config_accepts(field, value):
    EngineConfig("tiny-llama", **{field: value})
    if field == "seed":
        torch.Generator().manual_seed(value)  # the range is torch's


# ---- checkpoint dtypes --------------------------------------------------------------------


@pytest.mark.parametrize("name,dtype", [("lm_head.weight", torch.int8),
                                        ("model.layers.0.input_layernorm.weight", torch.bool)])
def test_a_weight_that_is_not_floating_point_is_refused(tmp_path, name, dtype):
    """copy_ casts any dtype to the parameter's: an int8 (quantized) or bool tensor of the
    right shape loaded as garbage weights, with no error."""
    hf_model().save_pretrained(tmp_path)
    edit_weights(tmp_path, lambda t: t.__setitem__(name, (t[name] * 100).to(dtype)))
    with pytest.raises(ValueError, match=f"weight {name}: .*dtype {dtype}"):
        load(tmp_path)


def test_the_configs_attention_backends_are_the_kernels():
    from engine import config
    from kernels import BACKENDS

    assert config._ATTENTION_BACKENDS == BACKENDS


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_model_len=1), "max_model_len 1 holds no prompt and an output token"),
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=1), "--max-num-batched-tokens"),
    (dict(block_size=1, num_gpu_blocks=1), "the KV cache holds 1 tokens"),
])
def test_an_engine_that_could_take_no_prompt_is_refused_at_start(kwargs, match):
    """One token of context holds no prompt and its output: such an engine started, and
    refused every request."""
    from engine import LLM

    with pytest.raises(ValueError, match=match):
        LLM("micro-llama", **kwargs)


@pytest.mark.parametrize("kwargs, flag", [
    (dict(num_gpu_blocks=10**9), "--num-gpu-blocks 1000000000"),
    (dict(kv_cache_memory_gib=10**5), "--kv-cache-memory-gib 100000"),
])
def test_a_kv_cache_the_host_cannot_hold_is_refused_before_it_is_allocated(kwargs, flag):
    """torch failed inside the allocation with a traceback (or, mapped lazily, the OOM killer
    ended the process while the cache was zeroed)."""
    from engine import LLM

    # Or, in a container, its cgroup's limit (tests/test_host_memory.py).
    with pytest.raises(ValueError, match=rf"{flag} asks for a KV cache of [0-9.]+ GiB, but "
                                         r"(this host has only|this process's cgroup memory "
                                         r"limit \(.+\) leaves only) [0-9.]+ [MG]iB available"):
        LLM("micro-llama", **kwargs)


def test_a_budget_too_small_for_one_max_model_len_sequence_names_the_least_that_fits():
    """The budget's blocks could not hold one sequence of max_model_len: refused with the
    block count, not the budget a user sets, and `pdserve up` (tests/test_cli.py) could not
    tell either before its workers sized their caches."""
    from engine import LLM

    # micro-llama, float32 on the CPU: 2 layers x (K, V) x 16 tokens x 2 KV heads x 16 x 4 B.
    need = 2048 // 16 * (2 * 2 * 16 * 2 * 16 * 4)
    kw = dict(device="cpu", max_model_len=2048)
    with LLM("micro-llama", kv_cache_memory_gib=need / (1 << 30), **kw) as llm:
        assert (llm.engine.num_blocks, llm.engine.max_model_len) == (128, 2048)
    with pytest.raises(ValueError, match=(
            r"max_model_len \(--max-model-len\) 2048 does not fit --kv-cache-memory-gib "
            r"0.0009: one sequence takes 1.00 MiB per rank \(128 blocks of 16 tokens, 8.0 KiB "
            r"each\); set --kv-cache-memory-gib 0.001 or more, or lower --max-model-len")):
        LLM("micro-llama", kv_cache_memory_gib=0.0009, **kw)


def test_cpu_tp_ranks_caches_share_the_hosts_memory():
    """Every CPU rank allocates its cache in the one host's memory: two of them need twice."""
    from engine.host_memory import available_memory
    from engine.setup import kv_capacity_blocks

    per_block = 1 << 20
    blocks = int(available_memory().nbytes * 0.6) // per_block  # fits once, not twice
    config = EngineConfig(model="micro-llama", num_gpu_blocks=blocks)
    assert kv_capacity_blocks(config, per_block, torch.device("cpu")) == blocks
    with pytest.raises(ValueError, match=r"\(2 TP ranks' caches\), but this "):
        kv_capacity_blocks(config, per_block, torch.device("cpu"), num_ranks_on_host=2)
