"""Flags of the serving commands (router, prefill, decode, up) that must be refused when the
configuration is built, before any model loads or any service starts, and the API keys `up`
hands its router."""
from __future__ import annotations

import os
import sys
import types

import pytest

from engine.cli import build_parser, main
from router.config import RouterConfig
from router.registry import check_namespace

KEY = "s3cret-key"
ADMIN_KEY = "0perator-key"


def _no_service(monkeypatch, module: str) -> None:
    """The service's main fails the test: a flag the config should refuse got past it."""
    def started(config):
        raise AssertionError(f"{module} started with {config!r}")

    monkeypatch.setitem(sys.modules, module, types.SimpleNamespace(main=started))


@pytest.mark.parametrize("namespace", ["a:b", ""])
@pytest.mark.parametrize("role, module, extra", [
    ("router", "router.server", []),
    ("prefill", "prefill_svc.server", ["--kv-transfer-backend", "torch"]),
    ("decode", "decode_svc.server", ["--kv-transfer-backend", "torch"]),
])
def test_a_bad_namespace_is_refused_before_anything_loads(role, module, extra, namespace,
                                                          monkeypatch, capsys):
    """Only the Registry refused one: the router's after its tokenizer loaded, a worker's
    after its engine did (minutes for a large model), with a traceback from the server."""
    _no_service(monkeypatch, module)
    assert main([role, "--namespace", namespace, "--redis-url", "redis://127.0.0.1:1/0",
                 "--port", "0", *extra]) == 2
    assert "namespace (--namespace) must be non-empty without ':'" in capsys.readouterr().err


@pytest.mark.parametrize("role, module", [("prefill", "prefill_svc.server"),
                                          ("decode", "decode_svc.server")])
def test_a_worker_refuses_a_kv_block_count_and_a_kv_budget_together(role, module, monkeypatch,
                                                                     capsys):
    """The block count sized the cache and the budget was ignored without a word."""
    _no_service(monkeypatch, module)
    assert main([role, "--port", "0", "--kv-transfer-backend", "torch", "--num-gpu-blocks",
                 "64", "--kv-cache-memory-gib", "2"]) == 2
    assert ("num_gpu_blocks (--num-gpu-blocks) 64 sets the KV cache's size exactly, "
            "kv_cache_memory_gib (--kv-cache-memory-gib) 2 sizes it from a budget: give one "
            "of them") in capsys.readouterr().err


def test_check_namespace_takes_what_the_registry_takes():
    assert check_namespace("pdserve") == "pdserve"
    for bad in ("", "a:b", None, 5):
        with pytest.raises(ValueError, match="--namespace"):
            check_namespace(bad)
    with pytest.raises(ValueError, match="--namespace"):
        RouterConfig(model="tiny-llama", redis_url="redis://h:1/0", namespace="x:")


@pytest.mark.parametrize("block_size", [24, 3, 0, -16, True])
def test_the_router_takes_only_a_block_size_a_worker_can_have(block_size, monkeypatch, capsys):
    with pytest.raises(ValueError, match=r"block_size \(--block-size\) must be a power of two"):
        RouterConfig(model="tiny-llama", redis_url="redis://h:1/0", block_size=block_size)
    if not isinstance(block_size, bool):
        _no_service(monkeypatch, "router.server")
        assert main(["router", "--redis-url", "redis://h:1/0",
                     "--block-size", str(block_size)]) == 2
        assert "--block-size" in capsys.readouterr().err


def test_the_router_takes_the_block_sizes_workers_take():
    from engine.config import EngineConfig

    for block_size in (1, 16, 32, 256):
        EngineConfig(model="tiny-llama", block_size=block_size)  # a worker has it...
        RouterConfig(model="tiny-llama", redis_url="redis://h:1/0", block_size=block_size)


def test_up_with_a_model_folder_without_config_refuses_before_starting(tmp_path, monkeypatch,
                                                                      capsys):
    from router import launcher

    def no_start(self):
        raise AssertionError("a service was started")

    monkeypatch.setattr(launcher.Cluster, "start", no_start)
    assert main(["up", "--model", str(tmp_path), "--port", "0"]) == 2
    assert f"model folder {tmp_path} has no config.json" in capsys.readouterr().err


