"""--tokenizer: a model folder without tokenizer files served with a tokenizer from another
folder, by the in-process engine, a real router and workers, and the CLI's refusals."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from client import Client
from engine import LLM, SamplingParams
from engine.cli import main
from engine.model_fingerprint import model_fingerprint
from router.launcher import Cluster, ClusterSpec
from router.model_match import model_mismatch
from protos import common_pb2
from tests.serving_helpers import worker_info

GREEDY = dict(temperature=0.0, ignore_eos=True)
BLOCKS = ["--num-gpu-blocks", "64"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
PROMPTS = ["The quick brown fox", "Paged attention stores the KV cache in blocks so that"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory, preset_path) -> dict[str, str]:
    """``bare``: tiny-llama without tokenizer files (its weights a link); ``tok``: its
    tokenizer alone; ``other_eos``: that tokenizer with another eos; ``empty``: no files."""
    src = preset_path("tiny-llama")
    root = tmp_path_factory.mktemp("tokflag")
    bare, tok, other, empty = (root / n for n in ("bare", "tok", "other_eos", "empty"))
    for folder in (bare, tok, other, empty):
        folder.mkdir()
    for name in ("config.json", "generation_config.json"):
        shutil.copy(src / name, bare / name)
    os.symlink(src / "model.safetensors", bare / "model.safetensors")
    for name in TOKENIZER_FILES:
        shutil.copy(src / name, tok / name)
        shutil.copy(src / name, other / name)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        config = json.loads((other / name).read_text())
        config["eos_token"] = config["pad_token"]
        (other / name).write_text(json.dumps(config))
    return {"src": str(src), "bare": str(bare), "tok": str(tok), "other_eos": str(other),
            "empty": str(empty)}


@pytest.fixture(scope="module")
def offline(folders):
    with LLM(folders["bare"], tokenizer=folders["tok"], num_gpu_blocks=64) as llm:
        yield llm


def test_the_engine_serves_text_with_the_chosen_tokenizer(offline, folders):
    """The same ids and text as the model with its own tokenizer files; its eos stops."""
    params = SamplingParams(max_tokens=8, **GREEDY)
    got = offline.generate(PROMPTS, params)
    with LLM(folders["src"], num_gpu_blocks=64) as own:
        want = own.generate(PROMPTS, params)
        assert offline.engine.model_config.eos_token_ids == own.engine.model_config.eos_token_ids
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.text for o in got] == [o.text for o in want] and got[0].text
    assert offline.tokenizer.folder == Path(folders["tok"])


def test_the_chosen_tokenizers_eos_stops(folders):
    """engine/model_config.py with_tokenizer_eos takes the --tokenizer's eos, not none."""
    with LLM(folders["bare"], tokenizer=folders["other_eos"], num_gpu_blocks=16) as llm:
        pad = llm.tokenizer.eos_token_id
        assert llm.tokenizer.pad_token_id == pad
        assert pad in llm.engine.model_config.eos_token_ids


@pytest.mark.parametrize("which, message", [
    ("missing", "is not a folder"), ("empty", "holds no tokenizer files"),
])
def test_a_tokenizer_folder_without_a_tokenizer_is_refused(folders, which, message):
    path = folders.get(which, folders["src"] + "-no-such-folder")
    with pytest.raises(ValueError, match=message):
        LLM(folders["bare"], tokenizer=path, num_gpu_blocks=16)


def test_a_tokenizer_with_more_ids_than_the_model_is_refused(folders, tmp_path):
    """Ids at or past the model's vocab_size would index outside its embedding."""
    big = shutil.copytree(folders["tok"], tmp_path / "big")
    tok = json.loads((big / "tokenizer.json").read_text())
    n = max(t["id"] for t in tok["added_tokens"]) + 1
    tok["added_tokens"].append({"id": n, "content": "<|extra|>", "single_word": False,
                                "lstrip": False, "rstrip": False, "normalized": False,
                                "special": True})
    (big / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match=r"more than the model's vocab_size 8192"):
        LLM(folders["bare"], tokenizer=str(big), num_gpu_blocks=16)
    assert main(["up", "--model", folders["bare"], "--tokenizer", str(big), "--port", "0",
                 "--prefill", "0"]) == 2
    # The model's own folder named as --tokenizer is taken as without the flag, where a
    # tokenizer with extra added ids past the embedding loads.
    from engine.tokenizer_choice import load_model_tokenizer
    assert load_model_tokenizer(big, None, 8192).vocab_size == n + 1
    assert load_model_tokenizer(big, f"{big}/.", 8192).vocab_size == n + 1


def test_the_fingerprint_digests_the_tokenizer_served(folders):
    """One tokenizer in the model's folder or another: one fingerprint. Another tokenizer:
    files that differ, so the router leaves such a worker out (router/model_match.py)."""
    own = model_fingerprint(Path(folders["src"]))
    assert model_fingerprint(Path(folders["bare"]), Path(folders["tok"])) == own
    other = model_fingerprint(Path(folders["bare"]), Path(folders["other_eos"]))
    assert other.split(":")[1] == own.split(":")[1] and other != own
    info = common_pb2.WorkerInfo(model="bare", model_fingerprint=other)
    assert "config or tokenizer files differ" in model_mismatch("bare", own, info)
    # Without --tokenizer the bare folder's fingerprint has no tokenizer in it either.
    assert model_fingerprint(Path(folders["bare"])) != own


