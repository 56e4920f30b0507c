"""What model a service runs, by content: a fingerprint of its folder.

The router tokenizes a prompt, one worker computes its KV and another decodes from it: all
three must run the same model. A name does not say so. Two folders of one name can hold
different models (two clusters that mount theirs at one path and share a Redis namespace; a
model replaced in place, its workers restarted one by one), and KV from one model decoded by
another gives fluent garbage that no check downstream can see. One model under two names is
the opposite case, and is safe to serve.

The fingerprint is ``"{files}:{weights}"``:

- ``files``: the model's config, generation config and tokenizer files (what the router
  reads, and what sets the stop tokens; the tokenizer's from --tokenizer's folder when one is
  given, so that a router and workers serving other tokenizers differ), the JSON ones by
  content (keys that only say which tool wrote them left out);
- ``weights``: each safetensors file's name, data size and header (every tensor's name,
  dtype, shape and place; not the free-form metadata a converter writes), and a sample of
  every tensor's bytes (64 at its start, its middle and its end; a tensor of at most 16 KiB,
  a norm's or a bias's, whole). A fine-tune, or a merged adapter, changes every element of
  the tensors it touches, so a sample of each tensor tells checkpoints of one shape apart
  without reading gigabytes; "" when the folder has no weights (a router given only the
  tokenizer).

Chat templates are left out, in their own file or in tokenizer_config.json: only the router
renders them, so a worker's copy does not matter (a router names its own in ModelIdentity).
"""
from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from engine.weight_files import INDEX_FILE, weight_files

# The files a model's tokens and shapes depend on; those absent are skipped.
FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "spiece.model",
         "vocab.json", "merges.txt", "vocab.txt")
# Of FILES, those of the model itself; the rest are the tokenizer's (read from --tokenizer's
# folder when it is given: engine/tokenizer_choice.py).
MODEL_FILES = ("config.json", "generation_config.json")
# Keys of a JSON file left out of its digest: which tool and version wrote it, where it was
# loaded from, the chat template. Two copies of one model re-saved by other tools are one model.
_IGNORED_KEYS = {"transformers_version", "_name_or_path", "chat_template"}
SAMPLE_BYTES = 64
# Tensors this small are read whole: a norm's or a bias's (8 KiB for a 4096-wide bfloat16
# one), which a fine-tune may change in few elements; a few MB for a whole large model.
WHOLE_TENSOR_BYTES = 16 * 1024
# A safetensors header longer than this is not one (the format caps it at 100 MB).
_MAX_HEADER = 100 * 1024 * 1024
_DIGEST_CHARS = 16


def model_fingerprint(folder: Path, tokenizer_folder: Path | None = None) -> str:
    """``folder``'s fingerprint (module docstring); blocking. ValueError for weights that are
    not safetensors files. ``tokenizer_folder``: where the tokenizer files are read from when
    not ``folder`` (--tokenizer)."""
    return f"{files_digest(folder, tokenizer_folder)}:{weights_digest(folder)}"


def text_digest(text: str) -> str:
    """A digest of ``text`` as long as the fingerprint's parts (a chat template's)."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:_DIGEST_CHARS]


def files_digest(folder: Path, tokenizer_folder: Path | None = None) -> str:
    """The digest of ``folder``'s config files and the tokenizer files of ``tokenizer_folder``
    (default ``folder``): the tokenizer served, wherever it came from. One tokenizer in the
    model's folder or in another gives one digest."""
    h = hashlib.sha256()
    for name in FILES:
        where = folder if name in MODEL_FILES or tokenizer_folder is None else tokenizer_folder
        path = Path(where) / name
        if path.is_file():
            h.update(f"{name}\n".encode())
            h.update(hashlib.sha256(_content(path)).digest())
    return h.hexdigest()[:_DIGEST_CHARS]


def _content(path: Path) -> bytes:
    """A JSON object file's keys that matter, in one order; any other file's bytes."""
    raw = path.read_bytes()
    if path.suffix != ".json":
        return raw
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return raw  # whoever reads it refuses it; the bytes still tell copies apart
    if not isinstance(obj, dict):
        return raw
    return _canonical({k: v for k, v in obj.items() if k not in _IGNORED_KEYS})


def _canonical(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False).encode("utf-8", "surrogatepass")


def weights_digest(folder: Path) -> str:
    """"" when the folder has no weights; else the digest of every file's sample."""
    try:
        files = weight_files(folder)
    except ValueError:
        if any(folder.glob("*.safetensors")) or (folder / INDEX_FILE).exists():
            raise  # weights that the loader would refuse: say so here too
        return ""
    h = hashlib.sha256()
    for path in files:
        h.update(f"{path.name}\n".encode())
        _sample_safetensors(path, h)
    return h.hexdigest()[:_DIGEST_CHARS]


def _sample_safetensors(path: Path, h) -> None:
    """Feeds ``h`` the file's header and samples of each tensor's bytes."""
    size = path.stat().st_size
    with path.open("rb") as f:
        raw = f.read(8)
        (length,) = struct.unpack("<Q", raw) if len(raw) == 8 else (None,)
        if length is None or length > min(_MAX_HEADER, size - 8):
            raise ValueError(f"{path} is not a safetensors file (no header)")
        header = f.read(length)
        try:
            tensors = json.loads(header)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path} has an unreadable safetensors header: {e}") from None
        if isinstance(tensors, dict):
            # The tensors' entries, not the metadata: {"format": "pt"} or not, one model.
            h.update(_canonical({k: v for k, v in tensors.items() if k != "__metadata__"}))
        base = 8 + length
        h.update(f"\n{size - base}\n".encode())  # the data's size, not the header's
        for offsets in sorted(_spans(tensors, path)):
            for at, n in _samples(*offsets):
                f.seek(base + at)
                h.update(f.read(n))


def _spans(tensors: object, path: Path) -> list[tuple[int, int]]:
    """Each tensor's [begin, end) in the data region, from the header."""
    if not isinstance(tensors, dict):
        raise ValueError(f"{path}'s safetensors header is not an object")
    spans = []
    for name, meta in tensors.items():
        if name == "__metadata__":
            continue
        offsets = meta.get("data_offsets") if isinstance(meta, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) and not isinstance(o, bool) and o >= 0
                        for o in offsets) and offsets[0] <= offsets[1]):
            raise ValueError(f"{path}: tensor {name!r} has no valid data_offsets")
        spans.append((offsets[0], offsets[1]))
    return spans


def _samples(begin: int, end: int) -> list[tuple[int, int]]:
    """(offset, length) of the bytes read of a tensor: the whole of a small one, else
    SAMPLE_BYTES at its start, middle and end."""
    if end - begin <= WHOLE_TENSOR_BYTES:
        return [(begin, end - begin)]
    middle = begin + (end - begin) // 2
    return [(begin, SAMPLE_BYTES), (middle, SAMPLE_BYTES), (end - SAMPLE_BYTES, SAMPLE_BYTES)]
