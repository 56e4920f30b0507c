"""The worker's side of ``--engine-process``: the engine steps in a process of its own.

``EngineProcess`` is what ``AsyncEngine`` is to a service (engine/engine_front.py): requests
in, one stream of outputs per request, the same aborts and the same death. Behind it is the
process of engine/engine_proc.py. Its pipe is read on the event loop: one message per engine
step carries every output of the step, so the loop wakes once a step, as with the thread.
``RemoteLLM`` answers what the worker otherwise asks its ``LLMEngine`` directly (KV pulls,
prefix-cache reset, the KV layout and handles), from the threads it asks from.

When the process dies (a crash, an OOM kill), every stream and every call waiting on it fails
with ``EngineDeadError`` and ``on_dead`` runs, as when an engine thread's step fails: the
worker leaves the registry and exits for its supervisor to restart it. With a step timeout, so
does a process that sends nothing, not even its ticks, for longer than that and a grace (it is
stopped, or a C call holds its GIL, so its own step watchdog cannot run either): it is killed.

The loop never waits on the pipe: what it sends is queued to a thread (``QueuedSender``), since
a process that stopped reading would block it in ``sendall``, and every service with it.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from engine.engine_front import (FRESH_STATS_WAIT_S, SHUTDOWN_TIMEOUT_S, EngineDeadError,
                                 EngineFront, EngineStepTimeout)
from engine.engine_pipe import (BadFrame, EngineProcInfo, EngineProcSpec, FrameReader,
                                FrameWriter, OutputDecoder, PipeClosed, QueuedSender)
from engine.outputs import EngineStats, KVAllocation
from engine.process_exit import popen_tied
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# The folder holding the engine package: the child imports it as this process did.
_ROOT = str(Path(__file__).resolve().parent.parent)
# A process silent this long past the step timeout is wedged: its own watchdog reports a step
# that ran past the timeout within about a second, and it ticks every engine_pipe.TICK_S.
_SILENCE_GRACE_S = 5.0
# How often the loop looks at how long the process has been silent.
_WATCH_EVERY_S = 1.0


class EngineProcess(EngineFront):
    """Build with ``await EngineProcess.start(spec)``."""

    def __init__(self, proc: subprocess.Popen, reader: FrameReader, writer: FrameWriter,
                 info: EngineProcInfo, loop: asyncio.AbstractEventLoop,
                 on_dead: Callable[[BaseException], None] | None = None,
                 silence_limit_s: float | None = None) -> None:
        """``silence_limit_s``: the process is killed as wedged once it has sent nothing for
        this long (None: never)."""
        super().__init__(loop, on_dead)
        self.proc, self.info = proc, info
        self.stats: EngineStats = info.stats
        # Called on the loop with each step's KV-cache events (the prefix index's feed).
        self.on_kv_events: Callable[[list], None] | None = None
        self.llm = RemoteLLM(self, info)
        self._reader, self._writer = reader, writer
        self._sender = QueuedSender(writer, "pdserve-engine-pipe")
        self._decoder = OutputDecoder()
        self._lock = threading.Lock()  # _calls and _closed: from the loop and from threads
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._ids = itertools.count()
        self._closed = False  # the pipe ended: nothing more comes or goes
        self._stopping = False
        self._fd = reader.sock.fileno()
        # Read whenever the loop likes: also from _watch_silence, not only when readable.
        reader.sock.setblocking(False)
        loop.add_reader(self._fd, self._on_readable)
        # What came with "ready" waits in the reader's buffer, where no readable event tells
        # of it (the process may have said ("dead", why) and ended).
        loop.call_soon(self._on_readable)
        self._silence_limit_s = silence_limit_s
        if silence_limit_s is not None:
            loop.call_later(_WATCH_EVERY_S, self._watch_silence)

    @classmethod
    async def start(cls, spec: EngineProcSpec,
                    on_dead: Callable[[BaseException], None] | None = None) -> EngineProcess:
        """Starts the process and waits until its engine is built (or raises why not)."""
        down_ours, down_theirs = socket.socketpair()
        up_ours, up_theirs = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
        fds = [down_theirs.fileno(), up_theirs.fileno()]
        proc = popen_tied([sys.executable, "-m", "engine.engine_proc", *map(str, fds),
                           str(os.getpid())], pass_fds=fds, env=env)
        down_theirs.close()
        up_theirs.close()
        reader, writer = FrameReader(up_ours), FrameWriter(down_ours)
        try:
            writer.send(spec)
            info = await asyncio.to_thread(_wait_ready, reader, proc)
        except BaseException:
            reader.close()
            writer.close()
            proc.kill()  # still building, or ended (it failed): either way, not needed now
            proc.wait()
            raise
        logger.info("the engine runs in process %d", info.pid)
        silence = spec.step_timeout_s + _SILENCE_GRACE_S if spec.step_timeout_s else None
        return cls(proc, reader, writer, info, asyncio.get_running_loop(), on_dead, silence)

    # --- the pipe ---------------------------------------------------------------------------
    def _on_readable(self) -> None:
        try:
            msgs = self._reader.read_ready()
        except BadFrame as e:  # what else it sends cannot be trusted: it is ended
            self._kill(EngineDeadError(f"the engine process (pid {self.proc.pid}) sent a "
                                       f"message that cannot be read: {e}"))
            return
        except PipeClosed:
            self._lost()
            return
        for msg in msgs:
            self._handle(msg)

    def _watch_silence(self) -> None:
        """On the loop, every _WATCH_EVERY_S while the engine serves."""
        if self._closed or self._stopping or self.error is not None:
            return
        # First what has come meanwhile: the loop itself may have been held up, not the process.
        self._on_readable()
        if self._closed or self.error is not None:
            return
        silent_s = time.monotonic() - self._reader.received_at
        if silent_s > self._silence_limit_s:
            self._kill(EngineStepTimeout(
                f"the engine process (pid {self.proc.pid}) has sent nothing for "
                f"{silent_s:.0f} s: wedged"))
            return
        self.loop.call_later(_WATCH_EVERY_S, self._watch_silence)

    def _kill(self, e: BaseException) -> None:
        """Ends a process that no longer serves: SIGKILLed, it dies with ``e`` at once (a
        process stuck in the kernel may take its time to close the pipe)."""
        logger.error("%s: killing it", e)
        self.proc.kill()
        self._lost(e)

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "step":
            _, outputs, stats, events = msg
            if stats is not None:
                self.stats = stats
            if events and self.on_kv_events is not None:
                self.on_kv_events(events)
            if outputs:
                self._deliver([self._decoder.decode(t) for t in outputs])
        elif kind == "reply":
            _, call_id, ok, value = msg
            with self._lock:
                fut = self._calls.pop(call_id, None)
            if fut is None or fut.done():  # a caller that left cancelled it
                return
            if ok:
                fut.set_result(value)
            else:
                fut.set_exception(value)
        elif kind == "dead":
            self._die(msg[1])
        # ("tick",): heard, which is all it says

    def _lost(self, cause: BaseException | None = None) -> None:
        """The pipe ended, or ``cause`` ended the process: every stream and call fails."""
        if self._closed:
            return
        self.loop.remove_reader(self._fd)
        if self._stopping:
            self._close_calls(self._dead())
            return
        if cause is None:
            try:  # the pipe ends as the process dies: its exit code follows at once
                code = self.proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                code = None
            cause = EngineDeadError(f"the engine process (pid {self.proc.pid}) ended"
                                    + (f" with exit code {code}" if code is not None else ""))
        self._close_calls(cause if isinstance(cause, EngineDeadError)
                          else EngineDeadError(f"the engine stopped: {cause!r}"))
        self._die(cause)

    def _close_calls(self, e: BaseException) -> None:
        """Nothing more comes or goes: every call still waiting fails with ``e``."""
        with self._lock:
            self._closed = True
            calls, self._calls = self._calls, {}
        for fut in calls.values():
            fut.set_exception(e)

    def _die(self, e: BaseException) -> None:
        self._decoder.forget_all()  # no output comes any more
        if self.error is not None:
            return
        logger.error("the engine died: %r", e)
        self.error = e
        self._fail_all()
        if self.on_dead is not None and not self._stopping:
            self.on_dead(e)

    def _send(self, msg: tuple) -> None:
        """Queues ``msg`` unless the pipe is gone (then the death is, or will be, reported)."""
        if not self._closed:
            self._sender.send(msg)

    def submit(self, method: str, *args) -> concurrent.futures.Future:
        """Calls ``method`` of the engine in its process; from any thread. Arguments that
        cannot be pickled raise here."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                fut.set_exception(self._dead())
                return fut
            call_id = next(self._ids)
            self._calls[call_id] = fut  # before it is sent: the reply may come at once
        try:
            self._sender.send(("call", call_id, method, args))
        except BaseException:
            with self._lock:
                self._calls.pop(call_id, None)
            raise
        # A pipe that ends meanwhile fails it (_close_calls).
        return fut

    def _call(self, method: str, *args) -> asyncio.Future:
        return asyncio.wrap_future(self.submit(method, *args), loop=self.loop)

    # --- EngineFront ------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self.error is None and not self._closed and not self._stopping

    @property
    def num_leased(self) -> int:
        # A dead engine process's leases went with it (no release reaches it, no reader gets
        # its KV): none to wait for. A live one's step messages carry the count.
        if self.error is not None or self._closed or self.stats is None:
            return 0
        return self.stats.num_leased

    async def _add_request(self, request_id: str, prompt_token_ids: list[int] | str,
                           params: SamplingParams, resume_token_ids: list[int],
                           stream_interval: int) -> None:
        # A text prompt crosses as it is: the engine tokenizes it, as in process.
        prompt = (prompt_token_ids if isinstance(prompt_token_ids, str)
                  else list(prompt_token_ids))
        added = self._call("add_request", request_id, prompt, params, list(resume_token_ids),
                           stream_interval)
        try:
            await asyncio.shield(added)
        except asyncio.CancelledError:
            # The caller left while the engine adds it, which the engine process does in pipe
            # order: an abort sent now follows the add and ends the request if it went in. Not
            # once the add's reply is here: a short request may have ended by then and a new
            # one taken its id, which that abort would end. The request's last output frees
            # the id; if the add failed there is none: its reply does.
            self.abort(request_id)
            added.add_done_callback(lambda f: self._release_if_failed(request_id, f))
            raise

    def _release_if_failed(self, request_id: str, added: asyncio.Future) -> None:
        if added.cancelled() or added.exception() is not None:
            self._held.discard(request_id)

    def _add_prefilled(self, request_id: str, prompt_token_ids: list[int], first_token_id: int,
                       params: SamplingParams, resume_token_ids: list[int],
                       stream_interval: int) -> Awaitable[KVAllocation]:
        return self._call("add_prefilled_request", request_id, list(prompt_token_ids),
                          first_token_id, params, list(resume_token_ids), stream_interval)

    def _commit(self, request_id: str) -> Awaitable[None]:
        return self._call("commit_prefilled", request_id)

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def release_kv(self, request_id: str) -> None:
        self._send(("release_kv", request_id))

    async def fresh_stats(self, wait_s: float = FRESH_STATS_WAIT_S) -> EngineStats:
        """As ``AsyncEngine.fresh_stats``: now, or the last step's after ``wait_s``."""
        fresh = self._call("get_stats")
        done, _ = await asyncio.wait({fresh}, timeout=wait_s)
        if not done:  # nobody awaits it now: a death that fails it is no error left unread
            fresh.add_done_callback(_retrieve)
        elif fresh.exception() is None:
            self.stats = fresh.result()
        return self.stats

    def shutdown(self) -> None:
        """Stops the engine and its process, within ``SHUTDOWN_TIMEOUT_S``."""
        self._stopping = True
        self._send(("shutdown",))  # after what is queued; a wedged process never reads it
        _stop_process(self.proc, SHUTDOWN_TIMEOUT_S)  # killed if it has not ended by then
        # The process is gone: a send still blocked on it fails now, and the thread ends.
        self._sender.close(timeout_s=1.0)
        if not self._closed:
            if not self.loop.is_closed():
                self.loop.remove_reader(self._fd)
            self._close_calls(self._dead())
        if not self.loop.is_closed():  # streams still open get nothing more
            self.loop.call_soon_threadsafe(self._fail_all)
        self._reader.close()
        self._writer.close()


