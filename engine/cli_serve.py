"""The serving subcommands of ``pdserve``: up, router, prefill, decode, and generate --router."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time

_SERVED_MODEL_NAME_HELP = (
    "the name the model is served under: workers register it, a router sends requests only "
    "to workers registered with its own, clients see it (default: --model's folder name; "
    "the last path component is what is compared)")


def add_lifecycle_args(p: argparse.ArgumentParser) -> None:
    """The flags every service's lifecycle takes (engine/grpc_server.py)."""
    p.add_argument("--drain-timeout-s", type=float, default=30.0,
                   help="after SIGTERM: how long requests in flight may run before stopping")
    p.add_argument("--shutdown-grace-s", type=float, default=5.0,
                   help="then gRPC's stop grace; calls still running after it are cut (the "
                        "router moves cut requests to other workers)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (0: a free "
                        "port); default: none")
    p.add_argument("--ready-fd", type=int, default=None,
                   help="an inherited pipe: HOST:PORT is written to it once serving (how "
                        "pdserve up learns a port 0 choice)")
    p.add_argument("--parent-fd", type=int, default=None,
                   help="the read end of an inherited pipe whose write end only the launcher "
                        "holds: at its end of file (the launcher is gone, even SIGKILLed) "
                        "the service stops as on SIGTERM (pdserve up passes it)")


def add_worker_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    p.add_argument("--redis-url", default=None, help="registry and prefix index (redis://...)")
    p.add_argument("--namespace", default="pdserve")
    p.add_argument("--served-model-name", default="",
                   help=_SERVED_MODEL_NAME_HELP)
    p.add_argument("--worker-id", default="",
                   help="unique in the cluster; {port} in it becomes the bound port")
    p.add_argument("--kv-transfer-backend", default="nixl", choices=["nixl", "torch"],
                   help="how decode workers pull KV: NIXL (RDMA or host memory), or a "
                        "torch.distributed pair group per prefill/decode pair (gloo on CPU, "
                        "NCCL on CUDA)")
    p.add_argument("--kv-transfer-timeout-s", type=float, default=30.0)
    p.add_argument("--kv-lease-timeout-s", type=float, default=60.0)
    p.add_argument("--kv-quarantine-s", type=float, default=60.0,
                   help="decode: blocks a failed KV pull may still be writing into stay out of "
                        "use this long")
    p.add_argument("--max-pending-requests", type=int, default=256)
    p.add_argument("--heartbeat-interval-s", type=float, default=1.0)
    p.add_argument("--engine-step-timeout-s", type=float, default=120.0,
                   help="an engine step running longer is taken as wedged (a hung device or "
                        "collective): the worker leaves, its requests move on, and it exits "
                        "non-zero for its supervisor to restart it (0: no limit)")
    p.add_argument("--engine-process", action="store_true",
                   help="the engine steps in a process of its own, so this worker's gRPC event "
                        "loop never waits for the GIL its step needs, nor the step for it")
    add_lifecycle_args(p)
    p.add_argument("--core-share", default=None, metavar="PATH",
                   help="a file co-located workers share: while the others are idle, this "
                        "worker's steps borrow their cores (pdserve up sets it)")
    p.add_argument("--core-share-cores", type=int, default=None,
                   help="cores the --core-share group shares (default: this host's)")


def _worker_config(args: argparse.Namespace, role: str):
    from engine.cli import engine_kwargs
    from engine.config import EngineConfig
    from engine.grpc_server import ServerConfig
    from engine.worker_runtime import WorkerConfig

    engine = EngineConfig(model=args.model, role=role,
                          kv_transfer_backend=args.kv_transfer_backend,
                          kv_transfer_timeout_s=args.kv_transfer_timeout_s,
                          kv_lease_timeout_s=args.kv_lease_timeout_s,
                          kv_quarantine_s=args.kv_quarantine_s, **engine_kwargs(args))
    return WorkerConfig(engine=engine,
                        server=ServerConfig(args.host, args.port, args.drain_timeout_s,
                                             args.shutdown_grace_s, ready_fd=args.ready_fd,
                                             parent_fd=args.parent_fd,
                                             metrics_port=args.metrics_port),
                        worker_id=args.worker_id, redis_url=args.redis_url,
                        namespace=args.namespace, heartbeat_interval_s=args.heartbeat_interval_s,
                        max_pending_requests=args.max_pending_requests,
                        core_share_path=args.core_share,
                        core_share_cores=args.core_share_cores,
                        engine_step_timeout_s=args.engine_step_timeout_s or None,
                        engine_process=args.engine_process,
                        served_model_name=args.served_model_name)


