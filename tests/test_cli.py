"""The pdserve console script: make-model, demo, generate and the offline benchmark."""
import json
import subprocess
import sys

from engine.cli import main


def test_make_model_writes_a_loadable_folder(tmp_path):
    out = tmp_path / "m"
    proc = subprocess.run([sys.executable, "-m", "engine.cli", "make-model", "tiny-qwen2",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
    from engine import LLM, SamplingParams
    outs = LLM(str(out)).generate(["hello"], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(outs[0].token_ids) == 4


def test_unknown_preset_is_a_clean_error(capsys):
    assert main(["make-model", "no-such-preset", "--out", "/tmp/unused"]) == 2
    assert "no-such-preset" in capsys.readouterr().err


def test_demo_streams_text(capsys):
    assert main(["demo", "--max-tokens", "5"]) == 0
    out = capsys.readouterr().out
    assert out.count("[5 tokens, TTFT") == 4


def test_generate(capsys):
    assert main(["generate", "--prompt", "hi there", "--max-tokens", "6"]) == 0
    assert capsys.readouterr().out.strip()


def test_generate_tensor_parallel_matches_tp1(capsys):
    argv = ["generate", "--prompt", "hi there", "--max-tokens", "6"]
    assert main(argv) == 0
    tp1 = capsys.readouterr().out
    assert main(argv + ["-tp", "2"]) == 0
    assert capsys.readouterr().out == tp1


def test_bench_offline_json(capsys):
    assert main(["bench", "offline", "--workload", "tiny", "--num-requests", "2", "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("engine_tok_s", "hf_tok_s", "roofline_tok_s", "ratio_vs_hf", "ratio_vs_roofline"):
        assert res[key] > 0
    assert res["ratio_vs_hf"] == res["hf_s"] / res["engine_s"]
    assert res["linear_kernel"] in ("onednn", "mkl", "torch")
    # The model graph runs every step where the layers are on oneMKL and C kernels build.
    from kernels.cpu_decode import cpu_kernels_available
    graph_expected = res["linear_kernel"] == "mkl" and cpu_kernels_available()
    assert (res["cpu_graph_steps"] > 0) == graph_expected
