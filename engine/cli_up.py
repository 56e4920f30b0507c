"""``pdserve up``: a whole cluster (Redis, the router, prefill and decode workers) as child
processes of this one, kept up until Ctrl-C or SIGTERM (router/launcher.py, router/supervisor.py).
Every service's flags are checked here first, as each will build its configuration."""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import threading

from engine.cli_serve import TOKENIZER_HELP, _router_config, _worker_config
from engine.cli_vllm import add_refused_vllm_flags


def add_up_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-llama",
                   help="HF folder or built-in preset name (default: tiny-llama)")
    p.add_argument("--tokenizer", default=None, metavar="FOLDER",
                   help=TOKENIZER_HELP + "; given to the router and every worker")
    p.add_argument("--prefill", type=int, default=1,
                   help="prefill workers; 0 runs aggregated: the decode workers prefill every "
                        "prompt themselves, behind the same router")
    p.add_argument("--decode", type=int, default=1, help="decode workers")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="TP ranks per prefill worker")
    p.add_argument("--redis-url", default=None, help="default: start the bundled redis-server")
    p.add_argument("--port", type=int, default=50051, help="the router's port")
    p.add_argument("--num-gpu-blocks", "--num-gpu-blocks-override", type=int, default=None,
                   help="KV blocks per worker (default: from the memory budget; not with "
                        "--kv-cache-memory-gib)")
    p.add_argument("--kv-cache-memory-gib", type=float, default=None,
                   help="each worker rank's KV-cache budget (default: 1 GiB on the CPU; on "
                        "CUDA what --gpu-memory-utilization leaves beside the weights)")
    add_refused_vllm_flags(p)
    # Engine flags every worker gets as given (see `pdserve prefill --help`); unset: theirs.
    p.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights, activations and KV cache (default auto: float32 on the CPU, "
                        "the checkpoint's on CUDA, bfloat16 for a float32 one)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output (default: the model's context length)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="requests each worker runs at once (default 256)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens in one engine step: the prefill chunk size (default 2048)")
    p.add_argument("--enforce-eager", action="store_true", default=None,
                   help="CUDA: never capture or replay CUDA graphs")
    p.add_argument("--seed", type=int, default=None,
                   help="every worker's engine seed (see `pdserve prefill --help`)")
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV-cache block, the workers' and the router's prefix "
                        "hashes' (default 16)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=None, help="the workers reuse cached prompt prefixes (default: on)")
    p.add_argument("--engine-step-timeout-s", type=float, default=None,
                   help="each worker's limit on one engine step (see `pdserve prefill --help`)")
    p.add_argument("--tp-idle-ping-interval-s", type=float, default=None,
                   help="-tp > 1: how often idle prefill workers ping their ranks (default 5; "
                        "0: never)")
    p.add_argument("--tp-idle-ping-timeout-s", type=float, default=None,
                   help="-tp > 1: a rank silent this long is taken as wedged (default 10)")
    p.add_argument("--kv-transfer-backend", default="nixl", choices=["nixl", "torch"],
                   help="how decode workers pull KV from prefill workers")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="CUDA: the share of each GPU's memory its workers use, split evenly "
                        "where workers share a GPU (default 0.9). Workers get GPUs of their "
                        "own while CUDA_VISIBLE_DEVICES has enough (a prefill worker -tp of "
                        "them), else share them round-robin")
    p.add_argument("--no-core-share", dest="share_cores", action="store_false",
                   help="each worker keeps its own share of the cores, even while the others "
                        "are idle (default: a busy worker borrows idle workers' cores)")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                   help="every worker's engine steps in a process of its own (prefill|decode "
                        "--engine-process); default: the workers placed on GPUs, TP 1")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="the router serves Prometheus metrics, its own and every worker's "
                        "last heartbeat, at http://127.0.0.1:PORT/metrics; default: none")
    p.add_argument("--tls-cert-file", "--ssl-certfile", default=None,
                   help="the router serves clients over TLS with this PEM certificate...")
    p.add_argument("--tls-key-file", "--ssl-keyfile", default=None, help="...and this PEM key")
    p.add_argument("--api-key", default=None,
                   help="the router's API key (router --api-key; default: $PDSERVE_API_KEY)")
    p.add_argument("--admin-api-key", default=None,
                   help="the router's admin API key (router --admin-api-key; default: "
                        "$PDSERVE_ADMIN_API_KEY)")
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="the router renders chat prompts with this template (router "
                        "--chat-template; default: the model's own)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="chat requests may bring their own template (router "
                        "--trust-request-chat-template)")
    p.add_argument("--request-chat-template-workers", type=int, default=None,
                   help="processes rendering requests' own templates (router's flag)")
    p.add_argument("--request-chat-template-timeout-s", type=float, default=None,
                   help="how long a request's own template may render (router's flag)")
    p.add_argument("--request-chat-template-memory-mb", type=int, default=None,
                   help="memory a request's own template may allocate (router's flag)")
    p.add_argument("--generation-config", default=None, metavar="auto|engine|FOLDER",
                   help="the router's sampling defaults (router --generation-config; default: "
                        "auto, the model's generation_config.json)")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients see and the workers register (every service's "
                        "--served-model-name; default: --model's folder name)")
    p.add_argument("--scheduling-policy", default=None, choices=["fcfs", "priority"],
                   help="every worker's (prefill|decode --scheduling-policy; default fcfs)")
    p.add_argument("--stream-interval", type=int, default=None,
                   help="router --stream-interval: one chunk per N output tokens after the "
                        "first, from the decode workers and to clients (default 1)")
    p.add_argument("--max-local-prefill-length", type=int, default=None,
                   help="router --max-local-prefill-length: conditional disaggregation, short "
                        "uncached prompts prefilled on the decode worker while the prefill "
                        "workers are busy (default 0: off; aggregated clusters: every prompt)")
    p.add_argument("--default-timeout-s", type=float, default=None,
                   help="router --default-timeout-s: the deadline of a request whose client "
                        "sets none (default: none)")
    p.add_argument("--client-write-timeout-s", type=float, default=None,
                   help="router --client-write-timeout-s: a Generate chunk that waits this "
                        "long for its client to take it (the client stopped reading, or its "
                        "link is too slow for the chunk) ends the request (default 60; 0: "
                        "never)")
    p.add_argument("--migration-limit", type=int, default=None,
                   help="router --migration-limit: how many times a request whose worker "
                        "fails moves on to another (default 3; 0: never)")
    p.add_argument("--migration-backoff-s", type=float, default=None,
                   help="router --migration-backoff-s: the first wait before a move away "
                        "from a worker that still answers (default 0.2; 0: at once)")
    p.add_argument("--max-restarts", type=int, default=5,
                   help="a service that crashes is started again, up to this many crashes "
                        "per role within 10 minutes; then, or with 0, everything stops")