def cmd_prefill(args: argparse.Namespace) -> int:
    from prefill_svc.server import main

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    main(_worker_config(args, "prefill"))
    return 0


def cmd_decode(args: argparse.Namespace) -> int:
    from decode_svc.server import main

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    main(_worker_config(args, "decode"))
    return 0


def add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--redis-url", required=True)
    p.add_argument("--served-model-name", default="",
                   help=_SERVED_MODEL_NAME_HELP)
    p.add_argument("--namespace", default="pdserve")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-inflight-requests", type=int, default=1024)
    p.add_argument("--max-local-prefill-length", type=int, default=0,
                   help="conditional disaggregation: a prompt with at most this many tokens "
                        "uncached on the chosen prefill worker may be prefilled on the decode "
                        "worker; 0 (the default) turns local prefill off")
    p.add_argument("--local-prefill-queue-threshold", type=int, default=2,
                   help="prefill locally only while the chosen prefill worker has at least this "
                        "many prefill requests in flight from this router (0: always)")
    p.add_argument("--decode-prefix-reuse-min-tokens", type=int, default=64,
                   help="a decode worker holding at least this many more of a prompt's tokens "
                        "than the chosen prefill worker (a chat's next turn, after the reply "
                        "it streamed) prefills the prompt itself, when it has no more than that "
                        "lead left to compute; 0 turns this off")
    p.add_argument("--decode-stream", default="multiplexed",
                   choices=("multiplexed", "per-request"),
                   help="multiplexed: one DecodeMany stream per decode worker carries every "
                        "request, one message per engine step; per-request: a Decode call per "
                        "request, one message per token")
    p.add_argument("--tls-cert-file", default=None,
                   help="PEM certificate (chain): serve clients over TLS, with --tls-key-file")
    p.add_argument("--tls-key-file", default=None, help="PEM private key of --tls-cert-file")
    p.add_argument("--api-key", default=None,
                   help="callers of the Router and RouterAdmin services must send "
                        "'authorization: Bearer KEY' (default: $PDSERVE_API_KEY, else none)")
    p.add_argument("--admin-api-key", default=None,
                   help="callers of RouterAdmin (drain, cancel, reset caches) must send this key "
                        "instead of --api-key (default: $PDSERVE_ADMIN_API_KEY, else "
                        "--api-key's)")
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="render chat prompts with this Jinja template (a file, or the template "
                        "itself) instead of the model's own; needed for models without one")
    p.add_argument("--disable-log-requests", dest="log_requests", action="store_false",
                   help="no access-log line per request (logger pdserve.access)")
    p.add_argument("--generation-config", default="auto", metavar="auto|engine|FOLDER",
                   help="sampling defaults for fields a request leaves unset: the model's "
                        "generation_config.json (auto), none (engine), or another folder's")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="send clients one chunk per N output tokens (the first at once): "
                        "fewer messages per token for the router and the client")
    p.add_argument("--keepalive-time-s", type=float, default=10.0,
                   help="seconds between keepalive pings on each worker connection")
    p.add_argument("--keepalive-timeout-s", type=float, default=5.0,
                   help="a worker that leaves a ping unanswered this long is cut off and its "
                        "requests move to other workers (how a hung worker is found; gRPC "
                        "1.85 was measured to wait ~60 s whatever this says)")
    p.add_argument("--health-check-interval-s", type=float, default=2.0,
                   help="seconds between health checks of each worker the router has calls "
                        "on (0: none)")
    p.add_argument("--health-check-misses", type=int, default=3,
                   help="a worker that leaves this many health checks in a row unanswered is "
                        "taken as hung: its requests move to other workers")
    p.add_argument("--migration-limit", type=int, default=3,
                   help="times a request may move to other workers when its worker fails "
                        "under it, continuing from the tokens already streamed (0: fail it)")
    p.add_argument("--decode-wait-timeout-s", type=float, default=30.0,
                   help="a prefilled request that decode workers refuse for want of room "
                        "tries again for up to this long while its prefill lease holds the "
                        "KV (0: the client gets RESOURCE_EXHAUSTED at once)")
    add_lifecycle_args(p)
    p.add_argument("--router-id", default="",
                   help="this router's name in Redis, unique among the routers sharing it; "
                        "restarted under it, the router releases the KV leases its "
                        "predecessor left (default: router-HOSTNAME-[ADDRESS-]PORT)")


def cmd_router(args: argparse.Namespace) -> int:
    from router.server import main

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    main(_router_config(args))
    return 0


