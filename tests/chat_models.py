"""Copies of a preset's folder with another chat template, or none, for chat tests."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path


def model_with_template(src: Path, folder: Path, template: str | None, *,
                        eos_token: str | None = None) -> str:
    """``src``'s model in ``folder`` with ``template`` as its chat template (None: without
    one) and, given one, ``eos_token`` as its tokenizer's eos; the weights are a link to
    ``src``'s, not a copy."""
    folder.mkdir()
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        shutil.copy(src / name, folder / name)
    os.symlink(src / "model.safetensors", folder / "model.safetensors")
    config = json.loads((src / "tokenizer_config.json").read_text())
    specials = json.loads((src / "special_tokens_map.json").read_text())
    config.pop("chat_template", None)
    if template is not None:
        config["chat_template"] = template
    if eos_token is not None:
        config["eos_token"] = specials["eos_token"] = eos_token
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "special_tokens_map.json").write_text(json.dumps(specials))
    return str(folder)
