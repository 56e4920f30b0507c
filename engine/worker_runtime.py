"""What the prefill and decode services share: the engine in its thread, admission control,
worker info, gRPC status mapping, and presence in Redis (registry heartbeat; a prefill worker's
KV-cache events for the prefix index).

The services themselves are thin: they convert protos and drive their engine role.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from engine.call_abort import KV_SOURCE_FAILED, REFUSED, abort_call
from engine.config import EngineConfig
from engine.core_share import CoreShare, CoreShareConfig, lend_delay_from_env
from engine.cpus import usable_cpus
from engine.engine_client import EngineProcess, RemoteLLM
from engine.engine_front import EngineDeadError, EngineFront
from engine.engine_pipe import EngineProcSpec
from engine.grpc_server import ServerConfig
from engine.kv_cache_manager import NoFreeBlocksError
from engine.kv_peers import KVPeerConnector
from engine.outputs import LeaseEnded
from kvtransfer import handle_mac
from protos import common_pb2
from router.redis_database import DatabaseRefusal
from router.registry import ROUTER_TTL_S, check_namespace, check_redis_url
from router.router_presence import check_served_model_name, check_worker_id

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)
# Two beats fit in the routers' TTL: one late beat does not drop the worker.
_MAX_HEARTBEAT_INTERVAL_S = ROUTER_TTL_S / 2


@dataclass
class WorkerConfig:
    engine: EngineConfig
    server: ServerConfig = field(default_factory=ServerConfig)
    # Unique in the cluster; default "<role>-<host>-<port>-<pid>". "{port}" in it becomes the
    # bound port (a launcher that passes port 0 names its workers so).
    worker_id: str = ""
    # None: no registry and no prefix index (a worker driven directly, as in some tests).
    redis_url: str | None = None
    namespace: str = "pdserve"
    heartbeat_interval_s: float = 1.0
    # Requests accepted and not finished beyond this get RESOURCE_EXHAUSTED at once.
    max_pending_requests: int = 256
    # A file co-located workers share (engine/core_share.py): while the others are idle this
    # worker's steps use all ``core_share_cores`` (default: the CPUs it may use), else its own
    # OMP_NUM_THREADS. None: a fixed thread count.
    core_share_path: str | None = None
    core_share_cores: int | None = None
    # An engine step running longer than this is taken as wedged (a hung device or
    # collective): the engine dies, the worker leaves and exits non-zero. None: no limit.
    engine_step_timeout_s: float | None = 120.0
    # The engine steps in a process of its own (engine/engine_proc.py), so this process's
    # event loop (gRPC, protobuf, asyncio: per token) never holds the GIL its step needs.
    engine_process: bool = False
    # The name this worker registers its model under, which routers match theirs against
    # (--served-model-name): "" for the --model's folder name.
    served_model_name: str = ""

    def __post_init__(self) -> None:
        # Here, not only in the Registry, which is made once the engine is up (minutes, for a
        # large model).
        check_namespace(self.namespace)
        if self.engine.role not in ("prefill", "decode"):
            raise ValueError(f"a worker's engine role must be prefill or decode, "
                             f"got {self.engine.role!r}")
        if not 0 < self.heartbeat_interval_s <= _MAX_HEARTBEAT_INTERVAL_S:
            raise ValueError(f"heartbeat_interval_s must be in (0, {_MAX_HEARTBEAT_INTERVAL_S:g}] "
                             f"(routers take a worker {ROUTER_TTL_S:g} s without one for gone), "
                             f"got {self.heartbeat_interval_s}")
        if not isinstance(self.max_pending_requests, int) or self.max_pending_requests < 1:
            raise ValueError(f"max_pending_requests must be >= 1, got {self.max_pending_requests!r}")
        if self.engine.kv_transfer_backend is None:
            raise ValueError("a prefill or decode worker needs kv_transfer_backend (nixl or torch)")
        if self.core_share_path is not None and self.engine.tensor_parallel_size != 1:
            # TP ranks are processes of their own with their own thread counts.
            raise ValueError("core sharing needs --tensor-parallel-size 1")
        if self.core_share_path is None and self.core_share_cores is not None:
            raise ValueError("core_share_cores needs core_share_path")
        t = self.engine_step_timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float))
                              or not 1 <= t <= 86400):
            raise ValueError(f"engine_step_timeout_s must be seconds in [1, 86400] or None, "
                             f"got {t!r}")
        if self.redis_url is not None:
            check_redis_url(self.redis_url)
        check_worker_id(self.worker_id)
        check_served_model_name(self.served_model_name)
        cores = self.core_share_cores
        if cores is not None and (isinstance(cores, bool) or not isinstance(cores, int)
                                  or cores < 1):
            raise ValueError(f"core_share_cores must be a positive integer, got "
                             f"{self.core_share_cores!r}")

    @property
    def shared_cores(self) -> int:
        """The cores the core-share group shares (with core sharing on): those this process
        may use, not the host's."""
        return self.core_share_cores or usable_cpus()

    def core_share_config(self, base_threads: int) -> CoreShareConfig | None:
        if self.core_share_path is None:
            return None
        cores = self.shared_cores
        return CoreShareConfig(self.core_share_path, cores, min(base_threads, cores),
                               lend_delay_s=lend_delay_from_env())

    def engine_config(self) -> EngineConfig:
        """The engine's config; with core sharing its steps may use every shared core, and
        its packed weights must be laid out for that many threads."""
        if self.core_share_path is None or self.engine.max_cpu_threads is not None:
            return self.engine
        return dataclasses.replace(self.engine, max_cpu_threads=self.shared_cores)

    @property
    def role(self) -> str:
        return self.engine.role


