"""Model hyper-parameters parsed from a Hugging Face checkpoint folder's ``config.json``.

Parsed by hand (no transformers import) so the engine only depends on the json format. Both the
4.x layout (``rope_theta`` + ``rope_scaling``) and the 5.x layout (``rope_parameters``) are read.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.generation_defaults import read_generation_config, read_json_object

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
# Configs saved without a model (``config.save_pretrained``) carry no "architectures" list.
_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# config.json's dtype names -> torch's (the router reads configs too, and never loads torch).
_DTYPES = {
    "float32": "float32",
    "float": "float32",
    "float16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
}
# rope types whose cos/sin table can be precomputed once for all positions.
_SUPPORTED_ROPE_TYPES = ("llama3", "linear")
_QWEN3_HEAD_DIM = 128
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                     "original_max_position_embeddings")
# transformers' config defaults where config.json has no "sliding_window" key. LlamaConfig has
# none: Llama's window only counts on layers "layer_types" marks sliding (_sliding_window).
_DEFAULT_SLIDING_WINDOW = {
    "MistralForCausalLM": 4096,
    "Qwen2ForCausalLM": 4096,
    "Qwen3ForCausalLM": 4096,
}
# Architectures whose window applies only with "use_sliding_window" set.
_USE_SLIDING_WINDOW_FLAG = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
# Qwen2Config/Qwen3Config's default: layers from this index on use the window.
_DEFAULT_MAX_WINDOW_LAYERS = 28
# The entries of config.json's "layer_types" this decoder serves.
_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class ModelConfig:
    folder: str
    architecture: str
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    # None for plain RoPE; else {"rope_type": "llama3" | "linear", "factor": ..., ...}.
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    # Bias on q/k/v projections (Qwen2 always; Llama/Qwen3 via ``attention_bias``).
    attention_bias: bool
    # Bias on o_proj (Llama/Qwen3 ``attention_bias``; never for Qwen2).
    o_proj_bias: bool
    mlp_bias: bool
    # Per-head RMSNorm on q and k before RoPE (Qwen3).
    qk_norm: bool
    hidden_act: str
    # Dtype the checkpoint was saved in: "float32", "float16" or "bfloat16".
    dtype: str
    bos_token_id: int | None
    eos_token_ids: list[int] = field(default_factory=list)

    @property
    def torch_dtype(self):
        """``dtype`` as a torch.dtype (imports torch: not for the router's side)."""
        import torch

        return getattr(torch, self.dtype)

    def compute_dtype(self, requested: str, device_type: str) -> str:
        """The dtype an engine of this model computes and keeps its KV cache in on a
        ``device_type`` ("cpu" or "cuda") device: ``requested``, or for "auto" float32 on the
        CPU (its bf16/fp16 matmuls are slow and less exact) and the checkpoint's on CUDA,
        bfloat16 for a float32 one. Torch-free: `pdserve up` sizes caches with it."""
        if requested != "auto":
            return requested
        if device_type == "cpu":
            return "float32"
        return "bfloat16" if self.dtype == "float32" else self.dtype

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def check_tensor_parallel(self, tp: int) -> None:
        """Refuses a TP size the model's heads cannot be split over (no torch: ``pdserve up``
        checks it before it starts anything)."""
        if self.num_attention_heads % tp:
            raise ValueError(f"tensor_parallel_size {tp} does not divide the model's "
                             f"{self.num_attention_heads} attention heads")
        kv = self.num_key_value_heads
        if (tp % kv) if tp >= kv else (kv % tp):  # kv_head_range cannot split (or copy) them
            raise ValueError(f"tensor_parallel_size {tp} does not divide the model's {kv} "
                             f"num_key_value_heads, nor is it a multiple of them")
        if self.intermediate_size % tp:
            raise ValueError(f"tensor_parallel_size {tp} does not divide the model's "
                             f"intermediate_size {self.intermediate_size}")

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> ModelConfig:
        folder = Path(folder)
        raw = _read_config_json(folder)
        try:
            cfg = _parse(raw, folder)
        except (TypeError, KeyError) as e:
            # A field of the wrong type (e.g. a string where a number belongs).
            raise ValueError(f"{folder}/config.json: malformed field: {e!r}") from None
        # generation_config.json often lists extra stop ids (Llama 3 instruct's <|eot_id|>).
        extra = _generation_eos(folder, cfg.vocab_size)
        eos = cfg.eos_token_ids + [i for i in extra if i not in cfg.eos_token_ids]
        return dataclasses.replace(cfg, eos_token_ids=eos)

    def with_tokenizer_eos(self, eos_token_id: int | None) -> ModelConfig:
        """This config with the tokenizer's eos among its stop ids, as vLLM stops on it: a chat
        model's end of turn is often its tokenizer's eos and in neither config file (Llama 3
        Instruct's first release, <|eot_id|>), and a reply ran on past it to max_tokens, the
        tokens hidden from its text as special ones. An id outside the model's vocab is left
        out: the model never samples it."""
        if eos_token_id is None or eos_token_id in self.eos_token_ids \
                or not 0 <= eos_token_id < self.vocab_size:
            return self
        return dataclasses.replace(self, eos_token_ids=[*self.eos_token_ids, eos_token_id])


def _read_config_json(folder: Path) -> dict[str, Any]:
    if not folder.is_dir():
        raise ValueError(f"model folder {folder} does not exist or is not a directory")
    path = folder / "config.json"
    if not path.is_file():
        raise ValueError(f"model folder {folder} has no config.json")
    return read_json_object(path)


def _generation_eos(folder: Path, vocab_size: int) -> list[int]:
    raw = read_generation_config(folder)
    return _parse_eos(raw.get("eos_token_id"), vocab_size,
                      str(folder / "generation_config.json"))


def _parse(raw: dict[str, Any], folder: Path) -> ModelConfig:
    where = f"{folder}/config.json"
    architecture = _architecture(raw, where)
    model_type = str(raw.get("model_type") or "")

    def need_int(key: str) -> int:
        value = raw.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{where}: '{key}' must be a positive integer, got {value!r}")
        return value

    hidden_size = need_int("hidden_size")
    num_heads = need_int("num_attention_heads")
    num_kv_heads = _kv_heads(raw, num_heads, where)
    num_layers = need_int("num_hidden_layers")
    max_positions = need_int("max_position_embeddings")
    vocab_size = need_int("vocab_size")
    # Qwen3's config class defaults head_dim to 128 (a config.json without it means 128, as
    # transformers reads it), the others to hidden_size / heads.
    head_dim = raw.get("head_dim") or (_QWEN3_HEAD_DIM if architecture == "Qwen3ForCausalLM"
                                       else hidden_size // num_heads)
    if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
        raise ValueError(f"{where}: head_dim must be a positive even integer, got {head_dim!r}")

    hidden_act = raw.get("hidden_act") or raw.get("hidden_activation") or "silu"
    if hidden_act != "silu":
        raise ValueError(f"{where}: hidden_act {hidden_act!r} is not supported (only 'silu')")
    _check_sliding_window(raw, architecture, num_layers, max_positions, where)
    rope_theta, rope_scaling = _parse_rope(raw, where)

    is_qwen2 = architecture == "Qwen2ForCausalLM"
    is_mistral = architecture == "MistralForCausalLM"
    bias_flag = bool(raw.get("attention_bias", False)) and not is_mistral
    return ModelConfig(
        folder=str(folder),
        architecture=architecture,
        model_type=model_type,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=need_int("intermediate_size"),
        vocab_size=vocab_size,
        rms_norm_eps=_need_float(raw, "rms_norm_eps", 1e-6, where),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=is_qwen2 or bias_flag,
        o_proj_bias=bias_flag and not is_qwen2,
        mlp_bias=bool(raw.get("mlp_bias", False)) and architecture == "LlamaForCausalLM",
        qk_norm=architecture == "Qwen3ForCausalLM",
        hidden_act=hidden_act,
        dtype=_parse_dtype(raw, where),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_parse_eos(raw.get("eos_token_id"), vocab_size, where),
    )


def _kv_heads(raw: dict[str, Any], num_heads: int, where: str) -> int:
    # Absent or null means multi-head attention, as in transformers; 0 or true is a broken
    # config, not a request for MHA (or for one KV head).
    value = raw.get("num_key_value_heads")
    if value is None:
        return num_heads
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{where}: 'num_key_value_heads' must be a positive integer, "
                         f"got {value!r}")
    if num_heads % value:
        raise ValueError(f"{where}: num_attention_heads ({num_heads}) must be a multiple of "
                         f"num_key_value_heads ({value})")
    return value


def _need_float(raw: dict[str, Any], key: str, default: float, where: str) -> float:
    value = raw.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{where}: '{key}' must be a positive number, got {value!r}")
    return float(value)


def _architecture(raw: dict[str, Any], where: str) -> str:
    archs = raw.get("architectures")
    if archs is None:
        model_type = raw.get("model_type")
        if model_type in _ARCH_BY_MODEL_TYPE:
            return _ARCH_BY_MODEL_TYPE[model_type]
        raise ValueError(f"{where}: no 'architectures' and unsupported model_type {model_type!r}")
    if not isinstance(archs, list) or not archs:
        raise ValueError(f"{where}: 'architectures' must be a non-empty list, got {archs!r}")
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    raise ValueError(f"{where}: unsupported architecture {archs!r}; "
                     f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def _check_sliding_window(raw: dict[str, Any], architecture: str, num_layers: int,
                          max_positions: int, where: str) -> None:
    """Refuses a config whose attention transformers masks with a window on some layer: the
    engine attends over the whole context on every layer. A layer marked sliding whose window
    is null, switched off or as long as the model's positions is full attention all the same."""
    layer_types = _layer_types(raw, num_layers, where)
    window = _sliding_window(raw, architecture, layer_types, where)
    if window is None:
        return
    layers = _sliding_layers(raw, architecture, layer_types, num_layers, where)
    if layers and window < max_positions:  # a longer window never hides a token
        raise ValueError(f"{where}: sliding window attention is not supported "
                         f"(sliding_window={window} on {len(layers)} of {num_layers} layers, "
                         f"from layer {layers[0]}; max_position_embeddings={max_positions}): "
                         "this engine serves full attention on every layer only")


def _layer_types(raw: dict[str, Any], num_layers: int, where: str) -> list[str] | None:
    layer_types = raw.get("layer_types")
    if layer_types is None:
        return None
    if not isinstance(layer_types, list):
        raise ValueError(f"{where}: 'layer_types' must be a list, got {layer_types!r}")
    if len(layer_types) != num_layers:  # transformers refuses it too
        raise ValueError(f"{where}: 'layer_types' has {len(layer_types)} entries for "
                         f"num_hidden_layers={num_layers}")
    # Other kinds (linear, chunked attention...) are layers this decoder does not have.
    unknown = [t for t in layer_types if t not in _LAYER_TYPES]
    if unknown:
        raise ValueError(f"{where}: layer type {unknown[0]!r} is not supported "
                         f"(supported: {', '.join(_LAYER_TYPES)})")
    return layer_types


def _sliding_window(raw: dict[str, Any], architecture: str, layer_types: list[str] | None,
                    where: str) -> int | None:
    """The window transformers gives this model's sliding layers; None where none has one."""
    if architecture not in _DEFAULT_SLIDING_WINDOW and layer_types is None:
        # LlamaAttention takes no window. Layers marked sliding do slide in transformers'
        # generate (its cache keeps only the window) and in vLLM, so those are checked.
        return None
    window = raw.get("sliding_window", _DEFAULT_SLIDING_WINDOW.get(architecture))
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ValueError(f"{where}: 'sliding_window' must be a positive integer or null, "
                         f"got {window!r}")
    # Qwen2Config/Qwen3Config drop the window unless use_sliding_window is set, so their
    # layers marked sliding then attend in full.
    if architecture in _USE_SLIDING_WINDOW_FLAG and not raw.get("use_sliding_window", False):
        return None
    return window


def _sliding_layers(raw: dict[str, Any], architecture: str, layer_types: list[str] | None,
                    num_layers: int, where: str) -> list[int]:
    """The layers that use the window, as transformers' AutoModel picks them: a Mistral
    config with layer_types loads as Ministral, which follows them."""
    if layer_types is not None:
        return [i for i, t in enumerate(layer_types) if t == "sliding_attention"]
    if architecture not in _USE_SLIDING_WINDOW_FLAG:
        return list(range(num_layers))
    first = raw.get("max_window_layers", _DEFAULT_MAX_WINDOW_LAYERS)
    if isinstance(first, bool) or not isinstance(first, int) or first < 0:
        raise ValueError(f"{where}: 'max_window_layers' must be a non-negative integer, "
                         f"got {first!r}")
    return list(range(first, num_layers))


def _parse_rope(raw: dict[str, Any], where: str) -> tuple[float, dict[str, Any] | None]:
    # transformers 5.x: everything in rope_parameters; 4.x: rope_theta + rope_scaling. A
    # rope_scaling that is set wins whole, as in transformers 5 (a 4.x-style edit of a 5.x
    # config.json, to stretch its context, is what it runs): merged the other way, a default
    # rope_parameters beside it hid it and the model ran unscaled RoPE.
    scaling = _rope_field(raw, "rope_scaling", where)
    params = dict(scaling or _rope_field(raw, "rope_parameters", where))
    if isinstance(params.get("full_attention"), dict):
        params = dict(params["full_attention"])  # per-layer-type layout
    if "rope_theta" not in params:
        params["rope_theta"] = raw.get("rope_theta", 10000.0)
    theta = _need_float(params, "rope_theta", 10000.0, where)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"{where}: partial_rotary_factor {partial} is not supported")
    if rope_type == "default":
        return theta, None
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise ValueError(f"{where}: rope scaling type {rope_type!r} is not supported "
                         f"(supported: {', '.join(_SUPPORTED_ROPE_TYPES)})")
    needed = _LLAMA3_ROPE_KEYS if rope_type == "llama3" else ("factor",)
    missing = [k for k in needed if k not in params]
    if missing:
        raise ValueError(f"{where}: rope scaling {rope_type!r} lacks {', '.join(missing)}")
    values = {k: _need_float(params, k, 0.0, where) for k in needed}
    return theta, {"rope_type": rope_type, **values}


def _rope_field(raw: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    value = raw.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{where}: '{key}' must be an object or null, got {value!r}")
    return value


def _parse_dtype(raw: dict[str, Any], where: str) -> str:
    # transformers 5.x writes "dtype", 4.x "torch_dtype"; absent means float32.
    name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    name = str(name).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"{where}: unsupported checkpoint dtype {name!r}")
    return _DTYPES[name]


def _parse_eos(value: Any, vocab_size: int, where: str) -> list[int]:
    if value is None:
        return []
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{where}: eos_token_id must be an int or a list of ints, got {value!r}")
    # The sampler indexes logits with these ids (min_tokens bans them): one outside the
    # vocabulary would fail every later step, and a negative one would ban another token.
    outside = [i for i in ids if not 0 <= i < vocab_size]
    if outside:
        raise ValueError(f"{where}: eos_token_id {outside[0]} is outside the model's "
                         f"vocabulary [0, {vocab_size})")
    return list(ids)
