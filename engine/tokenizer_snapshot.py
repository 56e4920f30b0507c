"""A tokenizer as Hugging Face set it up, saved so that later loads skip ``transformers``.

``AutoTokenizer.from_pretrained`` costs every serving process 2-6 s of CPU: transformers'
imports (torch among them), then the tokenizer class's set-up, which may rebuild the backend's
normalizer, pre-tokenizer and post-processor from ``tokenizer_config.json``. Everything the
engine calls afterwards is the backend (a ``tokenizers.Tokenizer``) and a few attributes. The
first load writes the backend as set up (``to_str``) and those attributes to a cache file; a
later load of the same files under the same library versions rebuilds the backend with
``Tokenizer.from_str`` (~25 ms). The cache key covers every file the loader may read, the
versions of transformers and tokenizers, and this file's format, so a stale snapshot is never
used: a changed file or library is a different key.

A snapshot is taken only when encoding through the bare backend is what transformers does for
that class (see ``backend_matches``); other tokenizers keep the transformers object.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from kernels.cache_dirs import pdserve_cache_dir

logger = logging.getLogger(__name__)

# Bump when the fields below or their meaning change.
SNAPSHOT_FORMAT = 2
# What AutoTokenizer may read from a model folder (config.json names the tokenizer class
# when tokenizer_config.json does not).
KEY_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
             "added_tokens.json", "tokenizer.model", "spiece.model", "vocab.json",
             "merges.txt", "vocab.txt", "chat_template.jinja", "chat_template.json",
             "config.json")
_EXTRA_TEMPLATES_DIR = "additional_chat_templates"
# Texts a snapshot must encode exactly as transformers does before it is written: spacing,
# digits, bytes outside ASCII, and (added below) every added token inside text.
_PROBES = ("", " ", "Hello world", "  two leading spaces", "tabs\tand\nnew\n\nlines ",
           "caf\u00e9 na\u00efve \u65e5\u672c\u8a9e \U0001f642", "12345 67.89 1e-3",
           "don't STOP", "a" * 40)
_MAX_TOKEN_PROBES = 64
# How long a process waits for another one loading the same tokenizer before loading it too:
# far above a load's few seconds; a holder that died has already released the lock.
LOCK_WAIT_S = 60.0


@dataclass(frozen=True)
class TokenizerSnapshot:
    # tokenizers.Tokenizer.to_str() after transformers set it up; None where the backend
    # cannot be serialized (a component written in Python).
    backend_json: str | None
    vocab_size: int  # len(hf): the tokenizer's ids, added tokens included
    eos_token_id: int | None
    bos_token_id: int | None
    pad_token_id: int | None
    all_special_ids: list[int]
    # Added tokens flagged special: what the backend drops under skip_special_tokens.
    skipped_special_ids: list[int]
    # transformers sets the backend's encode_special_tokens from this on every encode.
    split_special_tokens: bool
    # The model's chat template (a dict of named templates is reduced to its "default").
    chat_template: str | None
    # The special tokens' strings; chat templates see them as variables (bos_token, ...).
    special_tokens_map: dict[str, Any] = field(default_factory=dict)
    # Every named template where the model ships several ({} where it ships one or none).
    chat_templates: dict[str, str] = field(default_factory=dict)

    def build_backend(self):
        """A fresh ``tokenizers.Tokenizer`` that encodes and decodes as the snapshotted one."""
        from tokenizers import Tokenizer as Backend

        backend = Backend.from_str(self.backend_json)
        # transformers' encode (no truncation or padding asked) clears both first.
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = self.split_special_tokens
        return backend


def snapshot_of(hf) -> TokenizerSnapshot:
    """The snapshot of a loaded transformers fast tokenizer."""
    template = hf.chat_template
    named = {}
    if isinstance(template, dict):
        named = {str(k): v for k, v in template.items() if isinstance(v, str)}
        template = template.get("default")
    try:
        backend_json = hf.backend_tokenizer.to_str()
    except Exception:  # tokenizers raises a bare Exception for custom components
        backend_json = None
    return TokenizerSnapshot(
        backend_json=backend_json,
        vocab_size=len(hf),
        eos_token_id=hf.eos_token_id,
        bos_token_id=hf.bos_token_id,
        pad_token_id=hf.pad_token_id,
        all_special_ids=[int(i) for i in hf.all_special_ids],
        skipped_special_ids=sorted(int(i) for i, tok in hf.added_tokens_decoder.items()
                                   if tok.special),
        split_special_tokens=bool(getattr(hf, "split_special_tokens", False)),
        chat_template=template if isinstance(template, str) else None,
        special_tokens_map=json.loads(json.dumps(dict(hf.special_tokens_map), default=str)),
        chat_templates=named,
    )


def backend_matches(hf, snapshot: TokenizerSnapshot) -> bool:
    """Whether the snapshot's backend encodes like ``hf.encode`` for this tokenizer's class.

    True only when the class encodes through transformers' generic fast path (no override of
    the encode methods) and the rebuilt backend agrees with ``hf`` on a set of probe texts.
    """
    if snapshot.backend_json is None or not _generic_fast_encode(type(hf)):
        return False
    backend = snapshot.build_backend()
    added = [tok.content for tok in list(hf.added_tokens_decoder.values())[:_MAX_TOKEN_PROBES]]
    texts = list(_PROBES) + [f"x{t}y {t}" for t in added]
    for text in texts:
        for special in (True, False):
            if hf.encode(text, add_special_tokens=special) != \
                    backend.encode(text, add_special_tokens=special).ids:
                return False
    return True


def _generic_fast_encode(cls) -> bool:
    # The modules of transformers' fast-tokenizer base (5.x, then 4.x) and shared base class.
    generic = ("transformers.tokenization_utils_tokenizers",
               "transformers.tokenization_utils_fast",
               "transformers.tokenization_utils_base")
    for name in ("encode", "encode_plus", "__call__", "_encode_plus", "_batch_encode_plus"):
        owner = next((k for k in cls.__mro__ if name in vars(k)), None)
        if owner is not None and owner.__module__ not in generic:
            return False
    return True


def snapshot_key(folder: Path) -> str:
    """The cache key of folder's tokenizer: its files' contents and the library versions."""
    h = hashlib.sha256()
    h.update(f"format={SNAPSHOT_FORMAT}\n".encode())
    for package in ("transformers", "tokenizers"):
        try:
            h.update(f"{package}={version(package)}\n".encode())
        except PackageNotFoundError:
            h.update(f"{package}=?\n".encode())
    files = [folder / name for name in KEY_FILES]
    extra = folder / _EXTRA_TEMPLATES_DIR
    if extra.is_dir():
        files += sorted(p for p in extra.iterdir() if p.is_file())
    for path in files:
        if path.is_file():
            h.update(f"{path.relative_to(folder)}\n".encode())
            h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


def cache_dir() -> Path:
    """$PDSERVE_TOKENIZER_CACHE, else the tokenizers folder of pdserve's cache
    (kernels/cache_dirs.py)."""
    return pdserve_cache_dir("PDSERVE_TOKENIZER_CACHE", "tokenizers")


def read_snapshot(key: str) -> TokenizerSnapshot | None:
    """The cached snapshot under key, or None (absent, unreadable or of another format)."""
    path = cache_dir() / f"{key}.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        if raw.pop("format") != SNAPSHOT_FORMAT:
            return None
        return TokenizerSnapshot(**raw)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        # A damaged file costs one slow load, which rewrites it.
        logger.warning("ignoring the tokenizer snapshot %s: %s: %s", path, type(e).__name__, e)
        return None


def write_snapshot(key: str, snapshot: TokenizerSnapshot) -> None:
    """Saves the snapshot under key; a cache that cannot be written is only logged."""
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        # Processes starting together may all write: each renames a whole file into place.
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{key}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                os.fchmod(f.fileno(), 0o644)  # mkstemp makes it private; nothing here is secret
                json.dump({"format": SNAPSHOT_FORMAT, **asdict(snapshot)}, f)
            os.replace(tmp, folder / f"{key}.json")
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        logger.warning("cannot write the tokenizer snapshot to %s: %s", folder, e)
        return
    logger.info("tokenizer snapshot saved to %s: later loads of these files skip transformers",
                folder / f"{key}.json")


@contextlib.contextmanager
def snapshot_lock(key: str) -> Iterator[bool]:
    """Held while one process loads a tokenizer through transformers and writes its snapshot,
    so that processes starting together (a cluster's services) load it once: the others wait,
    then read the snapshot. Yields whether the lock is held: not where the cache cannot be
    written, nor past ``LOCK_WAIT_S`` of waiting (a holder that hangs), when the caller loads
    the tokenizer itself."""
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / f".{key}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield False
        return
    try:
        yield _acquire(fd, LOCK_WAIT_S)
    finally:
        os.close(fd)  # releases the lock


def _acquire(fd: int, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                logger.warning("another process has been loading this tokenizer for %.0f s; "
                               "loading it here too", wait_s)
                return False
            time.sleep(0.05)
