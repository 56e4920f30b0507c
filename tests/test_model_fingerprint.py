"""A model folder's fingerprint (engine/model_fingerprint.py) and the router's rule over it
(router/model_match.py): one model under any name is one model, another under one name is
another."""
from __future__ import annotations

import json
import shutil
import struct

import pytest
from safetensors.torch import load_file, save_file

from engine.model_fingerprint import model_fingerprint
from engine.presets import resolve_model
from protos import common_pb2, router_pb2
from router.model_match import expected_model_mismatch, model_mismatch


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    """A copy of the micro-llama preset, for tests to change."""
    src = resolve_model("micro-llama")
    dst = tmp_path_factory.mktemp("fp") / "micro-llama"
    shutil.copytree(src, dst)
    return dst


def _variant(micro, tmp_path, name="copy"):
    dst = tmp_path / name
    shutil.copytree(micro, dst)
    return dst


def test_a_copy_in_another_folder_has_the_same_fingerprint(micro, tmp_path):
    fp = model_fingerprint(micro)
    files, weights = fp.split(":")
    assert len(files) == len(weights) == 16
    assert model_fingerprint(_variant(micro, tmp_path, "Another-Name")) == fp
    assert model_fingerprint(resolve_model("tiny-llama")).split(":")[1] != weights


def test_other_weights_of_the_same_shapes_change_the_weights_part(micro, tmp_path):
    """A fine-tune of one layer's projection: same config, tokenizer, file size and header."""
    fp = model_fingerprint(micro)
    copy = _variant(micro, tmp_path)
    tensors = load_file(copy / "model.safetensors")
    name = next(n for n in sorted(tensors) if n.endswith("self_attn.q_proj.weight"))
    tensors[name] = tensors[name] + 0.01
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    size = (micro / "model.safetensors").stat().st_size
    assert (copy / "model.safetensors").stat().st_size == size
    files, weights = model_fingerprint(copy).split(":")
    assert files == fp.split(":")[0] and weights != fp.split(":")[1]


def test_a_small_tensor_is_read_whole(micro, tmp_path):
    """A norm's weight changed in one element, none of the three a large tensor samples."""
    fp = model_fingerprint(micro)
    copy = _variant(micro, tmp_path)
    tensors = load_file(copy / "model.safetensors")
    name = next(n for n in sorted(tensors) if n.endswith("input_layernorm.weight"))
    assert 3 * 64 < tensors[name].numel() * tensors[name].element_size() <= 16 * 1024
    tensors[name][20] += 1.0  # bytes 80-83: after the start's 64, before the middle
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    assert model_fingerprint(copy) != fp