class RemoteLLM:
    """The ``LLMEngine`` methods a worker calls itself (``WorkerRuntime.llm``), run in the
    engine process. Blocking, like the engine's own: callers run them in threads."""

    def __init__(self, proc: EngineProcess, info: EngineProcInfo) -> None:
        self._proc, self._info = proc, info
        self.max_model_len = info.max_model_len

    def kv_cache_layouts(self) -> list:
        return list(self._info.kv_cache_layouts)

    def kv_transfer_handles(self) -> list:
        return list(self._info.kv_transfer_handles)

    def pull_kv(self, alloc: KVAllocation, remotes: list, remote_block_ids: list[int],
                timeout_s: float | None = None, deadline: float | None = None,
                lease_id: str | None = None):
        # time.monotonic() is this host's clock, the engine process's too.
        return self._proc.submit("pull_kv", alloc, list(remotes), list(remote_block_ids),
                                 timeout_s, deadline, lease_id).result()

    def preconnect_kv(self, remotes: list) -> bool:
        return self._proc.submit("preconnect_kv", list(remotes)).result()

    def forget_kv_peers(self, agent_names: list[str]) -> list[str]:
        return self._proc.submit("forget_kv_peers", list(agent_names)).result()

    def kv_peer_names(self) -> list[str]:
        return self._proc.submit("kv_peer_names").result()

    def reset_prefix_cache(self):
        return self._proc.submit("reset_prefix_cache").result()

    def cached_block_hashes(self) -> list:
        return self._proc.submit("cached_block_hashes").result()


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


def _wait_ready(reader: FrameReader, proc: subprocess.Popen) -> EngineProcInfo:
    """The engine's info once built; its error if building failed; RuntimeError if the process
    ended first. Anything else before those (none is sent) is skipped."""
    while True:
        try:
            msg = reader.read_blocking(1.0)
        except BadFrame:  # the process lives on: start() ends it
            raise
        except PipeClosed:
            break
        if msg is not None:
            if msg[0] == "failed":
                raise msg[1]
            if msg[0] == "ready":
                return msg[1]
            continue
        if proc.poll() is not None:
            break
    raise RuntimeError(f"the engine process exited with code {proc.wait()} before its engine "
                       f"was built")


def _stop_process(proc: subprocess.Popen, timeout_s: float) -> None:
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        logger.error("the engine process (pid %d) did not stop in %.0f s; killing it",
                     proc.pid, timeout_s)
        proc.kill()
        proc.wait()