def _router_config(args: argparse.Namespace):
    from engine.grpc_server import ServerConfig
    from router.config import RouterConfig
    from router.liveness import LivenessConfig
    from router.local_prefill import LocalPrefillConfig

    return (RouterConfig(model=args.model, redis_url=args.redis_url,
                      server=ServerConfig(args.host, args.port, args.drain_timeout_s,
                                          args.shutdown_grace_s, ready_fd=args.ready_fd,
                                          parent_fd=args.parent_fd,
                                          metrics_port=args.metrics_port,
                                          tls_cert_file=args.tls_cert_file,
                                          tls_key_file=args.tls_key_file),
                      api_key=args.api_key or os.environ.get("PDSERVE_API_KEY") or None,
                      admin_api_key=(args.admin_api_key
                                     or os.environ.get("PDSERVE_ADMIN_API_KEY") or None),
                      namespace=args.namespace, block_size=args.block_size,
                      max_inflight_requests=args.max_inflight_requests,
                      migration_limit=args.migration_limit,
                      decode_wait_timeout_s=args.decode_wait_timeout_s,
                      decode_stream=args.decode_stream,
                      keepalive_time_s=args.keepalive_time_s,
                      keepalive_timeout_s=args.keepalive_timeout_s,
                      stream_interval=args.stream_interval, chat_template=args.chat_template,
                      generation_config=args.generation_config,
                      log_requests=args.log_requests, router_id=args.router_id,
                      served_model_name=args.served_model_name,
                      liveness=LivenessConfig(args.health_check_interval_s,
                                              args.health_check_misses),
                      local_prefill=LocalPrefillConfig(
                          max_local_prefill_length=args.max_local_prefill_length,
                          local_prefill_queue_threshold=args.local_prefill_queue_threshold,
                          decode_prefix_reuse_min_tokens=args.decode_prefix_reuse_min_tokens)))


def add_up_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--prefill", type=int, default=1,
                   help="prefill workers; 0 runs aggregated: the decode workers prefill every "
                        "prompt themselves, behind the same router")
    p.add_argument("--decode", type=int, default=1, help="decode workers")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="TP ranks per prefill worker")
    p.add_argument("--redis-url", default=None, help="default: start the bundled redis-server")
    p.add_argument("--port", type=int, default=50051, help="the router's port")
    p.add_argument("--num-gpu-blocks", type=int, default=None,
                   help="KV blocks per worker (default: from the memory budget)")
    # Engine flags every worker gets as given (see `pdserve prefill --help`); unset: theirs.
    p.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--enforce-eager", action="store_true", default=None)
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
    p.add_argument("--tls-cert-file", default=None,
                   help="the router serves clients over TLS with this PEM certificate...")
    p.add_argument("--tls-key-file", default=None, help="...and this PEM key")
    p.add_argument("--api-key", default=None,
                   help="the router's API key (router --api-key; default: $PDSERVE_API_KEY)")
    p.add_argument("--admin-api-key", default=None,
                   help="the router's admin API key (router --admin-api-key; default: "
                        "$PDSERVE_ADMIN_API_KEY)")
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="the router renders chat prompts with this template (router "
                        "--chat-template; default: the model's own)")
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
    p.add_argument("--max-restarts", type=int, default=5,
                   help="a service that crashes is started again, up to this many crashes "
                        "per role within 10 minutes; then, or with 0, everything stops")


class _StopWhileStarting(Exception):
    """SIGINT or SIGTERM reached ``pdserve up`` before its cluster was up."""


