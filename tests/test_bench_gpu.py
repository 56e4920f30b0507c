"""``pdserve bench gpu``: a tiny CPU run end to end (keys, counts, positive rates), the argument
checks, and on CUDA the kernel-bandwidth part at tiny shapes. No timing asserts."""
from __future__ import annotations

import json

import pytest
import torch

from bench import gpu
from bench.gpu_parts import W1_REFERENCE_TOK_S, w1_requests
from engine.cli import build_parser
from engine.cli import main as cli_main

_TINY_CPU = ["bench", "gpu", "--device", "cpu", "--model", "tiny-llama", "--dtype", "float32",
             "--decode-batches", "1,2", "--graph-batches", "2", "--prompt-len", "8",
             "--output-len", "4", "--num-seqs-w1", "4", "--w1-min-len", "4", "--w1-max-len", "8",
             "--json"]


def test_cpu_smoke_run_reports_every_part(capsys, tmp_path):
    out_file = tmp_path / "gpu.json"
    assert cli_main(_TINY_CPU + ["--json-out", str(out_file)]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res == json.loads(out_file.read_text())
    assert res["env"]["device"] == "cpu" and res["env"]["torch_version"] == torch.__version__
    assert [r["batch"] for r in res["decode"]] == [1, 2]
    for r in res["decode"]:
        assert (r["prompt_len"], r["output_len"]) == (8, 4)
        assert r["engine_decode_tok_s"] > 0 and r["hf_decode_tok_s"] > 0
        assert r["ratio_vs_hf"] == pytest.approx(r["engine_decode_tok_s"] / r["hf_decode_tok_s"])
    w1 = res["w1"]
    _, outs = w1_requests(4, 4, 8, 8192, 0)
    assert (w1["num_seqs"], w1["output_tokens"]) == (4, sum(outs))
    assert w1["output_tok_s"] > 0 and w1["reference_tok_s"] == W1_REFERENCE_TOK_S
    assert w1["fraction_of_reference"] == pytest.approx(w1["output_tok_s"] / W1_REFERENCE_TOK_S)
    # Off CUDA the graphs part runs eager only and the kernel part is skipped, saying why.
    [g] = res["graphs"]
    assert g["batch"] == 2 and g["eager_decode_tok_s"] > 0
    assert g["graph_decode_tok_s"] is None and g["ratio"] is None
    assert res["kernel"] is None and "CUDA" in res["skipped"]["kernel"]
    assert res["errors"] == {}


def test_a_failing_part_is_reported_and_the_rest_still_runs(capsys, monkeypatch):
    from bench import gpu_parts

    def boom(*a, **k):
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(gpu_parts, "run_decode", boom)
    argv = ["bench", "gpu", "--device", "cpu", "--model", "tiny-llama", "--only",
            "decode,kernel", "--json"]
    assert cli_main(argv) == 1
    res = json.loads(capsys.readouterr().out)
    assert res["decode"] is None and "simulated" in res["errors"]["decode"]
    assert "kernel" in res["skipped"]


def test_the_json_holds_each_part_as_soon_as_it_ends(capsys, monkeypatch, tmp_path):
    # A lease's time limit kills the run mid-way: what it measured before must be on disk.
    from bench import gpu_parts

    out_file = tmp_path / "gpu.json"
    seen = {}

    def w1(*a, **k):
        seen.update(json.loads(out_file.read_text()))
        raise RuntimeError("killed (simulated)")

    monkeypatch.setattr(gpu_parts, "run_w1", w1)
    argv = _TINY_CPU + ["--only", "graphs,w1", "--json-out", str(out_file)]
    assert cli_main(argv) == 1
    capsys.readouterr()
    assert seen["graphs"][0]["eager_decode_tok_s"] > 0 and seen["w1"] is None
    assert "simulated" in json.loads(out_file.read_text())["errors"]["w1"]


@pytest.mark.parametrize("replays", [0, None])
def test_a_graph_run_that_replayed_no_graph_fails_the_part(replays, monkeypatch):
    from types import SimpleNamespace

    from bench import gpu_parts

    timing = SimpleNamespace(decode_tok_s=100.0)
    monkeypatch.setattr(gpu_parts, "_engine_decode",
                        lambda opts, vocab, batches, enforce_eager:
                        {b: (timing, None if enforce_eager else replays) for b in batches})
    monkeypatch.setattr(gpu_parts, "free_device_memory", lambda: None)
    opts = SimpleNamespace(graph_batches=[1, 8], on_cuda=True)
    with pytest.raises(RuntimeError, match="replayed no graph at batch 1"):
        gpu_parts.run_graphs(opts, 8192, lambda msg: None)
    monkeypatch.setattr(gpu_parts, "_engine_decode",
                        lambda opts, vocab, batches, enforce_eager:
                        {b: (timing, None if enforce_eager else 5) for b in batches})
    assert [r.graph_replays for r in gpu_parts.run_graphs(opts, 8192, lambda msg: None)] == [5, 5]


def test_w1_draws_match_nano_vllm():
    # nano-vllm's README reports 133,966 output tokens for its seed-0 workload.
    prompts, outs = w1_requests(256, 100, 1024, 151936, 0)
    assert sum(outs) == 133_966
    assert all(100 <= len(p) <= 1024 for p in prompts) and all(100 <= n <= 1024 for n in outs)


@pytest.mark.parametrize("extra", [
    ["--only", "decode,bogus"], ["--device", "tpu"], ["--output-len", "1"],
    ["--decode-batches", "1,x"], ["--graph-batches", "0"], ["--kernel-shapes", "64by1024"],
    ["--w1-min-len", "10", "--w1-max-len", "5"], ["--kernel-block-size", "12"],
    ["--gpu-memory-utilization", "1.5"],
])
def test_bad_options_raise_value_error(extra):
    args = build_parser().parse_args(["bench", "gpu", *extra])
    with pytest.raises(ValueError):
        gpu.parse_options(args)


def test_defaults_are_the_gpu_suite():
    opts = gpu.parse_options(build_parser().parse_args(["bench", "gpu"]))
    assert opts.parts == gpu.PARTS and opts.device == "cuda" and opts.dtype == "bfloat16"
    assert opts.model == "qwen3-0.6b-shape" and opts.num_seqs_w1 == 256
    assert opts.w1_len_range == (100, 1024) and opts.decode_batches == (1, 64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_bandwidth_part_on_cuda(capsys):
    # 1 x 600 spans two partitions, so the split-K reduce runs too.
    assert cli_main(["bench", "gpu", "--only", "kernel", "--model", "tiny-llama",
                     "--kernel-shapes", "2x64,1x600", "--kernel-reps", "3", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["decode"] is None and res["w1"] is None and res["graphs"] is None
    assert [(r["batch"], r["context"]) for r in res["kernel"]] == [(2, 64), (1, 600)]
    for r in res["kernel"]:
        assert r["kernel_gbps"] > 0 and r["copy_gbps"] > 0 and r["kv_mib"] > 0
    assert res["env"]["device_name"] == torch.cuda.get_device_name()
