"""The sampling defaults a checkpoint recommends, from its ``generation_config.json``.

Instruct models ship the temperature, top-p, top-k (and sometimes min-p, repetition penalty
and a token budget) they were tuned for; Qwen3's are temperature 0.6, top-p 0.95, top-k 20.
As in vLLM (``--generation-config auto``), those become the defaults of every request that
leaves the field unset; a field the request sets wins. ``engine`` ignores the file and keeps
the engine's own defaults (temperature 1.0, ...); a folder takes the file from there instead.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.sampling_params import SamplingParams
from protos import common_pb2

# generation_config.json key -> SamplingParams field.
_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
         "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file holding one object (a model folder's config files); ValueError when not."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(raw).__name__}")
    return raw


def read_generation_config(folder: Path) -> dict[str, Any]:
    """The folder's generation_config.json ({} when it has none); ValueError when broken."""
    path = folder / "generation_config.json"
    return read_json_object(path) if path.is_file() else {}


def check_generation_config(value: str) -> str:
    """``auto``, ``engine`` or a folder with a generation_config.json; ValueError otherwise."""
    if value in ("auto", "engine"):
        return value
    if not isinstance(value, str) or not (Path(value) / "generation_config.json").is_file():
        raise ValueError(f"generation_config must be 'auto', 'engine' or a folder holding a "
                         f"generation_config.json, got {value!r}")
    return value


def load_sampling_defaults(generation_config: str, model_folder: str | Path,
                           vocab_size: int | None = None) -> dict:
    """The SamplingParams fields the checkpoint sets (possibly none), validated: as a
    request's (against ``vocab_size`` when given) and as the messages carry them. A default
    checked only by the engine's rules (no int32 bound, no vocabulary) loaded, then failed
    every request that left the field unset, each blamed on its request."""
    if check_generation_config(generation_config) == "engine":
        return {}
    folder = Path(model_folder if generation_config == "auto" else generation_config)
    raw = read_generation_config(folder)
    defaults = {field: raw[key] for key, field in _KEYS.items() if raw.get(key) is not None}
    if defaults.get("top_k") == 0:
        defaults["top_k"] = -1  # HF's "off"
    try:
        params = SamplingParams(**defaults)
        if vocab_size is not None:
            params.validate_vocab(vocab_size)
        common_pb2.SamplingParams(**defaults)  # the router fills requests with them
    except (ValueError, TypeError) as e:
        raise ValueError(f"{folder / 'generation_config.json'}: {e}") from None
    return defaults
