"""The pdserve console script: make-model, demo, generate and the offline benchmark."""
import json
import subprocess
import sys

import pytest

from engine.cli import main


def test_make_model_writes_a_loadable_folder(tmp_path):
    out = tmp_path / "m"
    # In this process: a child's start would import transformers again (~3 s of the test).
    assert main(["make-model", "micro-llama", "--out", str(out)]) == 0
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
    from engine import LLM, SamplingParams
    outs = LLM(str(out)).generate(["hello"], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(outs[0].token_ids) == 4


# chat's in the slow tier (4 s): the same connection path as generate's.
@pytest.mark.parametrize("command", [pytest.param("chat", marks=pytest.mark.slow), "generate"])
def test_client_commands_without_a_router_end_with_a_clean_error(command):
    import socket

    with socket.socket() as s:  # a port nobody listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    prompt = [] if command == "chat" else ["--prompt", "hi"]  # chat reads its turns
    proc = subprocess.run([sys.executable, "-m", "engine.cli", command, "--router",
                           f"127.0.0.1:{port}", *prompt], input="hi\n", capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.startswith("pdserve: error: UNAVAILABLE") and "Traceback" not in proc.stderr


def test_unknown_preset_is_a_clean_error(capsys):
    assert main(["make-model", "no-such-preset", "--out", "/tmp/unused"]) == 2
    assert "no-such-preset" in capsys.readouterr().err


def test_demo_streams_text(capfd):
    assert main(["demo", "--max-tokens", "5"]) == 0
    out, err = capfd.readouterr()  # the services' output too: they share this terminal
    assert out.count("[5 tokens, TTFT") == 4
    assert "stopping: draining" in err  # the services' logs are seen here...
    assert "pdserve.access" not in out + err  # ...but no access line cuts into the text


def test_generate(capsys):
    assert main(["generate", "--prompt", "hi there", "--max-tokens", "6"]) == 0
    assert capsys.readouterr().out.strip()


def test_generate_sampling_rule_flags_reach_the_engine(capsys):
    from engine import LLM, SamplingParams

    argv = ["generate", "--prompt", "hi there", "--max-tokens", "8", "--num-gpu-blocks", "64"]
    rules = ["--logit-bias", '{"1234": 100}', "--min-tokens", "2", "--repetition-penalty",
             "1.3", "--presence-penalty", "0.5", "--frequency-penalty", "0.5",
             "--bad-words", "hello", "the world"]
    assert main(argv + rules) == 0
    out = capsys.readouterr().out
    with LLM("tiny-llama", num_gpu_blocks=64) as llm:
        want = llm.generate(["hi there"], SamplingParams(
            max_tokens=8, temperature=0.0, logit_bias={1234: 100.0}, min_tokens=2,
            repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5,
            bad_words=["hello", "the world"]))[0]
    assert out == want.text + "\n" and want.token_ids[0] == 1234
    from engine.cli import build_parser, sampling_kwargs
    kw = sampling_kwargs(build_parser().parse_args(argv + rules), {})
    assert kw["bad_words"] == ["hello", "the world"] and kw["min_tokens"] == 2
    from engine.cli import engine_kwargs

    assert engine_kwargs(build_parser().parse_args(argv + ["-tp", "2"]))[
        "tensor_parallel_size"] == 2
    with pytest.raises(SystemExit):
        main(argv + ["--logit-bias", "[1]"])


def test_generate_follows_a_pattern_or_a_schema_file(capsys, tmp_path):
    from engine.cli import build_parser, sampling_kwargs

    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "required": ["n"], '
                      '"properties": {"n": {"type": "integer", "maximum": 99}}}')
    argv = ["generate", "--prompt", "hi there", "--max-tokens", "24"]
    assert main(argv + ["--guided-json", str(schema)]) == 0
    assert isinstance(json.loads(capsys.readouterr().out)["n"], int)
    assert main(argv + ["--guided-json", str(schema), "--guided-whitespace-pattern", "\n"]) == 0
    assert capsys.readouterr().out.startswith('{\n"n"\n:\n')
    assert main(argv + ["--guided-whitespace-pattern", " *"]) != 0  # without --guided-json
    assert "applies to guided_json" in capsys.readouterr().err
    kw = sampling_kwargs(build_parser().parse_args(argv + ["--guided-json", '{"enum": [1]}',
                                                           "--guided-regex", "a+"]), {})
    assert kw["guided_json"] == '{"enum": [1]}' and kw["guided_regex"] == "a+"
    with pytest.raises(SystemExit):  # neither JSON nor a file
        main(argv + ["--guided-json", str(tmp_path / "missing.json")])
    capsys.readouterr()
    assert main(argv + ["--guided-regex", "a(?=b)"]) != 0
    assert "lookaheads (?=...) are not supported" in capsys.readouterr().err


# The slow tier (7 s): TP parity is tests/test_tensor_parallel.py's and the serving tests'; the
# flag's way to the engine is checked in test_generate_sampling_rule_flags_reach_the_engine.
@pytest.mark.slow
def test_generate_tensor_parallel_matches_tp1(capsys):
    argv = ["generate", "--prompt", "hi there", "--max-tokens", "6"]
    assert main(argv) == 0
    tp1 = capsys.readouterr().out
    assert main(argv + ["-tp", "2"]) == 0
    assert capsys.readouterr().out == tp1


def test_bench_offline_json(capsys):
    assert main(["bench", "offline", "--workload", "tiny", "--num-requests", "2",
                 "--output-len", "16-24", "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 32 <= res["num_output_tokens"] <= 48
    for key in ("engine_tok_s", "hf_tok_s", "roofline_tok_s", "ratio_vs_hf", "ratio_vs_roofline"):
        assert res[key] > 0
    assert res["ratio_vs_hf"] == res["hf_s"] / res["engine_s"]
    assert res["linear_kernel"] in ("onednn", "mkl", "torch")
    # The model graph runs every step where the layers are on oneMKL and C kernels build.
    from kernels.cpu_decode import cpu_kernels_available
    graph_expected = res["linear_kernel"] == "mkl" and cpu_kernels_available()
    assert (res["cpu_graph_steps"] > 0) == graph_expected


def test_up_passes_its_flags_to_the_router_and_workers(tmp_path, monkeypatch):
    from engine.cli import build_parser
    from engine.cli_serve import _worker_config
    from engine.cli_up import up_spec
    from router.template_sandbox import TemplateSandboxConfig

    (tmp_path / "turns.jinja").write_text("{{ messages[0]['content'] }}")
    (tmp_path / "gen").mkdir()
    (tmp_path / "gen" / "generation_config.json").write_text('{"temperature": 0.5}')
    monkeypatch.chdir(tmp_path)
    spec = up_spec(build_parser().parse_args(
        ["up", "--chat-template", "turns.jinja", "--generation-config", "gen",
         "--scheduling-policy", "priority", "--api-key", "k3y", "--trust-request-chat-template"]))
    args = spec.router_args
    assert args[args.index("--chat-template") + 1] == str(tmp_path / "turns.jinja")
    from engine.cli_serve import _router_config

    router = _router_config(build_parser().parse_args(["router", "--redis-url", "redis://x",
                                                       *args]))
    assert router.trust_request_chat_template and router.chat_template_text
    assert router.request_chat_template == TemplateSandboxConfig()  # the defaults
    sandboxed = up_spec(build_parser().parse_args(
        ["up", "--trust-request-chat-template", "--request-chat-template-workers", "3",
         "--request-chat-template-timeout-s", "0.5", "--request-chat-template-memory-mb",
         "256"])).router_args
    router = _router_config(build_parser().parse_args(["router", "--redis-url", "redis://x",
                                                       *sandboxed]))
    assert router.request_chat_template == TemplateSandboxConfig(3, 0.5, 256)
    with pytest.raises(ValueError, match="request_chat_template_workers"):
        _router_config(build_parser().parse_args(["router", "--redis-url", "redis://x",
                                                  "--request-chat-template-workers", "0"]))
    assert args[args.index("--generation-config") + 1] == str(tmp_path / "gen")
    # The key goes to the router through its environment, not on its command line.
    assert "--api-key" not in spec.router_flags() and "k3y" not in spec.router_flags()
    assert spec.api_key == "k3y" and spec.router_env()["PDSERVE_API_KEY"] == "k3y"
    assert spec.worker_args == ["--scheduling-policy", "priority"]
    assert spec.kv_transfer_backend == "nixl" and spec.gpu_memory_utilization is None
    spec = up_spec(build_parser().parse_args(
        ["up", "--dtype", "bfloat16", "--max-model-len", "1024", "--max-num-seqs", "64",
         "--max-num-batched-tokens", "1024", "--enforce-eager", "--kv-transfer-backend", "torch",
         "--gpu-memory-utilization", "0.8", "--seed", "7"]))
    assert spec.worker_args == ["--dtype", "bfloat16", "--max-model-len", "1024",
                                "--max-num-seqs", "64", "--max-num-batched-tokens", "1024",
                                "--seed", "7", "--enforce-eager"]
    assert spec.kv_transfer_backend == "torch" and spec.gpu_memory_utilization == 0.8
    # Every flag it forwards is one the workers take.
    for role in ("prefill", "decode"):
        build_parser().parse_args([role, *spec.worker_args, "--kv-transfer-backend", "torch"])
    # Refused as unrecognized before: the block size both sides hash prompts with, the
    # switch vLLM's command lines carry, the workers' wedge limits.
    spec = up_spec(build_parser().parse_args(
        ["up", "--block-size", "32", "--no-enable-prefix-caching", "--engine-step-timeout-s",
         "30", "--tp-idle-ping-interval-s", "2", "--tp-idle-ping-timeout-s", "4"]))
    assert spec.worker_args == ["--block-size", "32", "--engine-step-timeout-s", "30.0",
                                "--tp-idle-ping-interval-s", "2.0",
                                "--tp-idle-ping-timeout-s", "4.0", "--no-enable-prefix-caching"]
    assert spec.router_args[spec.router_args.index("--block-size") + 1] == "32"
    for role in ("prefill", "decode"):
        worker = _worker_config(build_parser().parse_args([role, *spec.worker_args]), role)
        assert (worker.engine.block_size, worker.engine.enable_prefix_caching,
                worker.engine_step_timeout_s, worker.engine.tp_idle_ping_interval_s,
                worker.engine.tp_idle_ping_timeout_s) == (32, False, 30.0, 2.0, 4.0)
    assert up_spec(build_parser().parse_args(["up", "--enable-prefix-caching"])).worker_args == []
    spec = up_spec(build_parser().parse_args(
        ["up", "--stream-interval", "8", "--max-local-prefill-length", "96",
         "--served-model-name", "team/llama", "--client-write-timeout-s", "0",
         "--migration-limit", "0", "--migration-backoff-s", "0.5"]))
    args = spec.router_args
    assert "--trust-request-chat-template" not in args  # off unless asked for
    assert args[args.index("--migration-limit") + 1] == "0"
    assert args[args.index("--migration-backoff-s") + 1] == "0.5"
    assert args[args.index("--stream-interval") + 1] == "8"
    assert args[args.index("--client-write-timeout-s") + 1] == "0.0"  # 0 (never) is a value
    assert args[args.index("--max-local-prefill-length") + 1] == "96"
    assert args[args.index("--served-model-name") + 1] == "team/llama"
    assert spec.worker_args == ["--served-model-name", "team/llama"]
    # Every flag it forwards is one the router takes.
    build_parser().parse_args(["router", "--redis-url", "redis://x", *args])
    for bad, match in ((["--chat-template", "missing.jinja"], "does not exist"),
                       (["--generation-config", "nowhere"], "'auto', 'engine' or a folder"),
                       (["--max-restarts", "-1"], "max-restarts"),
                       (["--stream-interval", "0"], "stream_interval must be"),
                       (["--migration-limit", "-1"], "migration_limit must be"),
                       (["--migration-backoff-s", "nan"],
                        r"migration_backoff_s \(--migration-backoff-s\) must be"),
                       (["--max-local-prefill-length", "-1"], "max_local_prefill_length"),
                       (["--prefill", "0", "--max-local-prefill-length", "0"],
                        "nothing to serve it")):
        with pytest.raises(ValueError, match=match):
            up_spec(build_parser().parse_args(["up", *bad]))


@pytest.mark.parametrize("flags, match", [
    (["--prefill", "0", "--max-num-seqs", "-1"], "max_num_seqs must be a positive integer"),
    (["-tp", "0"], "-tp must be a positive integer"),
    (["--num-gpu-blocks", "0"], "num_gpu_blocks must be a positive integer"),
    (["--num-gpu-blocks", "64", "--kv-cache-memory-gib", "2"], "give one of them"),
    (["--port", "70000"], "port must be in"),
    (["--block-size", "24"], "must be a power of two"),
    (["--tp-idle-ping-timeout-s", "0"], "tp_idle_ping_timeout_s"),
    (["--redis-url", "http://x"], "redis_url"),
    (["--metrics-port", "-3"], "metrics_port"),
    (["--served-model-name", "two words"], "served_model_name"),
    # Disaggregated: no router_flags() reads the model's context length to find it missing.
    (["--model", "/nonexistent/model"], "neither an existing folder nor a built-in preset"),
    (["--prefill", "0", "--model", "/nonexistent/model"], "neither an existing folder"),
    (["--api-key", "a b"], "api_key"),
    (["--admin-api-key", "a b"], "api_key"),
    (["--default-timeout-s", "inf"], "--default-timeout-s must be a finite number"),
    (["--client-write-timeout-s", "-1"], "(--client-write-timeout-s) must be a finite number"),
    (["--client-write-timeout-s", "nan"], "(--client-write-timeout-s) must be a finite"),
    # Found by the prefill worker's engine, after Redis, the router and the decode worker.
    (["--model", "micro-llama", "-tp", "3"], "tensor_parallel_size 3 does not divide"),
    # Both found by each worker's engine once its weights loaded, the others started.
    (["--model", "micro-llama", "--max-model-len", "4096"],
     "max_model_len (--max-model-len) 4096 exceeds the model's max_position_embeddings 2048"),
    (["--model", "micro-llama", "--prefill", "0", "--max-model-len", "100", "--num-gpu-blocks",
      "4"], "100 does not fit the KV cache (4 blocks of 16 tokens = 64;"),
    # A memory budget whose blocks hold less than one such sequence, as each worker sizes them
    # (micro-llama: 8 KiB blocks in float32 on the CPU, 4 KiB on each of 2 TP ranks).
    (["--model", "micro-llama", "--prefill", "0", "--max-model-len", "2048",
      "--kv-cache-memory-gib", "0.0009"], "max_model_len (--max-model-len) 2048 does not fit "
     "--kv-cache-memory-gib 0.0009: one sequence takes 1.00 MiB per rank (128 blocks of 16 "
     "tokens, 8.0 KiB each); set --kv-cache-memory-gib 0.001 or more"),
    (["--model", "micro-llama", "-tp", "2", "--max-model-len", "2048", "--kv-cache-memory-gib",
      "0.0004"], "takes 512.0 KiB per rank (128 blocks of 16 tokens, 4.0 KiB each)"),
])
def test_up_refuses_a_flag_any_service_would_refuse_before_starting_one(flags, match, capsys,
                                                                       monkeypatch):
    """Each service's configuration is built from the flags it would get before any starts:
    a bad value was found by the first worker to start, after the others, with a traceback."""
    from router import launcher

    def no_start(self):
        raise AssertionError("a service was started")

    monkeypatch.setattr(launcher.Cluster, "start", no_start)
    assert main(["up", *flags]) == 2
    assert match in capsys.readouterr().err


@pytest.mark.parametrize("gpus", [0, 1])
def test_up_sizes_the_kv_budget_as_the_workers_device_and_dtype_will(gpus, tmp_path,
                                                                     monkeypatch):
    """On the CPU a worker computes in float32 and without --kv-cache-memory-gib has 1 GiB;
    on CUDA a float32 checkpoint runs in bfloat16, and without the flag only the worker can
    size its budget (from the GPU's free memory)."""
    from engine.cli import build_parser
    from engine.cli_up import up_spec
    from router import cluster_spec
    from tests.test_model_config import write_config

    monkeypatch.setattr(cluster_spec, "cuda_device_count", lambda: gpus)
    # float32, 4 layers x (K, V) x 16 tokens x 8 KV heads x 128: 512 KiB a block, 256 on CUDA.
    model = write_config(tmp_path / "m", hidden_size=4096, num_attention_heads=32,
                         num_key_value_heads=8, num_hidden_layers=4, intermediate_size=256,
                         max_position_embeddings=65536)

    def up(*flags):
        return up_spec(build_parser().parse_args(["up", "--model", str(model), "--prefill",
                                                  "0", "--max-model-len", "4096", *flags]))

    # 4096 tokens, 256 blocks: 128 MiB in float32, 64 MiB in bfloat16.
    if gpus:
        up("--kv-cache-memory-gib", "0.0625")
        up("--max-model-len", "40000")
        return
    with pytest.raises(ValueError, match=r"takes 128.00 MiB per rank .* 0.125 or more"):
        up("--kv-cache-memory-gib", "0.0625")
    up("--kv-cache-memory-gib", "0.125")
    up()  # in the CPU's 1 GiB
    # 2500 blocks: 1.22 GiB.
    with pytest.raises(ValueError, match=r"40000 does not fit the CPU's default KV-cache "
                                         r"budget of 1 GiB: one sequence takes 1.22 GiB per "
                                         r"rank .*--kv-cache-memory-gib 1.221 or more"):
        up("--max-model-len", "40000")


def test_sampling_flags_and_timeouts_are_checked_before_anything_loads(capsys, monkeypatch):
    import engine
    from engine.grpc_server import ServerConfig

    monkeypatch.setattr(engine, "LLM", None)  # loading a model would fail loudly
    assert main(["generate", "--prompt", "x", "--top-p", "5"]) == 2
    assert "top_p" in capsys.readouterr().err
    for bad in ("nan", "inf", "-1", "1e300"):
        with pytest.raises(SystemExit):
            main(["admin", "--router", "127.0.0.1:1", "--timeout", bad, "stats"])
        assert "--timeout" in capsys.readouterr().err
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="drain_timeout_s must be a finite number"):
            ServerConfig(drain_timeout_s=bad)


def test_the_router_refuses_a_client_write_timeout_it_cannot_keep():
    from router.config import RouterConfig

    for bad in (float("nan"), float("inf"), -1.0, True, "60"):
        with pytest.raises(ValueError, match=r"\(--client-write-timeout-s\) must be a finite"):
            RouterConfig(model="tiny-llama", redis_url="redis://x", client_write_timeout_s=bad)
    assert RouterConfig(model="tiny-llama", redis_url="redis://x",
                        client_write_timeout_s=0).client_write_timeout_s == 0  # 0: never


def test_the_sdk_names_a_sampling_argument_the_request_cannot_carry():
    from client.types import build_request

    for kw, name in ((dict(seed=2 ** 64 - 1), "seed="), (dict(max_tokens=3_000_000_000),
                                                         "max_tokens="),
                     (dict(temperature="hot"), "temperature=")):
        with pytest.raises(ValueError, match=f"sampling argument {name}"):
            build_request("hi", None, kw)


def test_piped_chat_turns_that_fail_end_with_a_nonzero_exit(monkeypatch, capsys):
    import io

    long_turn = " ".join(["word"] * 400)  # over --max-model-len once templated
    monkeypatch.setattr("sys.stdin", io.StringIO(f"hello\n{long_turn}\n"))
    assert main(["chat", "--max-model-len", "128", "--max-tokens", "2"]) == 1
    assert "error" in capsys.readouterr().err
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    assert main(["chat", "--max-tokens", "2"]) == 0


def test_a_worker_checks_its_registry_url_and_id_before_loading_its_model():
    from engine.cli import build_parser
    from engine.cli_serve import _worker_config

    def cfg(*extra):
        return _worker_config(build_parser().parse_args(["decode", "--model", "tiny-llama",
                                                         *extra]), "decode")

    assert cfg("--redis-url", "redis://h:1/0", "--worker-id", "decode-{port}").redis_url
    # vLLM's --seed: the engine's, taken by every worker (refused as unknown before).
    assert (cfg().engine.seed, cfg("--seed", "7").engine.seed) == (0, 7)
    for extra, match in ((["--redis-url", "http://x"], "redis_url must be a redis:// URL"),
                         # Failed once the model loaded and the server listened, or (a
                         # database Redis refuses) never: the worker registered nothing.
                         (["--redis-url", "redis://h:abc/0"], "does not parse"),
                         (["--redis-url", "redis://h:1/abc"], "database must be a number"),
                         (["--redis-url", "redis://h:1/99999"], "is no database"),
                         (["--redis-url", "redis://:s3cret@h:abc/0"], r"redis://:\*\*\*@h"),
                         (["--seed", str(2**64)], "seed must be an integer"),
                         (["--worker-id", "a b"], "worker_id"),
                         (["--worker-id", "x\ny"], "worker_id")):
        with pytest.raises(ValueError, match=match):
            cfg(*extra)


@pytest.mark.parametrize("argv", [
    ["generate", "--router", "127.0.0.1:1", "--prompt", "x", "--dtype", "bfloat16"],
    ["chat", "--router", "127.0.0.1:1", "--tensor-parallel-size", "2"],
    ["demo", "--block-size", "32"],
    ["generate", "--router", "", "--prompt", "x"],  # not a silent run of the local engine
    ["generate", "--router", "127.0.0.1:1", "--prompt", "x", "--model", "micro-llama"],
    ["chat", "--router", "127.0.0.1:1", "--model", "micro-llama"],
])
def test_commands_that_run_no_engine_here_refuse_engine_flags(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "do not apply here" in err or "router address" in err


def test_a_terminal_that_is_not_utf8_gets_the_text_with_what_it_cannot_show_replaced():
    """Model text holds characters an ASCII (or latin-1) stdout cannot encode: the
    UnicodeEncodeError cut the generation midway (exit 2), and failed every chat turn."""
    import os

    proc = subprocess.run(
        [sys.executable, "-m", "engine.cli", "generate", "--model", "tiny-llama", "--prompt",
         "h\u00e9llo w\u00f6rld", "--max-tokens", "40", "--temperature", "1", "--seed", "2"],
        capture_output=True, env={**os.environ, "PYTHONIOENCODING": "ascii"}, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert b"?" in proc.stdout and len(proc.stdout.split()) > 10  # all 40 tokens' text


def test_remote_sampling_flags_are_checked_before_any_call(capsys):
    """Checked by the router, a bad flag came back after connecting, or as UNAVAILABLE where
    there was no router, with another exit status than the local command's."""
    for command in ("generate", "chat"):
        assert main([command, "--router", "127.0.0.1:1", "--prompt", "x", "--top-p", "5"]
                    if command == "generate" else
                    [command, "--router", "127.0.0.1:1", "--top-p", "5"]) == 2
        assert "top_p" in capsys.readouterr().err


def test_chat_with_stdin_closed_says_so():
    proc = subprocess.run([sys.executable, "-m", "engine.cli", "chat", "--router",
                           "127.0.0.1:1"], stdin=subprocess.DEVNULL, capture_output=True,
                          timeout=120, preexec_fn=lambda: __import__("os").close(0))
    assert proc.returncode == 2 and b"stdin, which is closed" in proc.stderr
    assert b"Traceback" not in proc.stderr


def test_ctrl_c_during_a_call_ends_with_130_and_no_traceback():
    import signal
    import socket

    with socket.socket() as hole:  # accepts, never answers: the call waits
        hole.bind(("127.0.0.1", 0))
        hole.listen()
        proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "admin", "--router",
                                 f"127.0.0.1:{hole.getsockname()[1]}", "stats"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        hole.settimeout(120)
        conn, _ = hole.accept()  # its imports are done: it is in the call
        with conn:
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and b"Traceback" not in err, err.decode()[-2000:]


def test_a_broken_pipe_other_than_stdouts_is_not_taken_for_a_reader_that_left(monkeypatch):
    """Every command's BrokenPipeError read as `| head` closing stdout: one from a socket or a
    child's pipe exited 1 with no word of it."""
    from engine import cli_remote

    def broken(args):
        raise BrokenPipeError("a child's pipe")

    monkeypatch.setattr(cli_remote, "cmd_info", broken)
    with pytest.raises(BrokenPipeError, match="a child's pipe"):
        main(["info", "--router", "127.0.0.1:1"])


def _flag_help(command: str, flag: str) -> str:
    from engine.cli import build_parser
    sub = next(a for a in build_parser()._actions if a.choices and command in a.choices)
    return next(a.help for a in sub.choices[command]._actions if flag in a.option_strings)


def test_up_describes_the_client_write_timeout_as_the_router_applies_it():
    # The router times one chunk's write, so a client on a link too slow for a large chunk is
    # cut while it reads; up's help said only a client that takes none of its output was.
    up_help = _flag_help("up", "--client-write-timeout-s")
    assert "takes none" not in up_help
    assert "chunk that waits this long" in up_help
    assert "chunk that waits this long" in _flag_help("router", "--client-write-timeout-s")