def test_up_hands_its_router_the_api_keys_in_its_environment_not_its_argv(monkeypatch):
    """On the command line any local user reads them (ps, /proc/PID/cmdline)."""
    from engine.cli_up import up_spec
    from router import launcher

    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    monkeypatch.delenv("PDSERVE_ADMIN_API_KEY", raising=False)
    spec = up_spec(build_parser().parse_args(
        ["up", "--api-key", KEY, "--admin-api-key", ADMIN_KEY, "--redis-url",
         "redis://127.0.0.1:1/0", "--port", "0"]))
    spawned = []

    class Spawned(Exception):
        pass

    def popen(argv, env=None, **_):
        spawned.append((argv, env))
        raise Spawned

    monkeypatch.setattr(launcher.subprocess, "Popen", popen)
    cluster = launcher.Cluster(spec)
    try:
        with pytest.raises(Spawned):
            cluster.start_router(wait=False)
    finally:
        cluster.stop()
    [(argv, env)] = spawned
    assert not [a for a in argv if KEY in a or ADMIN_KEY in a], argv
    assert env["PDSERVE_API_KEY"] == KEY and env["PDSERVE_ADMIN_API_KEY"] == ADMIN_KEY
    assert KEY not in repr(spec) and ADMIN_KEY not in repr(spec)
    # The launcher's own admin calls (wait_routable) send the key the admin service takes.
    assert spec.admin_key() == ADMIN_KEY
    assert launcher.ClusterSpec(api_key=KEY).admin_key() == KEY
    monkeypatch.setenv("PDSERVE_ADMIN_API_KEY", "from-env")
    assert launcher.ClusterSpec(api_key=KEY).admin_key() == "from-env"


def test_a_cluster_whose_keys_travel_in_the_environment_enforces_them():
    from client import Client, UnauthenticatedError
    from router.launcher import Cluster, ClusterSpec
    from tests.serving_helpers import SERVING_MODEL, WORKER_ARGS

    spec = ClusterSpec(model=SERVING_MODEL, num_prefill=0, worker_args=WORKER_ARGS, api_key=KEY,
                       admin_api_key=ADMIN_KEY)
    # Started means its routability check, an admin call with the admin key, got through.
    with Cluster(spec) as cluster:
        [router] = [p for p in cluster.procs if p.role == "router"]
        with open(f"/proc/{router.popen.pid}/cmdline", "rb") as f:
            cmdline = f.read().decode()
        assert "router" in cmdline and KEY not in cmdline and ADMIN_KEY not in cmdline
        for key in (None, ADMIN_KEY):
            with Client(cluster.router_address, timeout=30, api_key=key) as c:
                with pytest.raises(UnauthenticatedError):
                    c.complete([1, 2, 3], max_tokens=2)
        with Client(cluster.router_address, timeout=60, api_key=KEY) as c:
            assert len(c.complete([1, 2, 3], max_tokens=2, ignore_eos=True).token_ids) == 2
    assert os.environ.get("PDSERVE_API_KEY") != KEY  # the test's own environment untouched


def test_vllms_spellings_of_the_serving_flags_are_taken():
    from engine.cli import build_parser

    parser = build_parser()
    base = ["--model", "m", "--redis-url", "redis://127.0.0.1:1"]
    router = parser.parse_args(["router", *base, "--ssl-certfile", "c.pem",
                                "--ssl-keyfile", "k.pem", "--enable-log-requests"])
    assert (router.tls_cert_file, router.tls_key_file, router.log_requests) == \
        ("c.pem", "k.pem", True)
    assert parser.parse_args(["router", *base]).log_requests is True
    assert parser.parse_args(["router", *base, "--disable-log-requests"]).log_requests is False
    for role in ("prefill", "decode"):
        worker = parser.parse_args([role, *base, "--num-gpu-blocks-override", "64"])
        assert worker.num_gpu_blocks == 64
    up = parser.parse_args(["up", "--num-gpu-blocks-override", "32", "--ssl-certfile", "c.pem",
                            "--ssl-keyfile", "k.pem"])
    assert (up.num_gpu_blocks, up.tls_cert_file, up.tls_key_file) == (32, "c.pem", "k.pem")


def test_the_routers_timeouts_are_flags_and_checked(monkeypatch, capsys):
    """--prefill-timeout-s was named in the router's own error message, with no flag to set
    it; --default-timeout-s neither (RouterConfig had both)."""
    from engine.cli import build_parser
    from engine.cli_serve import _router_config
    from engine.cli_up import _up_router_args

    parser = build_parser()
    base = ["router", "--model", "m", "--redis-url", "redis://127.0.0.1:1"]
    config = _router_config(parser.parse_args(
        [*base, "--default-timeout-s", "30", "--prefill-timeout-s", "5"]))
    assert (config.default_timeout_s, config.prefill_timeout_s) == (30.0, 5.0)
    config = _router_config(parser.parse_args(base))
    assert (config.default_timeout_s, config.prefill_timeout_s) == (None, 600.0)
    for bad in (["--default-timeout-s", "0"], ["--prefill-timeout-s", "-1"]):
        with pytest.raises(ValueError, match="timeout-s\\) must be > 0"):
            _router_config(parser.parse_args([*base, *bad]))
    # inf passed "> 0": the router started, and every request failed after its first token
    # (a worker call's timeout was inf).
    for bad in (["--default-timeout-s", "inf"], ["--prefill-timeout-s", "1e309"],
                ["--default-timeout-s", "nan"]):
        with pytest.raises(ValueError, match="timeout-s\\) must be a finite number"):
            _router_config(parser.parse_args([*base, *bad]))
    up = parser.parse_args(["up", "--default-timeout-s", "45"])
    assert _up_router_args(up)[-2:] == ["--default-timeout-s", "45.0"]


