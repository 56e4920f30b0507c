"""The single-service subcommands of ``pdserve``: router, prefill and decode (``up``, which starts
them all, is engine/cli_up.py; the router's clients are engine/cli_remote.py)."""
from __future__ import annotations

import argparse
import logging
import os

_SERVED_MODEL_NAME_HELP = (
    "the name the model is served under: workers register it, a router sends requests only "
    "to workers registered with its own, clients see it (default: --model's folder name; "
    "the last path component is what is compared)")

TOKENIZER_HELP = (
    "a local folder holding the tokenizer's files, when not --model's (a checkpoint without "
    "them, or another compatible tokenizer; its ids must all be < the model's vocab_size). "
    "The router and every worker must get the same one: it is part of the model fingerprint "
    "they are matched by (default: --model's folder)")


def tokenizer_flags(tokenizer: str | None) -> list[str]:
    """``--tokenizer`` for services a launcher starts (none: []), the folder made absolute:
    they may run in another working directory."""
    return [] if tokenizer is None else ["--tokenizer",
                                         os.path.abspath(os.path.expanduser(tokenizer))]


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
                   help="cores the --core-share group shares (default: the CPUs this "
                        "process may use, after its affinity and cgroup quota)")


def _worker_config(args: argparse.Namespace, role: str):
    from engine.cli import engine_kwargs
    from engine.config import EngineConfig
    from engine.grpc_server import ServerConfig
    from engine.worker_runtime import WorkerConfig

    engine = EngineConfig(model=args.model, role=role,
                          kv_transfer_backend=args.kv_transfer_backend,
                          kv_transfer_timeout_s=args.kv_transfer_timeout_s,
                          kv_lease_timeout_s=args.kv_lease_timeout_s,
                          kv_quarantine_s=args.kv_quarantine_s, seed=args.seed,
                          **engine_kwargs(args))
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


def _record_stop_signals() -> None:
    """Before the service's imports (torch: seconds) and its model load: a SIGTERM meanwhile
    ends it with 0 once it can stop, not with -15 (engine/process_exit.py)."""
    from engine.process_exit import record_stop_signals

    record_stop_signals()


def cmd_prefill(args: argparse.Namespace) -> int:
    _record_stop_signals()
    from prefill_svc.server import main

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    main(_worker_config(args, "prefill"))
    return 0


def cmd_decode(args: argparse.Namespace) -> int:
    _record_stop_signals()
    from decode_svc.server import main

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    main(_worker_config(args, "decode"))
    return 0


