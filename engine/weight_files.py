"""Which files of a Hugging Face folder hold its weights: the single safetensors file, or the
shards its index names. Without torch: the router's model fingerprint reads them too
(engine/model_fingerprint.py), and the router never loads torch for it."""
from __future__ import annotations

import json
from pathlib import Path

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the single file, or the index's shards."""
    # transformers looks for the single file first; a folder holding both (a stale index, or
    # shards of another save) loads the single file there, so it must here too.
    single = folder / SINGLE_FILE
    if single.is_file():
        return [single]
    index = folder / INDEX_FILE
    if index.is_file():
        return _shards_from_index(index)
    others = sorted(p.name for p in folder.glob("*.bin")) + sorted(
        p.name for p in folder.glob("*.safetensors"))
    hint = f" (found {', '.join(others)}; only {SINGLE_FILE} or sharded safetensors with " \
           f"{INDEX_FILE} are read)" if others else ""
    raise ValueError(f"model folder {folder} has no weights: no {SINGLE_FILE} or {INDEX_FILE}"
                     + hint)


def _shards_from_index(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{index} is not a valid safetensors index: {e!r}") from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index} has an empty or malformed weight_map")
    shards = sorted(set(_shard_name(index, name, shard) for name, shard in weight_map.items()))
    missing = [s for s in shards if not (index.parent / s).is_file()]
    if missing:
        raise ValueError(f"{index} names shard files that do not exist: {', '.join(missing)}")
    return [index.parent / s for s in shards]


def _shard_name(index: Path, weight: str, shard: object) -> str:
    """``shard`` checked to name a file directly in the index's folder: an index is data from
    the checkpoint, and must not make the loader read files elsewhere."""
    if not isinstance(shard, str) or not shard or Path(shard).name != shard \
            or shard in (".", ".."):
        raise ValueError(f"{index}: weight_map entry {weight!r} must name a shard file in the "
                         f"model folder, got {shard!r}")
    return shard