def test_the_router_says_what_a_model_without_a_tokenizer_needs(folders):
    from router.prompts import load_served_model

    with pytest.raises(ValueError, match="which the router needs: pass --tokenizer FOLDER"):
        load_served_model(folders["bare"], "auto", None)
    served = load_served_model(folders["bare"], "auto", None, tokenizer=folders["tok"])
    own = load_served_model(folders["src"], "auto", None)
    assert (served.eos_token_ids, served.fingerprint) == (own.eos_token_ids, own.fingerprint)
    other = load_served_model(folders["bare"], "auto", None, tokenizer=folders["other_eos"])
    assert other.eos_token_ids != own.eos_token_ids
    with pytest.raises(ValueError, match="holds no tokenizer files"):
        load_served_model(folders["bare"], "auto", None, tokenizer=folders["empty"])


def test_cli_refusals(folders, capsys):
    """Exit 2 with the reason, before any service or engine starts."""
    assert main(["up", "--model", folders["bare"], "--tokenizer", folders["empty"],
                 "--port", "0"]) == 2
    assert "holds no tokenizer files" in capsys.readouterr().err
    assert main(["generate", "--model", folders["bare"], "--tokenizer", folders["empty"],
                 "--prompt", "x", *BLOCKS]) == 2
    assert "holds no tokenizer files" in capsys.readouterr().err
    assert main(["chat", "--model", folders["bare"], *BLOCKS]) == 2
    assert "has no tokenizer, so no chat template" in capsys.readouterr().err
    # A router's workers run with their own tokenizer: not a flag a remote call takes.
    assert main(["generate", "--router", "127.0.0.1:1", "--tokenizer", folders["tok"],
                 "--prompt", "x"]) == 2
    assert "engine flags (tokenizer)" in capsys.readouterr().err


def test_generate_offline_with_the_tokenizer_flag(folders, offline, capsys):
    assert main(["generate", "--model", folders["bare"], "--tokenizer", folders["tok"],
                 "--prompt", PROMPTS[0], "--max-tokens", "6", *BLOCKS]) == 0
    want = offline.generate([PROMPTS[0]], SamplingParams(max_tokens=6, temperature=0.0))[0]
    assert capsys.readouterr().out == want.text + "\n"


def test_a_cluster_with_the_tokenizer_flag_equals_the_engine(folders, offline):
    """A real router and workers, each given --tokenizer as pdserve up gives it: the same
    ids and text as the in-process engine with that tokenizer, and one fingerprint; a worker
    given another tokenizer is left out."""
    tok = ["--tokenizer", folders["tok"]]
    spec = ClusterSpec(model=folders["bare"], num_prefill=1, num_decode=1,
                       worker_args=[*BLOCKS, *tok], router_args=tok)
    params = SamplingParams(max_tokens=8, **GREEDY)
    want = offline.generate(PROMPTS, params)
    with Cluster(spec) as cluster, Client(cluster.router_address, timeout=60) as c:
        for prompt, ref in zip(PROMPTS, want):
            res = c.complete(prompt, max_tokens=8, **GREEDY)
            assert (res.token_ids, res.text) == (ref.token_ids, ref.text)
        fingerprint = c.model_info().identity.fingerprint
        workers = [p for p in cluster.procs if p.name.startswith(("prefill", "decode"))]
        assert [worker_info(p.address).model_fingerprint for p in workers] == \
            [fingerprint] * 2
        # A worker given another tokenizer (another eos: other stop ids, other text) is one
        # the router sends nothing.
        other = cluster.add_worker("decode", extra=["--tokenizer", folders["other_eos"]])
        try:
            with pytest.raises(RuntimeError, match="config or tokenizer files differ"):
                cluster.wait_listed(other)
        finally:
            assert cluster.stop_proc(other) == 0
    assert fingerprint == model_fingerprint(Path(folders["src"]))


def test_up_gives_every_service_the_tokenizer_folder(folders, monkeypatch):
    """As an absolute path: the services may start in another working directory."""
    from engine.cli import build_parser
    from engine.cli_serve import _router_config, _worker_config
    from engine.cli_up import up_spec

    monkeypatch.chdir(Path(folders["tok"]).parent)
    spec = up_spec(build_parser(benchmarks=False).parse_args(
        ["up", "--model", folders["bare"], "--tokenizer", "tok"]))
    assert spec.worker_args == ["--tokenizer", folders["tok"]]
    router = _router_config(build_parser(benchmarks=False).parse_args(
        ["router", "--redis-url", "redis://x", *spec.router_flags()]))
    assert router.tokenizer == folders["tok"]
    for role in ("prefill", "decode"):
        worker = _worker_config(build_parser(benchmarks=False).parse_args(
            [role, *spec.engine_args(role, [])]), role)
        assert worker.engine.tokenizer == folders["tok"]


@pytest.mark.parametrize("bench", ["serve", "failover", "soak"])
def test_benchmarks_take_the_tokenizer_flag(bench, folders, monkeypatch):
    """The benchmarks that compare a cluster with the in-process engine give both the folder."""
    import argparse
    import importlib

    module = importlib.import_module(f"bench.{bench}")
    p = argparse.ArgumentParser()
    module.add_args(p)
    monkeypatch.chdir(Path(folders["tok"]).parent)
    args = p.parse_args(["--model", folders["bare"], "--tokenizer", "tok"])
    if bench == "serve":
        assert module.config_from_args(args).tokenizer == folders["tok"]
    else:
        from engine.cli_serve import tokenizer_flags

        assert tokenizer_flags(args.tokenizer) == ["--tokenizer", folders["tok"]]
