"""Whether a worker serves the router's model: by content where both sides know it, else by name.

A fingerprint (engine/model_fingerprint.py) is ``"{files}:{weights}"``. Config and tokenizer
files that differ from the router's make a worker foreign whatever its name: the router's
token ids would not be its. Weights known on both sides decide alone: equal weights are one
model under any name (a copy in another folder), different ones are another model under any
name (a checkpoint replaced in place, two clusters mounting theirs at one path). Where either
side does not know its weights (a router given only the tokenizer, a worker from before
fingerprints), the names decide, as they always did.

The same rule says whether a router may go on with a stream another router began (the SDK's
failover sends the first router's ``ModelIdentity`` as ``GenerateRequest.expect_model``), the
chat template too when the prompt is a chat: it made the prompt's token ids.
"""
from __future__ import annotations

from pathlib import PurePath

from protos import common_pb2, router_pb2
from router.errors import quoted


def model_mismatch(name: str, fingerprint: str, info: common_pb2.WorkerInfo) -> str:
    """Why ``info``'s worker does not serve the router's model (``name``, ``fingerprint``);
    "" when it does. An empty name or fingerprint on either side checks nothing of it."""
    part = model_difference(name, fingerprint, info.model, info.model_fingerprint)
    if part == "name":
        return "its model's name differs from this router's"
    if part:
        return (f"its model's {_PARTS[part]} differ from this router's (fingerprint "
                f"{info.model_fingerprint}, the router's {fingerprint})")
    return ""


def expected_model_mismatch(ours: router_pb2.ModelIdentity, expected: router_pb2.ModelIdentity,
                            chat: bool) -> str:
    """Why a request that expects the model ``expected`` (``GenerateRequest.expect_model``) is
    not this router's to serve; "" when it is. The chat template counts for a chat only: it
    makes the prompt of nothing else."""
    part = model_difference(ours.name, ours.fingerprint, expected.name, expected.fingerprint)
    if not part and chat and ours.chat_template != expected.chat_template:
        part = "chat_template"
    if not part:
        return ""
    theirs, mine = ((expected.name, ours.name) if part == "name" else
                    (expected.chat_template, ours.chat_template) if part == "chat_template" else
                    (expected.fingerprint, ours.fingerprint))
    return (f"this router serves another model than the request expects: their "
            f"{_PARTS[part]} differ ({mine!r}, expected {quoted(theirs)})")


# What ``model_difference`` names, in messages.
_PARTS = {"files": "config or tokenizer files", "weights": "weights", "name": "names",
          "chat_template": "chat templates"}


def model_difference(name: str, fingerprint: str, other_name: str, other_fingerprint: str) -> str:
    """What tells two models apart (module docstring): "files", "weights" or "name"; "" when
    they are one. An empty name or fingerprint on either side checks nothing of it."""
    ours_files, _, ours_weights = fingerprint.partition(":")
    files, _, weights = other_fingerprint.partition(":")
    if ours_files and files and ours_files != files:
        return "files"
    if ours_weights and weights:
        return "" if ours_weights == weights else "weights"
    if name and other_name and model_key(other_name) != model_key(name):
        return "name"
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