def cmd_up(args: argparse.Namespace) -> int:
    from router.launcher import Cluster
    from router.supervisor import Supervisor

    spec = up_spec(args)
    stop = threading.Event()

    def stop_starting(*_) -> None:
        # While the services start (minutes, for a large model), a stop must not wait for
        # them: the exception unwinds Cluster.start, which stops what it started. Once only:
        # a second signal must not cut that cleanup short.
        if not stop.is_set():
            stop.set()
            raise _StopWhileStarting

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop_starting)
    cluster = None
    try:
        cluster = Cluster(spec).start()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    except _StopWhileStarting:
        if cluster is not None:  # the signal came as start returned
            cluster.stop()
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
    if args.max_local_prefill_length is not None:
        from router.local_prefill import LocalPrefillConfig

        LocalPrefillConfig(max_local_prefill_length=args.max_local_prefill_length)
    extra = [] if args.num_gpu_blocks is None else ["--num-gpu-blocks", str(args.num_gpu_blocks)]
    if args.scheduling_policy:
        extra += ["--scheduling-policy", args.scheduling_policy]
    if args.served_model_name:
        extra += ["--served-model-name", args.served_model_name]
    for flag in ("--dtype", "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            extra += [flag, str(value)]
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

    # Every service reads the model only as it starts, after Redis and the others did: a
    # missing or broken one must fail here, as an aggregated spec's router_flags() (the
    # model's context length) has it fail.
    ModelConfig.from_pretrained(resolve_model(spec.model))
    parser = build_parser()
    redis = spec.redis_url or "redis://127.0.0.1:6379/0"
    roles = (["prefill"] if spec.num_prefill else []) + ["decode"]
    for role in roles:
        _worker_config(parser.parse_args([role, "--model", spec.model, "--redis-url", redis,
                                          *spec.engine_args(role, [])]), role)
    router = parser.parse_args(["router", "--model", spec.model, "--redis-url", redis,
                                "--port", str(spec.router_port), *spec.router_flags()])
    # Its keys reach it through its environment (ClusterSpec.router_env), which it reads
    # where its flags set none.
    router.api_key = router.api_key or spec.api_key
    router.admin_api_key = router.admin_api_key or spec.admin_api_key
    _router_config(router)


def _up_router_args(args: argparse.Namespace) -> list[str]:
    out = []
    # Not the API keys: on its command line any local user would read them (ClusterSpec).
    for flag in ("--metrics-port", "--tls-cert-file", "--tls-key-file", "--chat-template",
                 "--generation-config", "--stream-interval", "--max-local-prefill-length",
                 "--served-model-name"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            out += [flag, str(value)]
    return out


def cmd_generate_remote(args: argparse.Namespace) -> int:
    """Streams one prompt through a running router."""
    from client import Client, PdserveError
    from engine.cli import sampling_kwargs
    from engine.cli_admin import connection_kwargs

    try:
        with Client([a.strip() for a in args.router.split(",") if a.strip()],
                    **connection_kwargs(args)) as c:
            sampling = sampling_kwargs(args, c.model_info().sampling_defaults)
            t0 = time.perf_counter()
            for chunk in c.generate(args.prompt, **sampling):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                if chunk.usage is not None:
                    u = chunk.usage
                    print(f"\n[{u.completion_tokens} tokens, TTFT {u.timings.ttft_s * 1e3:.1f} ms, "
                          f"total {(time.perf_counter() - t0) * 1e3:.0f} ms, "
                          f"{u.cached_tokens} cached prompt tokens]")
    except PdserveError as e:
        print(f"pdserve: error: {e.code.name}: {e.details}", file=sys.stderr)
        return 1
    return 0


def cmd_demo_serving(args: argparse.Namespace, prompts: list[str]) -> int:
    """`make demo`: pdserve up on the model, prompts streamed through the SDK, clean stop."""
    from client import Client
    from engine.presets import resolve_model
    from router.launcher import Cluster, ClusterSpec

    print(f"preparing {args.model} (built-in presets are generated on first use) ...", flush=True)
    resolve_model(args.model)
    print("starting redis-server, the router, a prefill and a decode worker ...", flush=True)
    # No access log: its line per request would land in the middle of the streamed text, and
    # the demo prints its own summary of each request.
    spec = ClusterSpec(model=args.model, worker_args=["--num-gpu-blocks", "512"],
                       router_args=["--disable-log-requests"])
    with Cluster(spec) as cluster, Client(cluster.router_address, timeout=120) as client:
        print(f"router on {cluster.router_address}", flush=True)
        for prompt in prompts:
            print(f"\n>>> {prompt}", flush=True)
            t0 = time.perf_counter()
            stamps: list[float] = []
            usage = None
            for chunk in client.generate(prompt, max_tokens=args.max_tokens, temperature=0.0,
                                         ignore_eos=True):
                stamps.extend([time.perf_counter()] * len(chunk.token_ids))
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                usage = chunk.usage or usage
            itl = (stamps[-1] - stamps[0]) / max(len(stamps) - 1, 1)
            t = usage.timings
            print(f"\n[{len(stamps)} tokens, TTFT {(stamps[0] - t0) * 1e3:.1f} ms, ITL "
                  f"{itl * 1e3:.1f} ms | prefill {t.prefill_compute_s * 1e3:.1f} ms on "
                  f"{usage.prefill_worker_id}, KV transfer {t.kv_transfer_s * 1e3:.1f} ms, "
                  f"decode on {usage.decode_worker_id}]", flush=True)
        print("\nstopping the cluster ...", flush=True)
    print("(random-weight tiny model: the text is noise; the tokens match Hugging Face's)")
    return 0