def cmd_up(args: argparse.Namespace) -> int:
    from router.launcher import Cluster, StartAborted
    from router.supervisor import Supervisor

    spec = up_spec(args)
    stop = threading.Event()
    # While the services start (minutes, for a large model), a stop must not wait for them:
    # the start polls the flag, then stops what it started. Not an exception raised from the
    # handler: it could land inside that cleanup and cut it short, or where a started child
    # was not tracked yet.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        cluster = Cluster(spec).start(should_abort=stop.is_set)
    except StartAborted:
        print("pdserve up: stopped while starting", flush=True)
        return 0
    except RuntimeError as e:  # a service that did not come up (its own log says why)
        print(f"pdserve up: {e}", file=sys.stderr, flush=True)
        return 1
    try:  # started already: `with cluster` would start it a second time
        return _serve_until_stopped(args, spec, cluster, Supervisor, stop)
    finally:
        cluster.stop()


def _serve_until_stopped(args: argparse.Namespace, spec, cluster, supervisor_cls,
                         stop: threading.Event) -> int:
    workers = (f"{args.decode} decode, aggregated: no prefill workers" if spec.aggregated
               else f"{args.prefill} prefill, {args.decode} decode")
    print(f"pdserve up: router on {cluster.router_address} ({workers}, model "
          f"{args.model}); Ctrl-C stops everything", flush=True)
    # Where the services' lines are, shown here too: a killed launcher leaves them there.
    print(f"  services' stderr: {cluster.log_dir}", flush=True)
    for proc in cluster.procs:
        if proc.gpus is not None:
            print(f"  {proc.name}: {proc.gpus.describe()}", flush=True)
    # A stop while a crashed service starts again (minutes, for a large model) ends its wait.
    supervisor = supervisor_cls(cluster, args.max_restarts,
                                say=lambda line: print(line, file=sys.stderr, flush=True),
                                should_stop=stop.is_set)
    while not stop.is_set():
        code = supervisor.check()
        if code is not None:
            return code
        stop.wait(0.5)
    print("pdserve up: stopping", flush=True)
    return 0


