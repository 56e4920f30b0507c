"""Whether a worker serves the router's model: by content where both sides know it, else by name.

A fingerprint (engine/model_fingerprint.py) is ``"{files}:{weights}"``. Config and tokenizer
files that differ from the router's make a worker foreign whatever its name: the router's
token ids would not be its. Weights known on both sides decide alone: equal weights are one
model under any name (a copy in another folder), different ones are another model under any
name (a checkpoint replaced in place, two clusters mounting theirs at one path). Where either
side does not know its weights (a router given only the tokenizer, a worker from before
fingerprints), the names decide, as they always did.
"""
from __future__ import annotations

from pathlib import PurePath

from protos import common_pb2


def model_mismatch(name: str, fingerprint: str, info: common_pb2.WorkerInfo) -> str:
    """Why ``info``'s worker does not serve the router's model (``name``, ``fingerprint``);
    "" when it does. An empty name or fingerprint on either side checks nothing of it."""
    ours_files, _, ours_weights = fingerprint.partition(":")
    files, _, weights = info.model_fingerprint.partition(":")
    if ours_files and files and ours_files != files:
        return (f"its model's config or tokenizer files differ from this router's "
                f"(fingerprint {info.model_fingerprint}, the router's {fingerprint})")
    if ours_weights and weights:
        if ours_weights == weights:
            return ""
        return (f"its model's weights differ from this router's (fingerprint "
                f"{info.model_fingerprint}, the router's {fingerprint})")
    if name and info.model and model_key(info.model) != model_key(name):
        return "its model's name differs from this router's"
    return ""


def model_key(model: str) -> str:
    """What of a --model names the model wherever it is read: its folder's name. A router and
    its workers on other hosts or in other containers may reach one folder by different paths
    (/models/Qwen3-0.6B, ./Qwen3-0.6B), and a preset's name is its folder's name
    (engine/presets.py), so the whole string is not comparable and no path can be resolved
    here; the folder name is what they share. Names decide only where the weights are not
    known on both sides (module docstring); there, one model copied under another folder name
    is taken for another unless every service names it with --served-model-name."""
    return PurePath(model.rstrip("/")).name.casefold() or model
