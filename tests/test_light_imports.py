"""The control plane's processes do not import torch: client-side commands start in a fraction
of a second, and `pdserve up`, which runs as long as its cluster, stays small."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def _run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def test_client_side_modules_and_commands_leave_torch_unloaded(preset_path):
    model = preset_path("tiny-llama")  # built here: building a preset takes torch
    out = _run("""
import sys
import client, engine, kernels, protos.convert, router.admin, router.launcher
import engine.cli, engine.cli_admin, engine.cli_chat, engine.cli_serve, engine.grpc_server
import engine.cli_remote, engine.cli_up
import engine.generation_defaults, engine.model_config, engine.outputs, engine.tokenizer
from engine.cli import main
for argv in (["admin", "--help"], ["generate", "--help"], ["up", "--help"]):
    try:
        main(argv)
    except SystemExit as e:
        assert e.code == 0, (argv, e.code)
assert main(["info", "--router", "127.0.0.1:1", "--timeout", "0.5"]) == 1  # nobody there
# What `pdserve up` does before it starts anything: checks every service's flags.
from engine.cli import build_parser
from engine.cli_up import up_spec
up_spec(build_parser(benchmarks=False).parse_args(["up", "--port", "0", "--model", MODEL]))
print("TORCH", "torch" in sys.modules)
""".replace("MODEL", repr(str(model))))
    assert out.strip().splitlines()[-1] == "TORCH False"


def test_a_launcher_that_found_no_gpu_keeps_torch_out():
    # The launcher asks a short-lived process for the GPUs, and plans for the CPU here.
    out = _run("""
import sys
from router.launcher import ClusterSpec, cuda_device_count
spec = ClusterSpec()
print("PLAN", cuda_device_count(), spec.gpu_plan(), "torch" in sys.modules)
""")
    import torch

    expected = torch.cuda.device_count()
    if expected:
        pytest.skip("this host has GPUs: the plan places workers on them")
    assert out.strip().splitlines()[-1] == "PLAN 0 None False"


def test_the_launcher_asks_torch_for_gpus_only_where_a_gpu_device_node_exists(tmp_path):
    """No device node: no GPU, and no probe importing torch beside the starting services. A
    node: the probe's answer, whatever it is."""
    node = tmp_path / "nvidiactl"
    node.write_text("")
    out = _run(f"""
import subprocess, sys
from router import cluster_spec
probes = []
subprocess.run = lambda *a, **k: probes.append(a) or subprocess.CompletedProcess(a, 0, "3\\n", "")
cluster_spec.GPU_DEVICE_NODES = ("/nonexistent/nvidiactl",)
print("NONE", cluster_spec.cuda_device_count(), len(probes))
cluster_spec.cuda_device_count.cache_clear()
cluster_spec.GPU_DEVICE_NODES = ("/nonexistent/kfd", {str(node)!r})
print("NODE", cluster_spec.cuda_device_count(), len(probes), "torch" in sys.modules)
""")
    assert out.split("\n")[-3:-1] == ["NONE 0 0", "NODE 3 1 False"]


def test_the_engine_packages_names_load_when_first_used():
    out = _run("""
import sys
import engine, kernels
assert "torch" not in sys.modules
from engine import LLM, SamplingParams
from kernels import TorchAttentionBackend, get_attention_backend
assert "torch" in sys.modules
assert isinstance(get_attention_backend("torch"), TorchAttentionBackend)
assert SamplingParams(max_tokens=3).max_tokens == 3
for package, name in ((engine, "NotAName"), (kernels, "NotAName")):
    try:
        getattr(package, name)
    except AttributeError as e:
        assert name in str(e)
    else:
        raise AssertionError(name)
print("OK", LLM.__name__)
""")
    assert out.strip().splitlines()[-1] == "OK LLM"


def test_a_router_whose_tokenizer_is_cached_leaves_torch_unloaded(preset_path):
    from engine.tokenizer import load_tokenizer

    path = preset_path("tiny-llama")
    load_tokenizer(path)  # the snapshot is cached now, if no earlier test did it
    out = _run(f"""
import sys
from router.prompts import load_served_model
model = load_served_model({str(path)!r}, "auto", None)
assert model.has_chat_template and model.tokenizer.hf is None
print("TORCH", "torch" in sys.modules, "transformers.tokenization_utils_base" in sys.modules)
""")
    assert out.strip().splitlines()[-1] == "TORCH False False"


def test_a_tp_ranks_death_reaches_an_engine_process_worker_without_importing_torch():
    # The worker reads its engine process's messages on its event loop: a class it unpickles
    # from a module that imports torch imported torch there, and for that second and more the
    # loop read nothing else and answered no health check (the death reported that late).
    from engine.engine_pipe import frame
    from engine.engine_proc import portable
    from engine.executor_error import ExecutorError

    import torch

    dead = frame(("dead", portable(ExecutorError("tensor-parallel rank 1 died"))))
    oom = frame(("dead", portable(torch.OutOfMemoryError("CUDA out of memory"))))
    out = _run(f"""
import socket, sys
from engine.engine_client import EngineProcess
from engine.engine_pipe import FrameReader
assert "torch" not in sys.modules
ours, theirs = socket.socketpair()
theirs.sendall(bytes.fromhex({dead.hex()!r}) + bytes.fromhex({oom.hex()!r}))
ours.setblocking(False)
for kind, e in FrameReader(ours).read_ready():
    print("GOT", kind, type(e).__name__, e)
print("TORCH", "torch" in sys.modules)
""")
    assert out.strip().splitlines()[-3:] == [
        "GOT dead ExecutorError tensor-parallel rank 1 died",
        "GOT dead RuntimeError OutOfMemoryError: CUDA out of memory", "TORCH False"]
