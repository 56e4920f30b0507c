"""Which tokenizer a model is served with: its own folder's, or another (``--tokenizer``).

A checkpoint folder may ship without tokenizer files (weights converted or fine-tuned
elsewhere), or a user may want another, compatible tokenizer; vLLM's ``--tokenizer`` names
its folder. Only a local folder is taken here (nothing is fetched from a hub). Every service
that reads the model (the router, each worker, the offline engine) decides through
``load_model_tokenizer``, so they agree on the tokenizer when given the same flags; the model
fingerprint (engine/model_fingerprint.py) digests the chosen tokenizer's files, so a router
and workers started with different tokenizers are told apart (router/model_match.py).
"""
from __future__ import annotations

from pathlib import Path

from engine.tokenizer import TOKENIZER_FILES, Tokenizer, has_tokenizer_files, load_tokenizer


def tokenizer_folder(model_path: str | Path, tokenizer: str | None) -> Path:
    """The folder the tokenizer is read from: ``tokenizer``'s when given, else the model's.
    ValueError for a given one that is no folder or holds no tokenizer files."""
    if tokenizer is None:
        return Path(model_path)
    path = Path(tokenizer).expanduser()
    if not path.is_dir():
        raise ValueError(f"--tokenizer {tokenizer!r} is not a folder (only a local folder "
                         "holding the tokenizer's files is taken)")
    if not has_tokenizer_files(path):
        raise ValueError(f"--tokenizer {tokenizer!r} holds no tokenizer files "
                         f"(looked for {', '.join(TOKENIZER_FILES)})")
    return path


def load_model_tokenizer(model_path: str | Path, tokenizer: str | None,
                         model_vocab_size: int) -> Tokenizer | None:
    """The tokenizer a model is served with; None when neither ``tokenizer`` is given nor the
    model's folder has one (token-id prompts only). ValueError for a ``tokenizer`` folder
    without one, broken files, or one whose ids do not all fit the model's embedding."""
    folder = tokenizer_folder(model_path, tokenizer)
    if tokenizer is None and not has_tokenizer_files(folder):
        return None
    tok = load_tokenizer(folder)
    # The model's own tokenizer may count more ids than its embedding (extra added tokens
    # the model never samples); a chosen one must fit, as vLLM refuses one longer than the
    # embedding: a prompt id past it would index outside the embedding table. The model's
    # own folder named as --tokenizer is the model's own tokenizer: taken as without the flag.
    own = tokenizer is None or folder.resolve() == Path(model_path).expanduser().resolve()
    if not own and tok.vocab_size > model_vocab_size:
        raise ValueError(f"--tokenizer {tokenizer!r} has {tok.vocab_size} token ids, more than "
                         f"the model's vocab_size {model_vocab_size} (config.json): its ids "
                         "must all be < vocab_size, so it is not this model's tokenizer")
    return tok