def test_tokenizer_and_config_change_the_files_part_and_chat_templates_do_not(micro, tmp_path):
    fp_files = model_fingerprint(micro).split(":")[0]
    copy = _variant(micro, tmp_path)
    (copy / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert model_fingerprint(copy).split(":")[0] == fp_files
    config = json.loads((copy / "config.json").read_text())
    config["rope_theta"] = config.get("rope_theta", 10000.0) * 2
    (copy / "config.json").write_text(json.dumps(config))
    assert model_fingerprint(copy).split(":")[0] != fp_files


def test_a_chat_template_in_the_tokenizer_config_and_what_tools_write_change_nothing(
        micro, tmp_path):
    """Routers render chat templates (their own, named apart), so a worker whose template was
    fixed first is the same model; so is a copy re-saved by another tool or version."""
    fp = model_fingerprint(micro)
    copy = _variant(micro, tmp_path)
    tok = json.loads((copy / "tokenizer_config.json").read_text())
    tok["chat_template"] = "{{ messages[-1]['content'] }}"
    (copy / "tokenizer_config.json").write_text(json.dumps(tok, indent=4))
    config = json.loads((copy / "config.json").read_text())
    config["transformers_version"] = "9.9.9"
    (copy / "config.json").write_text(json.dumps(dict(reversed(list(config.items())))))
    tensors = load_file(copy / "model.safetensors")
    save_file(tensors, copy / "model.safetensors", metadata={"converted_by": "another tool"})
    assert model_fingerprint(copy) == fp
    tok["eos_token"] = "<unk>"  # a setting that is the model's: another model
    (copy / "tokenizer_config.json").write_text(json.dumps(tok))
    assert model_fingerprint(copy) != fp


def test_the_generation_config_is_part_of_the_model(micro, tmp_path):
    """Its eos ids stop every worker's outputs: two copies that stop on other tokens differ."""
    fp = model_fingerprint(micro)
    copy = _variant(micro, tmp_path)
    path = copy / "generation_config.json"
    gen = json.loads(path.read_text()) if path.exists() else {}
    gen["eos_token_id"] = [2, 5]
    path.write_text(json.dumps(gen))
    assert model_fingerprint(copy).split(":")[0] != fp.split(":")[0]


def test_a_folder_without_weights_has_an_empty_weights_part(micro, tmp_path):
    copy = _variant(micro, tmp_path)
    (copy / "model.safetensors").unlink()
    assert model_fingerprint(copy) == model_fingerprint(micro).split(":")[0] + ":"


@pytest.mark.parametrize("content, match", [
    (b"\x01", "no header"),
    (struct.pack("<Q", 1 << 40) + b"{}", "no header"),
    (struct.pack("<Q", 4) + b"\xff\xfe{}", "unreadable safetensors header"),
    (struct.pack("<Q", 2) + b"[]", "not an object"),
    (struct.pack("<Q", 40) + json.dumps({"w": {"data_offsets": [5, 1]}}).encode().ljust(40),
     "no valid data_offsets"),
])
def test_weights_that_are_not_safetensors_are_refused(micro, tmp_path, content, match):
    copy = _variant(micro, tmp_path)
    (copy / "model.safetensors").write_bytes(content)
    with pytest.raises(ValueError, match=match):
        model_fingerprint(copy)


def _info(model: str, fingerprint: str) -> common_pb2.WorkerInfo:
    return common_pb2.WorkerInfo(worker_id="w", model=model, model_fingerprint=fingerprint)


@pytest.mark.parametrize("router, worker, why", [
    # Weights known on both sides decide, whatever the names.
    (("m", "f1:w1"), ("/elsewhere/other-name", "f1:w1"), ""),
    (("m", "f1:w1"), ("m", "f1:w2"), "weights differ"),
    # Config or tokenizer files that differ make it foreign, whatever else.
    (("m", "f1:w1"), ("m", "f2:w1"), "config or tokenizer files differ"),
    (("m", "f1:"), ("m", "f2:w1"), "config or tokenizer files differ"),
    # A router without weights, or a worker without a fingerprint: the names decide.
    (("m", "f1:"), ("M/", "f1:w1"), ""),
    (("m", "f1:"), ("other", "f1:w1"), "name differs"),
    (("/models/m", "f1:w1"), ("m", ""), ""),
    (("m", "f1:w1"), ("other", ""), "name differs"),
    (("", ""), ("anything", "f9:w9"), ""),
])
def test_which_workers_serve_the_routers_model(router, worker, why):
    got = model_mismatch(*router, _info(*worker))
    assert (why in got and got != "") if why else got == ""


def _identity(name: str, fingerprint: str, chat_template: str = "t1") -> router_pb2.ModelIdentity:
    return router_pb2.ModelIdentity(name=name, fingerprint=fingerprint,
                                    chat_template=chat_template)


@pytest.mark.parametrize("expected, chat, why", [
    (("m", "f1:w1"), False, ""),
    (("/copy/elsewhere", "f1:w1"), True, ""),
    (("m", "f1:w2"), False, "weights differ"),
    (("m", "f2:w1"), False, "config or tokenizer files differ"),
    # A router given only the tokenizer on either side: the names decide.
    (("other", "f1:"), False, "names differ"),
    (("M/", "f1:"), False, ""),
    # The chat template made a chat's prompt, and nothing else's.
    (("m", "f1:w1", "t2"), True, "chat templates differ"),
    (("m", "f1:w1", "t2"), False, ""),
    (("m", "f1:w1", ""), True, "chat templates differ"),
    # What a client left empty checks nothing.
    (("", "", "t1"), False, ""),
])
def test_which_streams_a_router_may_go_on_with(expected, chat, why):
    got = expected_model_mismatch(_identity("m", "f1:w1"), _identity(*expected), chat)
    assert (why in got and "another model than the request expects" in got) if why else got == ""


def test_the_expected_model_is_quoted_cut_in_the_refusal():
    got = expected_model_mismatch(_identity("m", "f1:"), _identity("x" * 10_000, "f1:"), False)
    assert "names differ" in got and len(got) < 300


def test_pdserve_info_compares_routers_as_a_router_compares_streams():
    from client import ModelIdentity
    from engine.cli_remote import _models_differ

    def differ(*idents) -> bool:
        return _models_differ([ModelIdentity(*i) if i else None for i in idents])

    assert not differ(("a", "f:w", "t"), ("copy-of-a", "f:w", "t"))  # weights decide
    assert differ(("a", "f:w", "t"), ("a", "f:w2", "t"))
    assert differ(("a", "f:w", "t"), ("a", "f:w", "t2"))  # a chat would be refused
    assert differ(("a", "f:", "t"), ("b", "f:", "t"))  # no weights: the names decide
    # A router with only the tokenizer and one with the weights, of one name and files: a
    # router takes the other's streams, so they do not differ.
    assert not differ(("a", "f:", "t"), ("a", "f:w", "t"))
    assert differ(("a", "f:", "t"), ("a", "f2:w", "t"))  # other files: other token ids
    # One that differs from the second only, and a router older than identities (None).
    assert differ(("a", "f:w", "t"), ("a", "f:w", "t"), ("a", "f:w3", "t"))
    assert not differ(("a", "f:w", "t"), None, ("a", "f:w", "t"))
