"""The engine behind an asyncio service: it steps in its own thread, never on the event loop.

Requests are submitted from the loop; outputs come back through one asyncio queue per request.
Everything that may block on the engine's step lock (decode-role allocation, commit, stats)
runs in a pool thread (stats in one of their own), so a long forward never stalls a stream or
a health check.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import faulthandler
import functools
import logging
import threading
import time
from collections.abc import Awaitable, Callable

import torch

from engine.core_share import CoreShare
# EngineDeadError: re-exported (callers catch it from here).
from engine.engine_front import (FRESH_STATS_WAIT_S, SHUTDOWN_TIMEOUT_S,  # noqa: F401
                                 EngineDeadError, EngineFront, EngineStepTimeout)
from engine.guide_threads import on_guide_thread
from engine.llm_engine import LLMEngine
from engine.outputs import EngineStats, KVAllocation, RequestOutput
from engine.sampling_params import SamplingParams
from engine.thread_names import named_thread

logger = logging.getLogger(__name__)

# An idle engine still wakes this often: leases expire and releases apply only in a step.
_IDLE_TICK_S = 0.2
# Shutdown lets a step in flight end this long; then the engine stops under it: its TP workers
# are told to quit and killed if they do not (engine.tp_executor: 5 s, then 2 s for the
# kill), which also fails a collective stuck on one of them, and the thread gets this long to
# unwind. A worker that is stopped or wedged never holds shutdown longer than that.
_STEP_GRACE_S = 3.0
_THREAD_EXIT_S = 2.0
# shutdown() takes at worst SHUTDOWN_TIMEOUT_S (engine.engine_front): the sum above.


class AsyncEngine(EngineFront):
    def __init__(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop | None = None,
                 on_step: Callable[[LLMEngine], None] | None = None,
                 core_share: CoreShare | None = None,
                 on_dead: Callable[[BaseException], None] | None = None,
                 step_timeout_s: float | None = None) -> None:
        super().__init__(loop or asyncio.get_running_loop(), on_dead)
        self.engine = engine
        # Called in the engine thread after every step (e.g. to publish KV-cache events), and
        # within each step before its forward (``_scheduled``).
        self.on_step = on_step
        engine.on_scheduled = self._scheduled
        # Sizes each step's CPU threads from what co-located workers use (engine/core_share.py),
        # and between decoder layers gives back borrowed cores another worker now needs.
        self.core_share = core_share
        if core_share is not None:
            for layer in engine.decoder_layers():
                layer.register_forward_pre_hook(self._give_back_cores)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.stats: EngineStats = engine.get_stats()
        # fresh_stats's takes wait for a running step in a thread of their own, one at a
        # time: GetWorkerInfo callers during a long (or wedged) step would otherwise each hold
        # a thread of the default pool, which the KV pulls, allocations and commits need.
        self._stats_thread = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="pdserve-stats")
        # A step that runs longer than this kills the engine (None: steps may run forever).
        self.step_timeout_s = step_timeout_s
        self._step_started: float | None = None  # monotonic start of the running step
        # ... and of the running idle health check: a TP engine's waits on its ranks (idle
        # pings, up to --tp-idle-ping-timeout-s), and a request that came meanwhile with it.
        self._check_started: float | None = None
        self._thread = named_thread(self._run, "pdserve-engine")
        self._thread.start()
        if step_timeout_s:
            self.loop.call_soon_threadsafe(self._watch_steps)

    # --- engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set() and self.error is None:
                busy = self.engine.has_unfinished_requests()
                if not busy:
                    # Lent only once no request came within the share's delay (its team
                    # spinning meanwhile is what the delay waits out: engine/core_share.py).
                    if self.core_share is not None and not self._lend_waits_out_work():
                        self._go_idle(self.core_share)
                    self._wake.wait(_IDLE_TICK_S)
                    self._wake.clear()
                    # An idle step runs no model: a dead TP rank shows only here.
                    self._check_started = time.monotonic()
                    self.engine.check_health()
                    self._check_started = None
                if self.core_share is not None and self.engine.has_unfinished_requests():
                    self._size_step(self.core_share)
                self._step_started = time.monotonic()
                outputs = self.engine.step()
                self._step_started = None
                self.stats = self.engine.get_stats()
                self._after_step(outputs)
        except BaseException as e:  # a failed step must reach every waiting stream
            if self.core_share is not None:  # a dead engine computes nothing: lend the cores
                self.core_share.idle()
            if self._stop.is_set():  # shutdown stopped the engine under its step: expected
                logger.warning("the engine's last step failed during shutdown: %s", e)
            else:
                logger.exception("engine thread died")
            self.error = e
            self._died(e)

    def _lend_waits_out_work(self) -> bool:
        """Waits out the core share's lend delay; whether work came meanwhile."""
        delay = self.core_share.config.lend_delay_s
        return bool(delay) and self._wake.wait(delay)

    def _after_step(self, outputs: list[RequestOutput]) -> None:
        """In the engine thread, after each step: its hook, then its outputs to the loop."""
        if self.on_step is not None:
            self.on_step(self.engine)
        if outputs:
            self.loop.call_soon_threadsafe(self._deliver, outputs)

    def _scheduled(self, engine: LLMEngine) -> None:
        """In the engine thread, within a step whose schedule is made, before its forward:
        the hook again, so the KV events of the schedule (the blocks it evicted above all)
        reach the prefix index while the forward runs rather than after it."""
        if self.on_step is not None:
            self.on_step(engine)

    def _died(self, e: BaseException) -> None:
        """In the engine thread, once a step failed: every stream and ``on_dead`` learn it."""
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._fail_all)
            if self.on_dead is not None and not self._stop.is_set():
                self.loop.call_soon_threadsafe(self.on_dead, e)

    # --- step watchdog (on the loop) ---------------------------------------------------------
    def _watch_steps(self) -> None:
        if self.error is not None or self._stop.is_set() or not self._thread.is_alive():
            return
        # The check too: a rank stopped while idle held it for the ping timeout, unwatched,
        # so a ping timeout above the step timeout kept a request waiting past the latter.
        for started, what in ((self._step_started, "an engine step"),
                              (self._check_started, "an idle health check of the engine")):
            if started is not None and time.monotonic() - started > self.step_timeout_s:
                self._wedged(what, time.monotonic() - started)
                return
        self.loop.call_later(min(1.0, self.step_timeout_s / 4), self._watch_steps)

    def _wedged(self, what: str, running_s: float) -> None:
        """A step that never ends (a hung GPU kernel or collective) would keep the worker up,
        answering health checks, with every request on it stuck: it dies instead, so its
        requests move on and its supervisor restarts it."""
        e = EngineStepTimeout(f"{what} has run {running_s:.0f} s, past the step timeout of "
                              f"{self.step_timeout_s:g} s: the engine is wedged")
        logger.error("%s; the engine thread's stack follows", e)
        faulthandler.dump_traceback(all_threads=True)
        self.error = e
        self._fail_all()
        if self.on_dead is not None:
            self.on_dead(e)

    def _give_back_cores(self, module, args) -> None:
        threads = self.core_share.recheck()
        if threads is not None:
            torch.set_num_threads(threads)

    @staticmethod
    def _go_idle(share: CoreShare) -> None:
        """Lends the cores, and drops to this worker's own share: a request that arrives
        after the check that sizes a step runs in it unsized, and must not run on the cores
        the last step borrowed while its slot says idle and a peer takes them too."""
        share.idle()
        if torch.get_num_threads() != share.config.base_threads:
            torch.set_num_threads(share.config.base_threads)

    @staticmethod
    def _size_step(share: CoreShare) -> None:
        threads = share.threads_for_step()
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)

    # --- loop side ------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def num_leased(self) -> int:
        # Read live: a dead engine's leases still end (ReleaseKV, the decode workers'
        # releases, expiry) and its KV can still be read, but no step refreshes its stats.
        if not self.alive:
            # Nor expires its leases: one nobody releases (its router died) held the drain
            # for its whole timeout.
            self.engine.reclaim_expired_leases()
        return self.engine.num_leases

    async def _add_request(self, request_id: str, prompt_token_ids: list[int],
                           params: SamplingParams, resume_token_ids: list[int],
                           stream_interval: int) -> None:
        add = functools.partial(self.engine.add_request, request_id, prompt_token_ids, params,
                                resume_token_ids, stream_interval)
        if params is not None and not self.engine.guides.ready(params):
            # Its guide is compiled, and the vocabulary's trie built at the engine's first
            # one (up to the compile's budget, a second for a large vocabulary), first: on the
            # guide threads (engine/guide_threads.py), off the loop and the default executor.
            try:
                await on_guide_thread(self.engine.guides.warm, params)
            except Exception:  # noqa: BLE001 - the add raises it again
                pass
        add()
        self._wake.set()

    def _add_prefilled(self, request_id: str, prompt_token_ids: list[int], first_token_id: int,
                       params: SamplingParams, resume_token_ids: list[int],
                       stream_interval: int) -> Awaitable[KVAllocation]:
        # Off the loop: it waits for the running step.
        return asyncio.to_thread(self.engine.add_prefilled_request, request_id,
                                 prompt_token_ids, first_token_id, params, resume_token_ids,
                                 stream_interval)

    async def _commit(self, request_id: str) -> None:
        await asyncio.to_thread(self.engine.commit_prefilled, request_id)
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """Frees the request's blocks (at once when idle, else at the next step)."""
        self.engine.abort(request_id)
        self._wake.set()

    def release_kv(self, request_id: str) -> None:
        self.engine.release_kv(request_id)
        self._wake.set()

    async def fresh_stats(self, wait_s: float = FRESH_STATS_WAIT_S) -> EngineStats:
        """Stats taken now, off the loop; when a running step holds the engine longer than
        ``wait_s``, the last step's. A caller asking whether this worker still serves (the
        router's probe, with a 1 s timeout) must not wait out a long prefill step."""
        def take() -> EngineStats:
            self.stats = self.engine.get_stats()
            return self.stats

        try:
            fresh = self.loop.run_in_executor(self._stats_thread, take)
        except RuntimeError:  # shut down: no take will run any more
            return self.stats
        done, _ = await asyncio.wait({fresh}, timeout=wait_s)
        # A take the shutdown cancelled, queued behind a step, answers with the last stats.
        return fresh.result() if done and not fresh.cancelled() else self.stats

    def shutdown(self) -> None:
        """Stops the engine thread and the engine, within ``SHUTDOWN_TIMEOUT_S``."""
        self._stop.set()
        self._wake.set()
        self._stats_thread.shutdown(wait=False, cancel_futures=True)
        self._thread.join(timeout=_STEP_GRACE_S)
        if self._thread.is_alive():
            logger.warning("a step is still running after %.0f s; stopping the engine under it",
                           _STEP_GRACE_S)
        self.engine.shutdown()
        self._thread.join(timeout=_THREAD_EXIT_S)
        if self.core_share is not None and not self._thread.is_alive():
            self.core_share.close()
        if self._thread.is_alive():  # a daemon thread: the process can still exit
            logger.error("the engine thread did not end; leaving it behind")
        # Streams still open get no more outputs: they fail, as a dead engine's do. Posted:
        # shutdown may run off the loop (an engine process stops its engine in a thread).
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._fail_all)