def add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--tokenizer", default=None, metavar="FOLDER", help=TOKENIZER_HELP)
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
    # Each second spelling is vLLM's: a command line written for it works here too.
    p.add_argument("--tls-cert-file", "--ssl-certfile", default=None,
                   help="PEM certificate (chain): serve clients over TLS, with --tls-key-file")
    p.add_argument("--tls-key-file", "--ssl-keyfile", default=None,
                   help="PEM private key of --tls-cert-file")
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
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="a chat request may bring its own template (vLLM's chat_template "
                        "field): the router runs its clients' Jinja, sandboxed, in processes "
                        "of its own bounded by the three flags below")
    p.add_argument("--request-chat-template-workers", type=int, default=2,
                   help="processes rendering requests' own templates at once")
    p.add_argument("--request-chat-template-timeout-s", type=float, default=5.0,
                   help="a request's template rendering longer is stopped (INVALID_ARGUMENT)")
    p.add_argument("--request-chat-template-memory-mb", type=int, default=1024,
                   help="memory a request's template may allocate (INVALID_ARGUMENT past it)")
    p.add_argument("--disable-log-requests", dest="log_requests", action="store_false",
                   default=True, help="no access-log line per request (logger pdserve.access)")
    p.add_argument("--enable-log-requests", dest="log_requests", action="store_true",
                   default=True, help="an access-log line per request: the default here "
                                      "(vLLM's flag, off by default there)")
    p.add_argument("--generation-config", default="auto", metavar="auto|engine|FOLDER",
                   help="sampling defaults for fields a request leaves unset: the model's "
                        "generation_config.json (auto), none (engine), or another folder's")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="send clients one chunk per N output tokens (the first at once): "
                        "fewer messages per token for the router and the client")
    p.add_argument("--keepalive-time-s", type=float, default=10.0,
                   help="seconds between keepalive pings on each worker and client "
                        "connection")
    p.add_argument("--keepalive-timeout-s", type=float, default=20.0,
                   help="a peer that leaves a ping unanswered this long is cut off: a "
                        "worker's requests move to other workers, a client's are cancelled "
                        "(how a hung worker or a vanished client is found)")
    p.add_argument("--health-check-interval-s", type=float, default=2.0,
                   help="seconds between health checks of each worker the router has calls "
                        "on (0: none)")
    p.add_argument("--health-check-misses", type=int, default=3,
                   help="a worker that leaves this many health checks in a row unanswered is "
                        "taken as hung: its requests move to other workers")
    p.add_argument("--migration-limit", type=int, default=3,
                   help="times a request may move to other workers when its worker fails "
                        "under it, continuing from the tokens already streamed (0: fail it)")
    p.add_argument("--migration-backoff-s", type=float, default=0.2,
                   help="a move after a failure whose worker still answers (no crash: a "
                        "refusal that may come again) waits this long first, doubling each "
                        "time after (at most 16x), jittered, never past the deadline (0: at "
                        "once)")
    p.add_argument("--default-timeout-s", type=float, default=None,
                   help="the deadline of a request whose client sets none, from its arrival "
                        "(default: none; its legs then wait at most 10 x --prefill-timeout-s)")
    p.add_argument("--client-write-timeout-s", type=float, default=60.0,
                   help="a Generate chunk that waits this long for its client to take it "
                        "(the client stopped reading, or its link is too slow for the chunk) "
                        "ends the request, CANCELLED (0: never)")
    p.add_argument("--prefill-timeout-s", type=float, default=600.0,
                   help="a Prefill call that takes longer than this fails its worker "
                        "(UNAVAILABLE: the request moves on), whatever the deadline")
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
    _record_stop_signals()
    from router.server import main

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    main(_router_config(args))
    return 0


def _router_config(args: argparse.Namespace):
    from engine.grpc_server import ServerConfig
    from router.config import RouterConfig
    from router.liveness import LivenessConfig
    from router.local_prefill import LocalPrefillConfig
    from router.template_sandbox import TemplateSandboxConfig

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
                      migration_backoff_s=args.migration_backoff_s,
                      default_timeout_s=args.default_timeout_s,
                      client_write_timeout_s=args.client_write_timeout_s,
                      prefill_timeout_s=args.prefill_timeout_s,
                      decode_wait_timeout_s=args.decode_wait_timeout_s,
                      decode_stream=args.decode_stream,
                      keepalive_time_s=args.keepalive_time_s,
                      keepalive_timeout_s=args.keepalive_timeout_s,
                      stream_interval=args.stream_interval, chat_template=args.chat_template,
                      trust_request_chat_template=args.trust_request_chat_template,
                      request_chat_template=TemplateSandboxConfig(
                          args.request_chat_template_workers,
                          args.request_chat_template_timeout_s,
                          args.request_chat_template_memory_mb),
                      generation_config=args.generation_config,
                      log_requests=args.log_requests, router_id=args.router_id,
                      served_model_name=args.served_model_name, tokenizer=args.tokenizer,
                      liveness=LivenessConfig(args.health_check_interval_s,
                                              args.health_check_misses),
                      local_prefill=LocalPrefillConfig(
                          max_local_prefill_length=args.max_local_prefill_length,
                          local_prefill_queue_threshold=args.local_prefill_queue_threshold,
                          decode_prefix_reuse_min_tokens=args.decode_prefix_reuse_min_tokens)))
