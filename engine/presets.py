"""Built-in model presets: random-weight Hugging Face checkpoints generated locally.

Nothing is downloaded. A preset is written as an ordinary HF folder (config.json,
model.safetensors or shards + index, generation_config.json, tokenizer files), so the engine
and transformers load it like any checkpoint. Weights come from the transformers model class
initialised under a fixed seed, with an init scale large enough that greedy decoding wanders
over many tokens instead of repeating one, so token-level comparisons mean something.
"""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from engine.tokenizer_builder import DEFAULT_VOCAB_SIZE, TokenizerInfo, build_tokenizer
from kernels.cache_dirs import pdserve_cache_dir

# Bump when the generated files change for the same spec, so cached folders are rebuilt.
_FORMAT_VERSION = 2  # 2: the tokenizer has a chat template
_MARKER = ".pdserve-preset.json"


@dataclass(frozen=True)
class PresetSpec:
    name: str
    architecture: str  # transformers class name, e.g. "LlamaForCausalLM"
    model_type: str  # config model_type, e.g. "llama"
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_theta: float
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    dtype: str = "float32"  # storage dtype of the weights
    # 0.02 (the usual default) makes greedy decoding collapse onto one repeated token.
    initializer_range: float = 0.1
    seed: int = 0
    max_shard_size: str | None = None  # None: one model.safetensors
    description: str = ""


PRESETS: dict[str, PresetSpec] = {p.name: p for p in (
    PresetSpec(
        name="tiny-llama", architecture="LlamaForCausalLM", model_type="llama",
        hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
        intermediate_size=1408, vocab_size=DEFAULT_VOCAB_SIZE, max_position_embeddings=2048,
        tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-5, seed=1,
        description="~32M-parameter Llama: GQA 8/4 heads, untied embeddings"),
    # A step that costs what a GPU's does (well under a millisecond on one CPU thread), so the
    # serving path's fixed costs (gRPC hops, queues, KV transfer, the GIL) stand out on a CPU.
    PresetSpec(
        name="micro-llama", architecture="LlamaForCausalLM", model_type="llama",
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=176, vocab_size=DEFAULT_VOCAB_SIZE, max_position_embeddings=2048,
        tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-5, seed=5,
        description="~1M-parameter Llama whose step is nearly free: serving-path overheads"),
    PresetSpec(
        name="tiny-qwen2", architecture="Qwen2ForCausalLM", model_type="qwen2",
        hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
        intermediate_size=1408, vocab_size=DEFAULT_VOCAB_SIZE, max_position_embeddings=2048,
        tie_word_embeddings=True, rope_theta=1_000_000.0, seed=2,
        description="~28M-parameter Qwen2: q/k/v bias, tied embeddings"),
    PresetSpec(
        name="tiny-qwen3", architecture="Qwen3ForCausalLM", model_type="qwen3",
        hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
        head_dim=128, intermediate_size=1408, vocab_size=DEFAULT_VOCAB_SIZE,
        max_position_embeddings=2048, tie_word_embeddings=True, rope_theta=1_000_000.0, seed=3,
        description="~34M-parameter Qwen3: q/k RMSNorm, head_dim 128 != hidden/heads, tied"),
    PresetSpec(
        name="qwen3-0.6b-shape", architecture="Qwen3ForCausalLM", model_type="qwen3",
        hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, intermediate_size=3072, vocab_size=151936, max_position_embeddings=40960,
        tie_word_embeddings=True, rope_theta=1_000_000.0, dtype="bfloat16", seed=4,
        max_shard_size="500MB",
        description="Qwen3-0.6B's exact shapes (~0.6B parameters), random bf16 weights"),
)}


def list_presets() -> list[str]:
    return list(PRESETS)


def default_cache_dir() -> Path:
    """Where resolve_model generates presets: $PDSERVE_CACHE_DIR, else the models folder of
    pdserve's cache (kernels/cache_dirs.py)."""
    return pdserve_cache_dir("PDSERVE_CACHE_DIR", "models")