def up_spec(args: argparse.Namespace):
    """The cluster ``pdserve up`` starts; a bad flag fails here, before anything starts."""
    from router.launcher import ClusterSpec

    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if args.chat_template is not None:
        from engine.chat_template import load_chat_template

        load_chat_template(args.chat_template)
        if os.path.isfile(args.chat_template):  # the router may start elsewhere
            args.chat_template = os.path.abspath(args.chat_template)
    if args.generation_config not in (None, "auto", "engine"):
        from engine.generation_defaults import check_generation_config

        args.generation_config = os.path.abspath(check_generation_config(args.generation_config))
    if args.stream_interval is not None:
        from engine.output_processor import check_stream_interval

        check_stream_interval(args.stream_interval)
    if args.default_timeout_s is not None:  # as the router checks it, before anything starts
        from engine.config import positive_number

        positive_number("--default-timeout-s", args.default_timeout_s)
    if args.max_local_prefill_length is not None:
        from router.local_prefill import LocalPrefillConfig

        LocalPrefillConfig(max_local_prefill_length=args.max_local_prefill_length)
    extra = [] if args.num_gpu_blocks is None else ["--num-gpu-blocks", str(args.num_gpu_blocks)]
    if args.scheduling_policy:
        extra += ["--scheduling-policy", args.scheduling_policy]
    if args.served_model_name:
        extra += ["--served-model-name", args.served_model_name]
    if args.tokenizer is not None:  # the services may start in other working directories
        args.tokenizer = os.path.abspath(os.path.expanduser(args.tokenizer))
        extra += ["--tokenizer", args.tokenizer]
    for flag in ("--dtype", "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens",
                 "--kv-cache-memory-gib", "--seed", "--block-size", "--engine-step-timeout-s",
                 "--tp-idle-ping-interval-s", "--tp-idle-ping-timeout-s"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            extra += [flag, str(value)]
    if args.enable_prefix_caching is False:
        extra.append("--no-enable-prefix-caching")
    if args.enforce_eager:
        extra.append("--enforce-eager")
    spec = ClusterSpec(model=args.model, num_prefill=args.prefill, num_decode=args.decode,
                       prefill_tp=args.tensor_parallel_size, redis_url=args.redis_url,
                       router_port=args.port, worker_args=extra, share_cores=args.share_cores,
                       router_args=_up_router_args(args), api_key=args.api_key,
                       admin_api_key=args.admin_api_key,
                       kv_transfer_backend=args.kv_transfer_backend,
                       gpu_memory_utilization=args.gpu_memory_utilization,
                       engine_process=args.engine_process)
    _check_service_flags(spec)
    return spec


def _check_service_flags(spec) -> None:
    """Each service's configuration built from the flags it will get, as it will build it: a
    bad value fails here with its message, not in a service after the others started."""
    from engine.cli import build_parser
    from engine.model_config import ModelConfig
    from engine.presets import resolve_model
    from router.redis_database import check_redis_database

    # Every service reads the model only as it starts, after Redis and the others did: a
    # missing or broken one must fail here, as an aggregated spec's router_flags() (the
    # model's context length) has it fail.
    path = resolve_model(spec.model)
    model = ModelConfig.from_pretrained(path)
    parser = build_parser(benchmarks=False)  # the bench modules import torch
    redis = spec.redis_url or "redis://127.0.0.1:6379/0"
    roles = (["prefill"] if spec.num_prefill else []) + ["decode"]
    for role in roles:
        args = spec.engine_args(role, [])
        worker = _worker_config(parser.parse_args([role, "--model", spec.model, "--redis-url",
                                                   redis, *args]), role)
        model.check_tensor_parallel(worker.engine.tensor_parallel_size)
        worker.engine.check_max_model_len(model.max_position_embeddings,
                                          worker.engine.num_gpu_blocks)
        _check_kv_budget(model, worker.engine, args)
    router = parser.parse_args(["router", "--model", spec.model, "--redis-url", redis,
                                "--port", str(spec.router_port), *spec.router_flags()])
    # Its keys reach it through its environment (ClusterSpec.router_env), which it reads
    # where its flags set none.
    router.api_key = router.api_key or spec.api_key
    router.admin_api_key = router.admin_api_key or spec.admin_api_key
    _router_config(router)
    _check_tokenizer(path, router.tokenizer, model.vocab_size)
    if spec.redis_url is not None:  # else pdserve up starts its own
        asyncio.run(check_redis_database(spec.redis_url))


def _check_tokenizer(path, tokenizer: str | None, vocab_size: int) -> None:
    """A --tokenizer folder without a tokenizer, or one that does not fit the model, refused
    here, not by each service after the others started."""
    from engine.tokenizer_choice import load_model_tokenizer

    if tokenizer is not None:
        load_model_tokenizer(path, tokenizer, vocab_size)


def _check_kv_budget(model, engine, args: list[str]) -> None:
    """A KV-cache memory budget too small for one --max-model-len sequence, refused as each
    rank of the worker will size its cache (engine/setup.py rank_capacity_blocks). On CUDA
    without --kv-cache-memory-gib the budget is what the GPU has left once the weights loaded:
    only the worker knows it."""
    from engine.kv_layout import make_layout
    from router.cluster_spec import on_cpu

    if engine.max_model_len is None or engine.num_gpu_blocks is not None:
        return  # before on_cpu(), which may ask a process of its own for the GPUs
    cpu = on_cpu(args)
    if engine.kv_budget_bytes(cpu) is None:
        return
    dtype = model.compute_dtype(engine.dtype, "cpu" if cpu else "cuda")
    tp = engine.tensor_parallel_size
    per_block = max(make_layout(model, 1, engine.block_size, dtype, rank, tp).bytes_per_block
                    for rank in range(tp))
    engine.check_kv_budget(per_block, cpu)


def _up_router_args(args: argparse.Namespace) -> list[str]:
    out = []
    # Not the API keys: on its command line any local user would read them (ClusterSpec).
    for flag in ("--metrics-port", "--tls-cert-file", "--tls-key-file", "--chat-template",
                 "--generation-config", "--stream-interval", "--max-local-prefill-length",
                 "--served-model-name", "--default-timeout-s", "--client-write-timeout-s",
                 "--block-size", "--tokenizer", "--migration-limit", "--migration-backoff-s",
                 "--request-chat-template-workers", "--request-chat-template-timeout-s",
                 "--request-chat-template-memory-mb"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            out += [flag, str(value)]
    if args.trust_request_chat_template:
        out.append("--trust-request-chat-template")
    return out
