"""The router's view of the workers: live ones from the registry, a channel per worker (reused
across requests), and requests in flight per worker. Which worker takes a prompt is the
routing policy's (router/routing_policy.py); failed workers are marked down by
router/worker_failures.py.

Redis is the registry and the prefix index, not a dependency of the request path: while it
fails or hangs, requests route on the last view of the workers, by load alone (no prefix
hits), waiting on it at most briefly (router/redis_health.py). The periodic refresh keeps
trying and takes the view up again when Redis answers; any error from the registry (a corrupt
entry too) is taken as Redis failing, at start as well: the router starts on an empty view and
fills it when Redis answers. Stale workers' entries are purged beside the refresh, not in it:
a dead worker's big prefix cache takes seconds to drop, Redis answering all along, and neither
the view nor the requests' Redis calls wait for that (nor take it for a hung Redis). A new,
empty Redis (a restart) is not every worker gone: a worker last listed before it started keeps
its place until it registers again or a heartbeat TTL passes.

Workers serving another model (two clusters sharing a Redis namespace, a model replaced in
place) are left out of the view, each logged once (router/model_match.py); so are workers of
another block size, whose blocks the router's hashes do not name.

A dropped worker's channel stays open while any request uses it (``in_use``), and closes a
while after the last one ends; ``stop`` closes every channel the view opened.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import redis.exceptions

from client.tasks import stop_task
from protos import common_pb2, worker_pb2_grpc
from protos.limits import message_size_options
from router.liveness import LivenessConfig, check_loop
from router.model_match import model_mismatch
from router.redis_bound import REDIS_TIMEOUT_S
from router.redis_health import RedisHealth
from router.registry import Registry
from router.router_peers import RouterPlace
from router.routing_policy import LOAD_COST_TOKENS, NoWorkerError, RoutingPolicy
from router.worker_failures import WorkerFailures
from router.worker_handle import WorkerHandle, prefilling

# Re-exported: the router's modules and tests import them from here.
__all__ = ["LOAD_COST_TOKENS", "NoWorkerError", "WorkerDirectory", "WorkerHandle", "prefilling"]

logger = logging.getLogger(__name__)

RETIRE_AFTER_S = 30.0


@dataclass
class WorkerDirectory(RoutingPolicy, WorkerFailures):
    registry: Registry
    block_size: int
    refresh_interval_s: float = 0.5
    # Options of the channel to each worker (client/keepalive.py's pings among them).
    channel_options: list = field(default_factory=message_size_options)
    liveness: LivenessConfig = field(default_factory=LivenessConfig)
    # The router's model, its name (--served-model-name or --model) and its folder's
    # fingerprint: workers serving another are left out (router/model_match.py). "" checks none.
    model: str = ""
    model_fingerprint: str = ""
    # Equally good workers go by this router's place among the routers sharing the namespace
    # (router/router_peers.py; None while unknown), else by an order drawn from ``tie_seed``
    # (the router's id): routers sharing the workers, each knowing only its own requests in
    # flight, then spread over them instead of all taking the same one
    # (router/routing_policy.py). Neither: the smaller id first.
    tie_seed: str = ""
    router_place: Callable[[], RouterPlace | None] | None = None
    workers: dict[str, WorkerHandle] = field(default_factory=dict)
    _task: asyncio.Task | None = None
    # Requests refresh on a miss beside the periodic loop; one refresh applies at a time.
    _refresh_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # The refresh that requests missing a worker now wait for, until it starts (shared_refresh).
    _next_refresh: asyncio.Future | None = None
    # worker id -> (address, monotonic time until which it gets no requests): failed probes.
    _down: dict[str, tuple[str, float]] = field(default_factory=dict)
    # One probe per worker (id, address) at a time: the requests a crash failed together share
    # it.
    _probes: dict[tuple[str, str], asyncio.Future] = field(default_factory=dict)
    # Whether the request path waits on Redis now.
    _health: RedisHealth = field(default_factory=RedisHealth)
    # (worker id, model) of the workers logged as serving another model: logged once each.
    _foreign: set[tuple[str, str]] = field(default_factory=set)
    # Role -> workers the last registry read listed serving another model (for the error a
    # request gets when no worker of the router's model is left).
    foreign_now: dict[str, int] = field(default_factory=dict)
    # Workers kept through a Redis restart at the last refresh, to log each change once.
    _kept: frozenset[str] = frozenset()
    # Workers with calls in flight (a worker the registry dropped may still have some).
    _busy: set[WorkerHandle] = field(default_factory=set)
    _liveness_task: asyncio.Task | None = None
    _purge_task: asyncio.Task | None = None
    # Workers found hung by the liveness checks, counted since start.
    worker_hangs: int = 0
    _closing: set[asyncio.Task] = field(default_factory=set)
    # Every handle whose channel is open, in the view or not (a dropped one in use), and the
    # timers of the dropped ones that close later (_retire): stop closes them all.
    _open: set[WorkerHandle] = field(default_factory=set)
    _retiring: dict[WorkerHandle, asyncio.TimerHandle] = field(default_factory=dict)
    # Workers of another block size, each logged once (candidates).
    _other_block_size: set[tuple[str, int]] = field(default_factory=set)
    _stopping: bool = False

    async def start(self) -> None:
        # A registry that fails now (unreachable, or a corrupt entry it cannot read) fails
        # like one that fails later: the router starts and the refresh loop keeps trying.
        await self._health.run("the registry read at start", self.refresh)
        self._task = asyncio.create_task(self._refresh_loop())
        if self.liveness.enabled:
            self._liveness_task = asyncio.create_task(
                check_loop(self.liveness.interval_s, self.liveness.misses,
                           lambda: list(self._busy), self._hung))
            self._liveness_task.add_done_callback(_log_liveness_end)

    async def stop(self) -> None:
        # Checked each round, so the loop stops even if a cancel is swallowed (client/tasks.py).
        self._stopping = True
        try:
            for task in (self._task, self._liveness_task):
                await stop_task(task)
            # Read after the loop stopped: a round whose cancel was swallowed may have started
            # a purge since.
            await stop_task(self._purge_task)
            for timer in self._retiring.values():
                timer.cancel()
            handles = list(self._open)
            self.workers.clear()
            self._retiring.clear()
            self._open.clear()
            for w in handles:
                await w.close()
            if self._closing:
                await asyncio.gather(*self._closing, return_exceptions=True)
        finally:
            await self.registry.r.aclose()

    async def _refresh_loop(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.refresh_interval_s)
            await self._health.run("the periodic registry refresh", self.refresh)
            if not self._stopping and (self._purge_task is None or self._purge_task.done()):
                self._purge_task = asyncio.create_task(self._purge_stale())

    async def _purge_stale(self) -> None:
        # Not tracked by the Redis health: a long purge is Redis answering step after step.
        # A Redis that fails or hangs fails the refresh too, which tells the request path.
        try:
            await self.registry.purge_stale()
        except Exception as e:  # noqa: BLE001 - retried after the next refresh
            logger.debug("purging stale workers failed: %r", e)

    @property
    def registry_ok(self) -> bool:
        """False while the request path leaves a failing or hanging Redis alone."""
        return self._health.ok

    async def refresh_if_reachable(self) -> bool:
        """A refresh for the request path: False (the last view stands) when Redis fails or
        hangs."""
        async def refreshed() -> bool:
            await self.shared_refresh()
            return True

        return await self._health.ask("a registry refresh", refreshed, False)

    async def refresh(self) -> None:
        async with self._refresh_lock:
            await self._refresh()

    async def shared_refresh(self) -> None:
        """A refresh that starts after this call, shared by every caller until it starts: a
        burst of requests that miss a worker (every request, in a cluster without prefill
        workers) reads the registry once or twice, not once each in a queue that outlasts
        the Redis time limit and has a healthy Redis taken for a failing one."""
        if self._next_refresh is None:
            self._next_refresh = asyncio.ensure_future(self._run_next_refresh())
            # Retrieved, so that a refresh whose waiters all gave up is not logged as lost.
            self._next_refresh.add_done_callback(
                lambda f: f.cancelled() or f.exception())
        await asyncio.shield(self._next_refresh)

    async def _run_next_refresh(self) -> None:
        async with self._refresh_lock:
            self._next_refresh = None  # callers from now on may have missed this read
            await self._refresh()

    async def _refresh(self) -> None:
        listed = await self.registry.live_workers(purge=False)  # purged apart: _purge_stale
        now = time.monotonic()
        live = {i.worker_id: i for i in self._same_model(listed)}
        missing = [w for w in self.workers if w not in live]
        kept = await self._not_registered_since_restart(missing)
        self._log_kept(kept)
        for wid in [w for w in missing if w not in kept]:
            gone = self.workers.pop(wid)
            # Requests in flight keep their own reference; closed once they are done.
            if gone.users == 0:
                self._retire(gone)
        # A mark outlives its worker only while the view holds it: ids of workers gone for
        # good (a pid in each default id) would pile up.
        for wid in [w for w in self._down if w not in self.workers]:
            del self._down[wid]
        self._other_block_size = {k for k in self._other_block_size if k[0] in self.workers}
        for wid, info in live.items():
            handle = self.workers.get(wid)
            if handle is not None and handle.info.address == info.address:
                handle.info, handle.listed_at = info, now
                continue
            if handle is not None and handle.users == 0:
                # Registered anew at another address (a restart): the old channel goes too.
                # One with calls on it is retired when they end (in_use).
                self._retire(handle)
            channel = grpc.aio.insecure_channel(info.address, options=self.channel_options)
            self.workers[wid] = WorkerHandle(info, channel,
                                             worker_pb2_grpc.PrefillWorkerStub(channel),
                                             worker_pb2_grpc.DecodeWorkerStub(channel),
                                             liveness=self.liveness, listed_at=now)
            self._open.add(self.workers[wid])

    def model_mismatch(self, info: common_pb2.WorkerInfo) -> str:
        """Why ``info``'s worker serves another model than the router's ("" if it does not)."""
        return model_mismatch(self.model, self.model_fingerprint, info)

    def _same_model(self, listed: list[common_pb2.WorkerInfo]) -> list[common_pb2.WorkerInfo]:
        """The workers serving the router's model; each other one logged once."""
        self._foreign &= {(i.worker_id, i.model) for i in listed}  # forget the ones gone
        kept = []
        self.foreign_now = {}
        for info in listed:
            why = self.model_mismatch(info)
            if not why:
                kept.append(info)
                continue
            self.foreign_now[info.role] = self.foreign_now.get(info.role, 0) + 1
            if (info.worker_id, info.model) not in self._foreign:
                self._foreign.add((info.worker_id, info.model))
                logger.warning("worker %s (%s) serves model %r, not this router's %r: %s; it "
                               "gets no requests (do two clusters share a Redis namespace? was "
                               "the model replaced under a running cluster?)",
                               info.worker_id, info.address, info.model, self.model, why)
        return kept

    async def _not_registered_since_restart(self, missing: list[str]) -> frozenset[str]:
        """Of the workers missing from the registry, those last listed by an earlier Redis
        that a new one (empty: no persistence) replaced less than a heartbeat TTL ago: they
        may not have beaten since, rather than have left. Each live worker beats within the
        TTL, so after it their absence is leaving. A worker that was listed by this Redis and
        is missing from it left (deregistered, or went stale): dropped at once, as before."""
        if not missing:
            return frozenset()
        uptime = await self._redis_uptime_s()
        if uptime >= self.registry.ttl_s:
            return frozenset()
        # Redis counts uptime between two whole-second clock readings: ``now - uptime`` may be
        # up to a second before its start or after it. Taking the later bound keeps every
        # worker listed before the restart, and lets go at once of one still listed 2 s on.
        started_by = time.monotonic() - uptime + 1.0
        return frozenset(w for w in missing if self.workers[w].listed_at < started_by)

    async def _redis_uptime_s(self) -> float:
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                info = await self.registry.r.info("server")
        except redis.exceptions.ResponseError:  # INFO refused: absence is all there is to go by
            return float("inf")
        return float(info.get("uptime_in_seconds", "inf"))

    def _log_kept(self, kept: frozenset[str]) -> None:
        if kept and kept != self._kept:
            logger.warning("Redis restarted less than %g s ago: worker(s) %s, not in it (yet), "
                           "keep receiving requests until they register again or that long "
                           "passes", self.registry.ttl_s, ", ".join(sorted(kept)))
        self._kept = kept

    def prefill_stub(self, worker_id: str):
        """The prefill worker's stub if the directory knows it, else None."""
        w = self.workers.get(worker_id)
        return w.prefill_stub if w is not None and w.info.role == "prefill" else None

    def candidates(self, role: str) -> list[WorkerHandle]:
        return [w for w in self.workers.values()
                if w.info.role == role and not w.info.draining
                and self._same_block_size(w) and not self.is_down(w)]

    def _same_block_size(self, w: WorkerHandle) -> bool:
        """Whether the router's block hashes name ``w``'s blocks; each other one logged once
        (else a cluster whose router and workers disagree refuses every request unexplained)."""
        if w.info.block_size == self.block_size:
            return True
        key = (w.worker_id, w.info.block_size)
        if key not in self._other_block_size:
            self._other_block_size.add(key)
            logger.warning("worker %s (%s) has --block-size %d, not this router's %d: it gets "
                           "no requests", w.worker_id, w.info.address, w.info.block_size,
                           self.block_size)
        return False

    def max_model_len(self) -> int:
        """The longest sequence every routable worker takes (every known one while none is
        routable); 0 while none is known. A draining or down worker, or one of another block
        size, takes no request: its shorter limit must not refuse prompts the others take."""
        routable = self.candidates("prefill") + self.candidates("decode")
        workers = routable or list(self.workers.values())
        return min((w.info.max_model_len for w in workers if w.info.max_model_len), default=0)

    def check_prompt_fits(self, num_tokens: int, requested_len: int = 0) -> None:
        """Refuses a prompt of ``num_tokens`` with no room for an output token, and a request
        whose prompt plus the max_tokens its client set (``requested_len``; 0 when unset)
        exceeds max_model_len, as vLLM's server and OpenAI's API do: a client that asked for
        that much output would otherwise get less with finish reason "length". A default
        max_tokens (the model's or the router's) is capped instead."""
        limit = self.max_model_len()
        if limit and num_tokens + 1 > limit:
            raise ValueError(f"prompt has {num_tokens} tokens; max_model_len is {limit} "
                             "(room for at least one output token is needed)")
        if limit and requested_len > limit:
            raise ValueError(f"the prompt plus max_tokens is {requested_len} tokens; "
                             f"max_model_len is {limit}: lower max_tokens or shorten the prompt")

    @contextlib.contextmanager
    def inflight(self, worker: WorkerHandle):
        worker.inflight += 1
        worker.routed += 1
        try:
            with self.watched(worker):
                yield
        finally:
            worker.inflight -= 1

    def hold_inflight(self, worker: WorkerHandle) -> Callable[[], None]:
        """Counts a request in flight on ``worker`` from now, as ``inflight`` does, until the
        returned release is called; calls after the first do nothing. For a pick whose call
        starts after an await (router/worker_handle.py's CountedStream says why)."""
        held = self.inflight(worker)
        held.__enter__()
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                held.__exit__(None, None, None)

        return release

    @contextlib.contextmanager
    def watched(self, worker: WorkerHandle):
        """Health-checks ``worker`` while the block runs (router/liveness.py): it has calls in
        flight, or a decode worker is pulling a request's KV from it."""
        if worker.watchers == 0:
            # Checked only while busy: misses left from its last busy spell are not "in a row"
            # with this one's. WatchedCalls.add resets them only when no call is registered,
            # and a decode worker's DecodeMany stream stays registered while idle.
            worker.calls.misses = 0
        worker.watchers += 1
        self._busy.add(worker)
        try:
            with self.in_use(worker):
                yield
        finally:
            worker.watchers -= 1
            if worker.watchers == 0:
                self._busy.discard(worker)

    @contextlib.contextmanager
    def in_use(self, worker: WorkerHandle):
        """Keeps ``worker``'s channel open while the block runs, should the registry drop the
        worker meanwhile. A request holds its workers for a whole attempt: between its calls
        (the prefill answered, the decode leg waits for room) nothing else does."""
        worker.users += 1
        try:
            yield
        finally:
            worker.users -= 1
            if worker.users == 0 and self.workers.get(worker.worker_id) is not worker:
                self._retire(worker)  # dropped from the registry while it was used

    def _retire(self, w: WorkerHandle) -> None:
        """Closes the channel of a worker the registry dropped, once nothing uses it. Not at
        once: a failed request's probe and a lease release may still be on their way."""
        def close() -> None:
            self._retiring.pop(w, None)
            if w.users == 0 and self.workers.get(w.worker_id) is not w:
                self._open.discard(w)
                task = asyncio.get_running_loop().create_task(w.close())
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)

        if w in self._retiring or self._stopping:
            return
        self._retiring[w] = asyncio.get_running_loop().call_later(RETIRE_AFTER_S, close)


def _log_liveness_end(task: asyncio.Task) -> None:
    """The health checks end only with the router: any other end leaves hung workers uncut."""
    if not task.cancelled() and task.exception() is not None:
        logger.error("the worker health checks stopped: %r", task.exception())