@pytest.mark.parametrize("command", [["prefill"], ["decode"], ["up"],
                                     ["generate", "--prompt", "x"]])
def test_vllms_kv_cache_bytes_are_not_taken_for_gib(command, capsys):
    """argparse took vLLM's --kv-cache-memory=BYTES (its own start-up log suggests that
    spelling) for an abbreviation of --kv-cache-memory-gib: 5.8e9 GiB, refused only once the
    model had loaded, in a message naming a flag nobody typed."""
    parser = build_parser()
    for flag in ("--kv-cache-memory=5800000000", "--kv-cache-memory-bytes=1073741824"):
        with pytest.raises(SystemExit) as stop:
            parser.parse_args([*command, flag])
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert "is vLLM's KV-cache budget in bytes; pdserve takes --kv-cache-memory-gib" in err
        gib = "5.402" if "5800000000" in flag else "1"
        assert f"bytes: --kv-cache-memory-gib {gib})" in err
    with pytest.raises(SystemExit):
        parser.parse_args([*command, "--kv-cache-memory-bytes", "40G"])
    assert "pdserve takes --kv-cache-memory-gib, in GiB\n" in capsys.readouterr().err


# What a vLLM command line carries that already holds here.
VLLM_TAKEN = ["--trust-remote-code", "--kv-cache-dtype", "auto", "--load-format", "safetensors",
              "-pp", "1", "--distributed-executor-backend", "mp", "--tokenizer-mode", "auto",
              "--disable-log-stats"]


@pytest.mark.parametrize("role, module", [("prefill", "prefill_svc.server"),
                                          ("decode", "decode_svc.server")])
def test_vllm_flags_whose_values_hold_here_are_taken_and_change_nothing(role, module,
                                                                        monkeypatch):
    started = []
    monkeypatch.setitem(sys.modules, module, types.SimpleNamespace(main=started.append))
    base = [role, "--port", "0", "--kv-transfer-backend", "torch"]
    assert main(base) == 0 and main([*base, *VLLM_TAKEN]) == 0
    assert started[0] == started[1]
    parser = build_parser()
    for command in (["up"], ["generate", "--prompt", "x"]):
        assert vars(parser.parse_args([*command, *VLLM_TAKEN])) == \
            vars(parser.parse_args(command))


@pytest.mark.parametrize("flags, says", [
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8: the KV cache is kept in --dtype's type"
                                  " (no fp8 KV cache) (pdserve takes auto)"),
    (["--load-format", "pt"], "--load-format pt: weights load from the folder's safetensors"),
    (["--quantization", "awq"], "--quantization awq: weights are used unquantized"),
    (["-pp", "2"], "-pp 2: a model is split by --tensor-parallel-size only (pdserve takes 1)"),
    (["--distributed-executor-backend", "ray"], "(no Ray) (pdserve takes mp)"),
    (["--revision", "main"], "--revision main: pdserve loads a model from a local folder"),
    (["--tokenizer-revision", "v2"], "give the folder of that revision's snapshot as --model"),
    (["--swap-space", "4"], "a preempted request is recomputed, never swapped out"),
    (["--cpu-offload-gb", "8"], "weights stay whole on their device"),
    (["--tokenizer-mode", "mistral"], "(pdserve takes auto, hf)"),
])
def test_vllm_flags_asking_for_what_pdserve_does_not_do_are_refused_with_what_it_does(
        flags, says, capsys):
    for command in (["prefill"], ["up"]):
        with pytest.raises(SystemExit) as stop:
            build_parser().parse_args([*command, *flags])
        assert stop.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.parametrize("role, module", [("prefill", "prefill_svc.server"),
                                          ("decode", "decode_svc.server")])
def test_vllms_enable_spellings_of_the_engine_switches_are_taken(role, module, monkeypatch):
    """--enable-prefix-caching, on vLLM command lines, was an unrecognized argument."""
    started = []
    monkeypatch.setitem(sys.modules, module, types.SimpleNamespace(main=started.append))
    base = [role, "--port", "0", "--kv-transfer-backend", "torch"]
    for flags, on in ((["--enable-prefix-caching", "--enable-chunked-prefill"], True),
                      ([], True),
                      (["--no-enable-prefix-caching", "--no-enable-chunked-prefill"], False)):
        assert main([*base, *flags]) == 0
        engine = started.pop().engine
        assert (engine.enable_prefix_caching, engine.enable_chunked_prefill) == (on, on)
    parser = build_parser()
    for command in (["generate", "--prompt", "x"], ["chat"], ["demo", "--offline"]):
        args = parser.parse_args([*command, "--enable-prefix-caching"])
        assert args.enable_prefix_caching is True and args.enable_chunked_prefill is True
