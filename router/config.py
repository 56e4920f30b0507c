"""The router's configuration: one dataclass, validated when built."""
from __future__ import annotations

from dataclasses import dataclass, field

from client.channels import check_api_key
from client.keepalive import check_keepalive
from engine.chat_template import load_chat_template
from engine.config import positive_number
from engine.generation_defaults import check_generation_config
from engine.grpc_server import ServerConfig
from engine.output_processor import check_stream_interval
from router.liveness import LivenessConfig
from router.local_prefill import LocalPrefillConfig
from router.registry import check_namespace, check_redis_url
from router.router_presence import check_router_id, check_served_model_name
from router.template_sandbox import TemplateSandboxConfig

DECODE_STREAMS = ("multiplexed", "per-request")


@dataclass
class RouterConfig:
    # The model the workers serve (HF folder or preset): the router tokenizes with it and
    # computes the same block hashes as the workers.
    model: str
    redis_url: str
    server: ServerConfig = field(default_factory=ServerConfig)
    namespace: str = "pdserve"
    block_size: int = 16
    # How often the router re-reads the worker registry.
    refresh_interval_s: float = 0.5
    # Requests in flight beyond this get RESOURCE_EXHAUSTED at once instead of queueing.
    max_inflight_requests: int = 1024
    # Used when the client sets no deadline (None: none).
    default_timeout_s: float | None = None
    # A Generate chunk that waits this long for its client to take it (the client stopped
    # reading, or its host is gone without closing the connection; or a chunk larger than its
    # link carries in that time) ends the request, CANCELLED: the router holds its output and
    # its in-flight place no longer (router/write_watch.py). 0: never.
    client_write_timeout_s: float = 60.0
    # Without a client deadline, a prefill call that takes longer fails with UNAVAILABLE.
    prefill_timeout_s: float = 600.0
    # When a decode worker prefills a short prompt itself (router/local_prefill.py).
    local_prefill: LocalPrefillConfig = field(default_factory=LocalPrefillConfig)
    # A request whose worker fails under it (UNAVAILABLE: crashed, unreachable, draining)
    # moves to other workers with the tokens it has so far, at most this many times; 0 fails
    # it at once (router/migration.py).
    migration_limit: int = 3
    # A move after a failure whose worker still answers its probe (no crash: a refusal that
    # may come again) waits this long first, twice as long each time after (at most 16x),
    # jittered, never past the request's deadline (router/migration.py); 0: at once.
    migration_backoff_s: float = 0.2
    # A prefilled request that a decode worker refuses for want of room (RESOURCE_EXHAUSTED)
    # tries again, on another when it can, for at most this long while the prefill lease
    # holds its KV (router/decode_wait.py); 0 refuses it at once.
    decode_wait_timeout_s: float = 30.0
    # How requests reach a decode worker: "multiplexed", all of them on one DecodeMany stream
    # per worker with one message per engine step (router/decode_mux.py), or "per-request",
    # a Decode call each with one message per token.
    decode_stream: str = "multiplexed"
    # The router pings every connection it has this often, and a peer that leaves a ping
    # unanswered this long is cut off. A worker's calls then fail with UNAVAILABLE and
    # migrate; a client's are cancelled, with their requests on the workers, where they would
    # go on decoding for nobody. A hung peer (a stopped process, a host gone without closing
    # the connection) is found this way. The timeout leaves the health checks below, which
    # also bar the worker from new requests, to find a hung worker first.
    keepalive_time_s: float = 10.0
    keepalive_timeout_s: float = 20.0
    # Health checks of the workers with calls on them: one that leaves several unanswered is
    # taken as hung and its calls migrate (router/liveness.py), as a rule before keepalive
    # cuts it; they also see a worker whose gRPC answers pings but whose loop is stuck.
    liveness: LivenessConfig = field(default_factory=LivenessConfig)
    # A client stream gets one chunk per this many output tokens (the first at once; see
    # protos/stream_interval.py; decode workers group theirs to the router alike); 1 sends
    # every token as it comes.
    stream_interval: int = 1
    # Callers of Router and RouterAdmin must send it (router/auth.py); None: no key.
    api_key: str | None = field(default=None, repr=False)
    # Callers of RouterAdmin must send this one instead, when set (router/auth.py).
    admin_api_key: str | None = field(default=None, repr=False)
    # Chat prompts are rendered with this Jinja template (a file, or the template inline)
    # instead of the model's own; None: the model's (engine/chat_template.py).
    chat_template: str | None = None
    # Whether a chat may bring its own template (ChatPrompt.chat_template, vLLM's
    # --trust-request-chat-template): the router then runs its clients' Jinja, in Jinja's
    # sandbox, in processes bounded in time and memory by ``request_chat_template``.
    trust_request_chat_template: bool = False
    request_chat_template: TemplateSandboxConfig = field(default_factory=TemplateSandboxConfig)
    # Defaults for the sampling fields a request leaves unset: "auto", the model folder's
    # generation_config.json; "engine", none (the engine's own); or another folder's file.
    generation_config: str = "auto"
    # One line per request on the pdserve.access logger (router/access_log.py).
    log_requests: bool = True
    # This router's name in Redis (its heartbeat, the transfer ledger's entries): unique among
    # the routers sharing a Redis namespace. A router restarted under its id releases the KV
    # leases its predecessor left (router/router_presence.py). "": router-HOSTNAME-[ADDRESS-]PORT.
    router_id: str = ""
    # The model's name to clients (GetModelInfo) and the workers' registered name this router
    # serves requests with (--served-model-name, as theirs): "" for the --model's folder name.
    served_model_name: str = ""
    # The folder of the tokenizer when not the model's (--tokenizer, as the workers'): it
    # tokenizes prompts, renders chats and counts in the fingerprint workers must match.
    tokenizer: str | None = None
    # The template text chat_template names, read when the config is built.
    chat_template_text: str | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model must be a non-empty path or preset name")
        if self.tokenizer is not None and (not isinstance(self.tokenizer, str)
                                           or not self.tokenizer):
            raise ValueError("tokenizer (--tokenizer) must be a non-empty folder path or None")
        check_redis_url(self.redis_url)
        check_namespace(self.namespace)
        # The workers' rule (EngineConfig): a router with another block size hashes prompts
        # into blocks no worker has, and none could be started to match it.
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) \
                or self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size (--block-size) must be a power of two, as the "
                             f"workers' is, got {self.block_size!r}")
        # Finite: inf passed "> 0", and every worker call then failed (its timeout inf).
        positive_number("refresh_interval_s", self.refresh_interval_s)
        if not isinstance(self.max_inflight_requests, int) or self.max_inflight_requests < 1:
            raise ValueError("max_inflight_requests must be >= 1")
        if self.default_timeout_s is not None:
            positive_number("default_timeout_s (--default-timeout-s)", self.default_timeout_s)
        positive_number("prefill_timeout_s (--prefill-timeout-s)", self.prefill_timeout_s)
        if isinstance(self.client_write_timeout_s, bool) \
                or not isinstance(self.client_write_timeout_s, (int, float)) \
                or not 0 <= self.client_write_timeout_s < float("inf"):
            raise ValueError(f"client_write_timeout_s (--client-write-timeout-s) must be a "
                             f"finite number >= 0, got {self.client_write_timeout_s!r}")
        if not isinstance(self.migration_limit, int) or isinstance(self.migration_limit, bool) \
                or self.migration_limit < 0:
            raise ValueError(f"migration_limit must be an integer >= 0, got "
                             f"{self.migration_limit!r}")
        if isinstance(self.migration_backoff_s, bool) \
                or not isinstance(self.migration_backoff_s, (int, float)) \
                or not 0 <= self.migration_backoff_s < float("inf"):
            raise ValueError(f"migration_backoff_s (--migration-backoff-s) must be a finite "
                             f"number >= 0, got {self.migration_backoff_s!r}")
        if isinstance(self.decode_wait_timeout_s, bool) \
                or not isinstance(self.decode_wait_timeout_s, (int, float)) \
                or not 0 <= self.decode_wait_timeout_s < float("inf"):
            raise ValueError(f"decode_wait_timeout_s must be a number >= 0, got "
                             f"{self.decode_wait_timeout_s!r}")
        check_keepalive("keepalive_time_s", self.keepalive_time_s)
        check_keepalive("keepalive_timeout_s", self.keepalive_timeout_s)
        check_stream_interval(self.stream_interval)
        check_api_key(self.api_key)
        check_api_key(self.admin_api_key)
        self.chat_template_text = load_chat_template(self.chat_template)
        if not isinstance(self.trust_request_chat_template, bool):
            raise ValueError(f"trust_request_chat_template must be a bool, got "
                             f"{self.trust_request_chat_template!r}")
        if not isinstance(self.request_chat_template, TemplateSandboxConfig):
            raise ValueError("request_chat_template must be a TemplateSandboxConfig, "
                             f"got {type(self.request_chat_template).__name__}")
        check_generation_config(self.generation_config)
        if self.decode_stream not in DECODE_STREAMS:
            raise ValueError(f"decode_stream must be one of {', '.join(DECODE_STREAMS)}, "
                             f"got {self.decode_stream!r}")
        if not isinstance(self.liveness, LivenessConfig):
            raise ValueError(f"liveness must be a LivenessConfig, got "
                             f"{type(self.liveness).__name__}")
        check_router_id(self.router_id)
        check_served_model_name(self.served_model_name)
        if not isinstance(self.local_prefill, LocalPrefillConfig):
            raise ValueError("local_prefill must be a LocalPrefillConfig, "
                             f"got {type(self.local_prefill).__name__}")

    @property
    def model_name(self) -> str:
        """The name workers must have registered their model under to get requests."""
        return self.served_model_name or self.model