def _get_spec(preset: str) -> PresetSpec:
    spec = PRESETS.get(preset)
    if spec is None:
        raise ValueError(f"unknown preset {preset!r} (presets: {', '.join(PRESETS)})")
    return spec


def make_config(spec: PresetSpec, tok: TokenizerInfo):
    """The transformers config of a preset."""
    from transformers import AutoConfig

    extra = {} if spec.head_dim is None else {"head_dim": spec.head_dim}
    return AutoConfig.for_model(
        spec.model_type,
        architectures=[spec.architecture],
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        intermediate_size=spec.intermediate_size,
        vocab_size=spec.vocab_size,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        rope_theta=spec.rope_theta,
        rms_norm_eps=spec.rms_norm_eps,
        initializer_range=spec.initializer_range,
        hidden_act="silu",
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **extra,
    )


def make_model(preset: str, out_dir: str | Path) -> Path:
    """Writes the preset's HF checkpoint folder into out_dir (created if missing); returns it."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    spec = _get_spec(preset)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out, vocab_size=DEFAULT_VOCAB_SIZE,
                          model_max_length=spec.max_position_embeddings)
    config = make_config(spec, tok)
    dtype = getattr(torch, spec.dtype)
    # fork_rng: the caller's global RNG state is left as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        _perturb_defaults(model, spec.seed)
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    save_kwargs = {} if spec.max_shard_size is None else {"max_shard_size": spec.max_shard_size}
    model.save_pretrained(out, safe_serialization=True, **save_kwargs)
    del model
    _add_legacy_config_keys(out / "config.json", spec)
    return out


def _perturb_defaults(model, seed: int) -> None:
    """Biases init to 0 and norm weights to 1; randomise them so a loader that drops them
    (or an attention that forgets the Qwen2 q/k/v bias) no longer matches transformers."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                noise = torch.randn(p.shape, generator=gen) * 0.1
            elif "norm" in name and name.endswith(".weight"):
                noise = torch.rand(p.shape, generator=gen) * 0.4 - 0.2
            else:
                continue
            p.add_(noise.to(p.dtype))


def _add_legacy_config_keys(path: Path, spec: PresetSpec) -> None:
    # transformers 5 nests rope_theta under rope_parameters; real checkpoints (and readers of
    # raw config.json) also have it at the top level.
    config = json.loads(path.read_text())
    config.setdefault("rope_theta", spec.rope_theta)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _fingerprint(spec: PresetSpec) -> str:
    blob = json.dumps({"spec": dataclasses.asdict(spec), "format": _FORMAT_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _is_built(folder: Path, spec: PresetSpec) -> bool:
    try:
        marker = json.loads((folder / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("fingerprint") == _fingerprint(spec)


def resolve_model(name_or_path: str) -> Path:
    """An existing folder as-is, or a preset name generated once into default_cache_dir().

    Generation happens in a temporary folder beside the final one, renamed into place when
    complete, under an fcntl lock so concurrent processes build it once and never see a
    partial folder. Anything else raises ValueError listing the presets.
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    spec = PRESETS.get(name_or_path)
    if spec is None:
        raise ValueError(f"model {name_or_path!r} is neither an existing folder nor a built-in "
                         f"preset (presets: {', '.join(PRESETS)})")
    cache = default_cache_dir()
    final = cache / spec.name
    if _is_built(final, spec):
        return final
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f".{spec.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _is_built(final, spec):  # another process may have built it while we waited
            _build_into(spec, final)
    return final


def _build_into(spec: PresetSpec, final: Path) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.name}.tmp-", dir=final.parent))
    try:
        make_model(spec.name, tmp)
        (tmp / _MARKER).write_text(json.dumps({"preset": spec.name,
                                               "fingerprint": _fingerprint(spec)}) + "\n")
        # mkdtemp makes the folder private; a cache may be shared by several users.
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        if final.exists():  # stale (older spec) or a leftover without a marker
            stale = Path(tempfile.mkdtemp(prefix=f".{spec.name}.old-", dir=final.parent))
            os.rename(final, stale / spec.name)
            shutil.rmtree(stale, ignore_errors=True)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
