"""A checkpoint's generation_config.json as the sampling defaults (engine/generation_defaults.py):
read and checked, in the offline LLM, and through a cluster (router -> prefill -> decode) whose
model recommends greedy decoding with a repetition penalty."""
from __future__ import annotations

import json

import pytest

from client import Client
from engine import LLM, SamplingParams
from engine.generation_defaults import check_generation_config, load_sampling_defaults
from protos import common_pb2, convert
from router.launcher import Cluster, ClusterSpec
from tests.serving_helpers import WORKER_ARGS, wait_all_blocks_free
from tests.test_sampling_rules import PROMPTS  # the second one's output shows the penalty

RECOMMENDED = {"do_sample": True, "top_k": 1, "repetition_penalty": 1.8, "max_new_tokens": 32,
               "bos_token_id": 8189, "eos_token_id": 8190}
AS_PARAMS = dict(top_k=1, repetition_penalty=1.8, max_tokens=32)


def _folder_with(tmp_path, preset_path, generation_config: dict):
    """tiny-llama's files, but this generation_config.json."""
    src = preset_path("tiny-llama")
    out = tmp_path / "tiny-llama-recommended"
    out.mkdir()
    for f in src.iterdir():
        if f.name != "generation_config.json":
            (out / f.name).symlink_to(f)
    (out / "generation_config.json").write_text(json.dumps(generation_config))
    return out


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory, preset_path):
    return _folder_with(tmp_path_factory.mktemp("model"), preset_path, RECOMMENDED)


def test_defaults_are_the_sampling_fields_the_file_sets(tmp_path, model_folder):
    assert load_sampling_defaults("auto", model_folder) == AS_PARAMS
    assert load_sampling_defaults("engine", model_folder) == {}
    assert load_sampling_defaults(str(model_folder), tmp_path) == AS_PARAMS
    assert load_sampling_defaults("auto", tmp_path) == {}  # no file: no defaults
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 0, "min_p": 0.0}))
    assert load_sampling_defaults("auto", tmp_path) == dict(temperature=0.6, top_p=0.95,
                                                            top_k=-1, min_p=0.0)


@pytest.mark.parametrize("content, match", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    ('{"top_p": 0.0}', "generation_config.json: top_p must be in"),
    ('{"temperature": "hot"}', "temperature"),
])
def test_a_bad_generation_config_is_refused(tmp_path, content, match):
    (tmp_path / "generation_config.json").write_text(content)
    with pytest.raises(ValueError, match=match):
        load_sampling_defaults("auto", tmp_path)


@pytest.mark.parametrize("content, match", [
    ('{"max_new_tokens": 4294967296}', "generation_config.json: .*out of range"),
    ('{"top_k": 600}', "generation_config.json: top_k 600 exceeds the vocabulary size 512"),
])
def test_a_default_no_request_could_carry_is_refused_at_load(tmp_path, content, match):
    """Checked only by the engine's rules, these loaded, then every request that left the
    field unset failed INVALID_ARGUMENT (the router's fill of a proto int32, the workers'
    vocabulary check), and GetModelInfo failed outright."""
    (tmp_path / "generation_config.json").write_text(content)
    with pytest.raises(ValueError, match=match):
        load_sampling_defaults("auto", tmp_path, vocab_size=512)


def test_check_generation_config(tmp_path):
    with pytest.raises(ValueError, match="'auto', 'engine' or a folder"):
        check_generation_config(str(tmp_path))
    with pytest.raises(ValueError, match="'auto', 'engine' or a folder"):
        check_generation_config("greedy")


def test_fill_sampling_defaults_keeps_what_the_request_set():
    msg = common_pb2.SamplingParams(max_tokens=5, top_k=-1)
    convert.fill_sampling_defaults(msg, AS_PARAMS)
    params = convert.sampling_from_proto(msg)
    assert (params.max_tokens, params.top_k, params.repetition_penalty) == (5, -1, 1.8)


def test_the_offline_llm_takes_the_models_defaults(model_folder, reference):
    prompt = PROMPTS[1]
    want = reference.generate([prompt], SamplingParams(**AS_PARAMS))[0]
    plain = reference.generate([prompt], SamplingParams(max_tokens=32, temperature=0.0))[0]
    assert want.token_ids != plain.token_ids  # the penalty shows
    with LLM(str(model_folder), num_gpu_blocks=64) as llm:
        assert llm.default_sampling_params() == SamplingParams(**AS_PARAMS)
        assert llm.generate([prompt])[0].token_ids == want.token_ids
    with LLM(str(model_folder), generation_config="engine", num_gpu_blocks=64) as llm:
        assert llm.default_sampling_params() == SamplingParams()


@pytest.fixture(scope="module")
def cluster(model_folder):
    spec = ClusterSpec(model=str(model_folder), worker_args=WORKER_ARGS,
                       router_args=["--max-local-prefill-length", "0"])
    with Cluster(spec) as c:
        yield c


def test_the_router_fills_the_models_defaults_for_both_workers(cluster, reference):
    with Client(cluster.router_address, timeout=60) as c:
        for prompt in PROMPTS:
            want = reference.generate([prompt], SamplingParams(**AS_PARAMS))[0]
            got = c.complete(prompt)
            assert got.token_ids == want.token_ids
            assert got.usage.prefill_worker_id.startswith("prefill-")
            # What the request sets wins.
            mine = c.complete(prompt, max_tokens=30, repetition_penalty=1.0)
            plain = reference.generate([prompt], SamplingParams(max_tokens=30, top_k=1))[0]
            assert mine.token_ids == plain.token_ids
    assert got.token_ids[:30] != plain.token_ids  # PROMPTS[1]: the penalty shows
    with Client(cluster.router_address, timeout=60) as c:
        assert c.model_info().sampling_defaults == AS_PARAMS
    wait_all_blocks_free([p.address for p in cluster.procs if p.name != "router"])


def test_cli_flags_win_then_the_models_defaults_then_greedy():
    from engine.cli import build_parser, sampling_kwargs

    args = build_parser().parse_args(["generate", "--prompt", "x"])
    assert sampling_kwargs(args, {}) == dict(max_tokens=64, temperature=0.0)
    # The model's recommendations are left unset, for the router or engine to fill.
    assert sampling_kwargs(args, AS_PARAMS) == dict(temperature=0.0)
    assert sampling_kwargs(args, {"temperature": 0.6}) == dict(max_tokens=64)
    args = build_parser().parse_args(["generate", "--prompt", "x", "--max-tokens", "3",
                                      "--temperature", "0.7", "--repetition-penalty", "1.0"])
    assert sampling_kwargs(args, AS_PARAMS) == dict(max_tokens=3, temperature=0.7,
                                                    repetition_penalty=1.0)


def test_pdserve_generate_samples_as_the_model_recommends(cluster, model_folder, reference,
                                                         capsys):
    from engine.cli import main

    prompt = "Paged attention stores the KV cache"
    want = reference.generate([prompt], SamplingParams(**AS_PARAMS))[0]
    # The model's max_new_tokens, not the CLI's 64, ends the output.
    assert len(want.token_ids) == AS_PARAMS["max_tokens"] < 64
    assert main(["generate", "--model", str(model_folder), "--num-gpu-blocks", "64",
                 "--prompt", prompt]) == 0
    assert capsys.readouterr().out == want.text + "\n"
    assert main(["generate", "--router", cluster.router_address, "--prompt", prompt]) == 0
    out = capsys.readouterr()
    # The text alone on stdout (`> file`); the figures on stderr, as chat's.
    assert out.out == want.text + "\n"
    assert out.err.startswith(f"[{len(want.token_ids)} tokens")