class RejectError(Exception):
    """Refused before any work: carries the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status a failure maps to (never a raw traceback to the caller)."""
    from kvtransfer import TransferError

    if isinstance(exc, RejectError):
        return exc.code
    if isinstance(exc, NoFreeBlocksError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    # Before the timeouts: a KV pull that timed out (TransferTimeout) is its source worker's
    # failure, which a retry elsewhere recovers from, not the caller's deadline.
    if isinstance(exc, (EngineDeadError, TransferError, ConnectionError)):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.INTERNAL


def status_and_message(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """``status_for(exc)`` and the message the caller reads; internal errors are logged here
    with their traceback, and reach the caller as their type and text only."""
    code = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        logger.exception("internal error", exc_info=exc)
        return code, f"{type(exc).__name__}: {exc}"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED and not str(exc):
        return code, "deadline exceeded"
    return code, str(exc)


def failure_marks(exc: BaseException) -> tuple:
    """The trailing metadata that tells the router whose failure ``exc`` is
    (engine/call_abort.py): none took place here (a refusal), or the KV's source's."""
    from kvtransfer import TransferError

    if isinstance(exc, RejectError):
        return REFUSED
    if isinstance(exc, TransferError):
        return KV_SOURCE_FAILED
    return ()


async def abort_for(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    await abort_call(context, *status_and_message(exc), failure_marks(exc))


async def _fingerprint(config: WorkerConfig) -> str:
    """The served folder's fingerprint, read once the engine loaded it (a preset exists by
    then), with the tokenizer files of --tokenizer's folder when given: this worker's engine
    detokenizes, applies stop strings and stops on the tokenizer's eos with it."""
    from engine.model_fingerprint import model_fingerprint
    from engine.presets import resolve_model
    from engine.tokenizer_choice import tokenizer_folder

    def read() -> str:
        path = resolve_model(config.engine.model)
        return model_fingerprint(path, tokenizer_folder(path, config.engine.tokenizer))

    return await asyncio.to_thread(read)


class WorkerRuntime:
    """One worker's engine, load and cluster presence. Build with ``await WorkerRuntime.create``."""

    def __init__(self, config: WorkerConfig, engine: LLMEngine | RemoteLLM,
                 front: EngineProcess | None = None, model_fingerprint: str = "") -> None:
        self.config = config
        # The model folder's content (engine/model_fingerprint.py), for the router's check.
        self.model_fingerprint = model_fingerprint
        # The engine's methods this worker calls itself (KV pulls, prefix-cache reset, its
        # layout): the engine, or with --engine-process its proxy.
        self.llm = engine
        self.engine: EngineFront
        if front is None:
            # With the engine in this process (the engine thread); torch only then, so that a
            # worker whose engine runs in a process of its own never loads it.
            import torch

            from engine.async_engine import AsyncEngine

            share = config.core_share_config(torch.get_num_threads())
            self.engine = AsyncEngine(engine, on_step=self._on_step,
                                      core_share=CoreShare(share) if share else None,
                                      on_dead=self._engine_died,
                                      step_timeout_s=config.engine_step_timeout_s)
        else:
            front.on_dead = self._engine_died
            front.on_kv_events = self._add_kv_events
            self.engine = front
        # Set once a step failed: the engine cannot serve again (a TP rank died, a CUDA
        # error), so the worker stops and exits non-zero for its supervisor to restart it.
        # An engine process that died before on_dead was set (while the fingerprint was
        # read) told nobody: the worker registered, served and refused every request.
        self.engine_failure: BaseException | None = getattr(front, "error", None)
        # Called when the engine dies; run_worker points it at the server's stop.
        self.on_fatal = None
        # Redis refusing the database of --redis-url once it answers (it did not at the
        # start-up check): run_worker stops the worker, which exits as that check would.
        self.database_refusal = DatabaseRefusal()
        self.address = ""
        self.worker_id = config.worker_id
        self.inflight = 0
        self.draining = False
        # Called on the loop when the drain starts (e.g. to end idle long-lived streams, which
        # the server's stop would otherwise cut).
        self.on_drain: list[Callable[[], None]] = []
        # Called on the loop with each lease's request id as the engine ends it (a reader's
        # release, ReleaseKV or expiry): the prefill servicer's view of what it still leases.
        self.on_lease_ended: Callable[[str], None] | None = None
        # A decode worker's: told (worker id, rank handles, key) of each prefill worker its
        # KV peer connector meets (the decode servicer's KV sources remember the key).
        self.on_kv_source: Callable[[str, list[bytes], bytes], None] | None = None
        # The transfer-ledger entries of the leases held now, each with what is left of it:
        # the prefill servicer's, for the republish to put in place of the ledger's.
        self.held_transfers: Callable[[], list] | None = None
        self.kv_bytes = 0
        self.kv_failures = 0
        # A decode worker's ForgetLease answers (decode_svc/service.py), by answer.
        self.leases_forgotten = 0
        self.leases_forget_reading = 0
        self.leases_forget_no_room = 0
        # Static for the engine's life: serialized once, not on every heartbeat.
        self._layouts = [lay.to_json() for lay in engine.kv_cache_layouts()]
        # This engine's ranks' KV-agent handles, serialized once (the agents live as long as
        # the engine): prefill responses carry them and the registry publishes them.
        self.kv_handle_bytes = [h.to_bytes() for h in engine.kv_transfer_handles()]
        # What a prefill worker signs its KV handles with, published with its rank handles.
        self.kv_mac_key = handle_mac.new_key()
        self._presence = None  # router.presence.WorkerPresence once started with Redis
        self._peers = None  # engine.kv_peers.KVPeerConnector: a decode worker's, with Redis

    @classmethod
    async def create(cls, config: WorkerConfig) -> WorkerRuntime:
        loop = asyncio.get_running_loop()
        if config.engine_process:
            loop.set_default_executor(ThreadPoolExecutor(thread_name_prefix="pdserve-worker"))
            front = await EngineProcess.start(EngineProcSpec(
                config.engine_config(), config.core_share_config(config.shared_cores),
                config.engine_step_timeout_s))
            return cls(config, front.llm, front, await _fingerprint(config))
        from engine.llm_engine import LLMEngine
        from engine.openmp_threads import call_in_own_thread, use_one_openmp_thread

        # The loop's executor runs the engine's side jobs (KV pulls, stats, commits): on one
        # OpenMP thread each, so they never start teams beside the engine thread's.
        loop.set_default_executor(ThreadPoolExecutor(
            thread_name_prefix="pdserve-worker", initializer=use_one_openmp_thread))
        # Loading weights (and starting TP ranks) takes seconds: off the loop, and in a thread
        # that ends once built, so its OpenMP team does not outlive it (engine/openmp_threads).
        engine = await asyncio.to_thread(call_in_own_thread, LLMEngine, config.engine_config())
        engine.enable_kv_events()  # for the registry's prefix index and the transfer ledger
        return cls(config, engine, model_fingerprint=await _fingerprint(config))

    def bind(self, address: str) -> None:
        host, _, port = address.rpartition(":")
        if host in ("0.0.0.0", "::", "[::]"):
            address = f"{socket.gethostname()}:{port}"
        self.address = address
        self.worker_id = self.worker_id.replace("{port}", port)
        if not self.worker_id:
            self.worker_id = f"{self.config.role}-{address.replace(':', '-')}-{os.getpid()}"

    # --- admission ------------------------------------------------------------------------
    @contextlib.contextmanager
    def admit(self):
        """Counts a request in flight; refuses it when draining, dead or full."""
        if self.draining:
            raise RejectError(grpc.StatusCode.UNAVAILABLE, f"worker {self.worker_id} is draining")
        if not self.engine.alive:
            raise RejectError(grpc.StatusCode.UNAVAILABLE, f"worker {self.worker_id}'s engine "
                              f"stopped: {self.engine.error!r}")
        if self.inflight >= self.config.max_pending_requests:
            raise RejectError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"worker {self.worker_id} has {self.inflight} requests in flight "
                              f"(max_pending_requests={self.config.max_pending_requests})")
        self.inflight += 1
        try:
            yield
        finally:
            self.inflight -= 1

    def _engine_died(self, exc: BaseException) -> None:
        self.engine_failure = exc
        logger.critical("worker %s: the engine died (%r); leaving the registry, failing its "
                        "requests (they move to other workers) and exiting", self.worker_id,
                        exc)
        if self.on_fatal is not None:
            self.on_fatal()

    # --- engine thread hook: KV-cache events for the prefix index -------------------------
    def _on_step(self, engine: LLMEngine) -> None:
        events = engine.take_kv_events()
        if events and (self._presence is not None or self.on_lease_ended is not None):
            self.engine.loop.call_soon_threadsafe(self._add_kv_events, events)

    def _add_kv_events(self, events: list) -> None:
        """On the loop. Both roles: a decode worker's blocks hold the replies it streamed,
        which a chat's next turn starts with (router/local_prefill.py)."""
        if self.on_lease_ended is not None:
            for ev in events:
                if isinstance(ev, LeaseEnded):
                    self.on_lease_ended(ev.request_id)
        if self._presence is not None:
            self._presence.add_events(events)

    def record_transfer(self, event) -> None:
        """A transfer-ledger event (router/ledger.py) for Redis, in order with the KV events;
        on the event loop. Nothing without a registry."""
        if self._presence is not None:
            self._presence.add_events([event])

    async def reset_prefix_cache(self) -> common_pb2.WorkerPrefixCacheReset:
        """The ResetPrefixCache RPC of either role: forgets this worker's prefix cache, refused
        while any block is held. Off the event loop: it waits for a running step to end. The
        removals reach Redis's index as every KV event does, from the engine thread after its
        next step (an idle engine steps every 0.2 s), so they never overtake the stores before
        them."""
        done = await asyncio.to_thread(self.llm.reset_prefix_cache)
        logger.info("worker %s: prefix cache %s (%d blocks forgotten, %d in use)",
                    self.worker_id, "reset" if done.reset else "not reset",
                    done.num_blocks_evicted, done.num_blocks_in_use)
        await self.engine.fresh_stats()  # the next heartbeat's info shows it
        return common_pb2.WorkerPrefixCacheReset(
            worker_id=self.worker_id, role=self.config.role, reset=done.reset,
            num_blocks_evicted=done.num_blocks_evicted,
            num_blocks_in_use=done.num_blocks_in_use)

    # --- info -----------------------------------------------------------------------------
    def worker_info(self) -> common_pb2.WorkerInfo:
        s = self.engine.stats
        cfg = self.config.engine
        return common_pb2.WorkerInfo(
            worker_id=self.worker_id, role=self.config.role, address=self.address,
            model=self.config.served_model_name or cfg.model,
            model_fingerprint=self.model_fingerprint, block_size=cfg.block_size,
            tensor_parallel_size=cfg.tensor_parallel_size,
            kv_transfer_backend=cfg.kv_transfer_backend or "",
            max_model_len=self.llm.max_model_len,
            kv_cache_layouts=self._layouts,
            num_free_blocks=s.num_free_blocks, num_total_blocks=s.num_total_blocks,
            num_waiting=s.num_waiting, num_running=s.num_running, num_leased=s.num_leased,
            prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
            prefix_cache_partial_hits=s.prefix_cache_partial_hits,
            prefix_cache_evictions=s.prefix_cache_evictions,
            num_expired_leases=s.num_expired_leases, num_preemptions=s.num_preemptions,
            num_quarantined=s.num_quarantined,
            num_inflight=self.inflight, draining=self.draining,
            kv_bytes_transferred=self.kv_bytes, kv_transfer_failures=self.kv_failures,
            leases_forgotten=self.leases_forgotten,
            leases_forget_reading=self.leases_forget_reading,
            leases_forget_no_room=self.leases_forget_no_room,
            kv_peers_connected=self._peers.num_connected if self._peers is not None else 0)

    # --- lifecycle ------------------------------------------------------------------------
    @property
    def registry(self):
        """The worker's registry (router.registry.Registry) once registered with Redis."""
        return self._presence.registry if self._presence is not None else None

    async def start_presence(self) -> None:
        if self.config.redis_url is None:
            logger.warning("worker %s: no --redis-url, so it registers nowhere: no router will "
                           "send it requests (only direct callers of its API)", self.worker_id)
            return
        from router.presence import WorkerPresence

        self._presence = WorkerPresence(
            self.config.redis_url, self.config.namespace, self.config.heartbeat_interval_s,
            self.worker_info, self._republish, self.database_refusal)
        registry = self._presence.registry

        async def prepare(registry) -> None:  # before the first heartbeat makes it routable
            await registry.set_kv_handles(self.worker_id, self.kv_handle_bytes, self.kv_mac_key)

        await self._presence.start(prepare if self.config.role == "prefill" else None)
        if self.config.role == "decode":
            self._peers = KVPeerConnector(registry, self.llm, self.config.heartbeat_interval_s,
                                          self.on_kv_source)
            self._peers.start()

    async def _republish(self, registry) -> None:
        """After a Redis outage, a purge or lost KV events: a prefill worker's KV handles, and
        either role's whole prefix cache in place of whatever the index kept of it (events
        were lost; Redis may be new). The presence publishes no KV event while this runs
        (router/presence.py): one landing between the snapshot and its write would be undone
        by it; those that come meanwhile are published after, on top of the snapshot."""
        if self.config.role == "prefill":
            await registry.set_kv_handles(self.worker_id, self.kv_handle_bytes, self.kv_mac_key)
        hashes = await asyncio.to_thread(self.llm.cached_block_hashes)
        await registry.set_worker_blocks(self.worker_id, hashes)
        if self.held_transfers is not None:
            # The ledger too: Redis lost the entries of leases still held (a restart, a purge)
            # or kept ones whose close was lost. Taken on the loop, as the leases' opens and
            # closes are queued: one queued since comes after this, on top of it.
            await registry.ledger.replace_worker(self.worker_id, self.held_transfers())

    async def stop_presence(self) -> None:
        """Leave routing first, so the router stops sending work while we drain. The ledger
        entries of the leases the drain waits for stay, their closes published as they come,
        until ``finish_presence``."""
        self.draining = True
        for callback in self.on_drain:
            callback()
        if self._peers is not None:
            await self._peers.stop()
        if self._presence is not None:
            await self._presence.leave()

    async def finish_presence(self) -> None:
        """After the drain: nothing more goes to Redis, and the ledger entries of the leases
        still held go (they end with the process)."""
        if self._presence is not None:
            await self._presence.stop()
            self._presence = None

    def shutdown(self) -> None:
        self.engine.shutdown()


def now() -> float:
    return time.monotonic()
