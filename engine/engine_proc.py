"""The engine's own process (``--engine-process``): the child side.

A worker's gRPC event loop and its engine thread share one GIL in one process: every token the
loop streams (protobuf, gRPC's Cython, asyncio) is time the step's Python waits for, on a host
with idle cores. With ``--engine-process`` the worker starts this process, which builds the
engine and steps it (``AsyncEngine``'s engine thread, unchanged); the worker keeps the network
side (engine/engine_client.py). Per step one message goes up the pipe, with every output of
the step (only what is new in each), the stats when they changed and the KV-cache events.

Messages (engine/engine_pipe.py: pickled, one socket pair each way):
- down: ``("call", id, method, args)`` answered by ``("reply", id, ok, value)``;
  ``("abort", rid)``, ``("release_kv", rid)``; ``("shutdown",)``.
- up: ``("ready", EngineProcInfo)`` or ``("failed", exc)`` once built, before anything else;
  ``("step", outputs, stats, events)``, the outputs as ``engine_pipe.OutputEncoder`` tuples;
  ``("dead", exc)`` when a step failed or the step watchdog fired; ``("tick",)`` every
  ``engine_pipe.TICK_S`` (the worker takes a long silence for a wedged process).

The worker drives this process's life: SIGINT and SIGTERM are ignored (a terminal's Ctrl-C
reaches the whole process group; the worker drains first), and the end of the pipe (the worker
exited, even SIGKILLed) shuts the engine down and ends the process.
"""
from __future__ import annotations

import asyncio
import dataclasses
import faulthandler
import logging
import os
import pickle
import signal
import socket
import sys
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor

import torch

from engine.async_engine import AsyncEngine
from engine.core_share import CoreShare
from engine.engine_pipe import (TICK_S, EngineProcInfo, EngineProcSpec, FrameReader,
                                FrameWriter, OutputEncoder, PipeClosed, QueuedSender)
from engine.guide_threads import on_guide_thread
from engine.llm_engine import LLMEngine
from engine.openmp_threads import call_in_own_thread, use_one_openmp_thread
from engine.outputs import EngineStats, RequestOutput
from engine.process_exit import die_with_parent, exit_process, exit_status
from engine.switch_interval import apply_switch_interval
from engine.thread_names import named_thread, set_os_thread_name

logger = logging.getLogger(__name__)

# What the worker may call; each runs in this process's thread pool (it may wait for a step).
POOL_METHODS = frozenset({"add_prefilled_request", "commit_prefilled", "pull_kv",
                          "preconnect_kv", "forget_kv_peers", "kv_peer_names",
                          "reset_prefix_cache", "cached_block_hashes", "get_stats"})
# Quick, and in order with the steps: run on this process's loop.
INLINE_METHODS = frozenset({"add_request"})


def portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else a RuntimeError with its type and text; so is
    torch's own (a GPU OOM): the worker unpickles what crosses on its event loop, and a class
    of torch's would import torch there, a second and more in which the loop does nothing
    else (the worker never imports torch)."""
    if type(exc).__module__.partition(".")[0] == "torch":
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any exception that cannot cross the pipe
        return RuntimeError(f"{type(exc).__name__}: {exc}")


class _Pipe:
    """The child's sending end. The engine thread sends its steps itself (blocking while the
    worker is behind is right for it); the loop's replies go through a ``QueuedSender``, so it
    always goes on reading: a loop blocked on a full pipe while the worker waits for it to read
    would wait forever. A thread of its own ticks, which it cannot while the process is wedged:
    that silence is how the worker knows."""

    def __init__(self, writer: FrameWriter) -> None:
        self.writer = writer
        self._replies = QueuedSender(writer, "pdserve-engine-replies")
        self._stop = threading.Event()
        self._ticker = named_thread(self._tick, "pdserve-engine-tick")

    def send(self, msg: tuple) -> None:
        try:
            self.writer.send(msg)
        except OSError:  # the worker is gone; the loop sees the end of the pipe and stops
            pass

    def reply(self, call_id: int, ok: bool, value: object) -> None:
        """Queues a call's reply; one whose value cannot cross fails the call with why (the
        caller would otherwise wait for it forever)."""
        try:
            self._replies.send(("reply", call_id, ok, value))
        except Exception as e:  # noqa: BLE001 - whatever pickling the value raises
            logger.exception("the reply to call %d cannot be sent", call_id)
            self._replies.send(("reply", call_id, False, RuntimeError(
                f"the engine's reply cannot cross to the worker: {type(e).__name__}: {e}")))

    def start_ticks(self) -> None:
        self._ticker.start()

    def _tick(self) -> None:
        while not self._stop.wait(TICK_S):
            self.send(("tick",))

    def close(self) -> None:
        self._stop.set()
        self._replies.close(timeout_s=5)
        if self._ticker.is_alive():
            self._ticker.join(timeout=5)


class _ChildEngine(AsyncEngine):
    """``AsyncEngine`` whose steps go up the pipe instead of to local streams."""

    def __init__(self, engine: LLMEngine, pipe: _Pipe, core_share: CoreShare | None,
                 step_timeout_s: float | None) -> None:
        self.pipe = pipe
        self._sent_stats: EngineStats | None = None
        self._encoder = OutputEncoder()
        super().__init__(engine, core_share=core_share, step_timeout_s=step_timeout_s,
                         on_dead=lambda e: pipe.send(("dead", portable(e))))

    def _after_step(self, outputs: list[RequestOutput]) -> None:
        events = self.engine.take_kv_events()
        stats = self.stats if self.stats != self._sent_stats else None
        if outputs or events or stats is not None:
            self._sent_stats = self.stats
            self.pipe.send(("step", [self._encoder.encode(o) for o in outputs], stats, events))

    def _scheduled(self, engine: LLMEngine) -> None:
        events = engine.take_kv_events()
        if events:  # the worker applies them as a step's, with no outputs nor stats
            self.pipe.send(("step", [], None, events))

    def _died(self, e: BaseException) -> None:
        if not self._stop.is_set():
            self.pipe.send(("dead", portable(e)))

    def wake(self) -> None:
        self._wake.set()


class _Server:
    def __init__(self, reader: FrameReader, pipe: _Pipe, engine: _ChildEngine) -> None:
        self.reader, self.pipe, self.engine = reader, pipe, engine
        self.done = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        # Requests whose guide is being built before their add, with the messages about them
        # that came meanwhile (replayed after the add, in order).
        self._warming: dict[str, list[tuple]] = {}

    def on_readable(self) -> None:
        try:
            msgs = self.reader.read_ready()
        except PipeClosed as e:  # the worker ended, or sent what cannot be read
            if not self.done.is_set():
                logger.warning("the pipe from the worker ended (%s): shutting the engine down",
                               e)
            self.done.set()
            return
        for msg in msgs:
            self._handle(msg)

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind in ("abort", "release_kv") and msg[1] in self._warming:
            self._warming[msg[1]].append(msg)  # after its add
            return
        if kind == "call":
            _, call_id, method, args = msg
            if method in POOL_METHODS:
                self._spawn(self._call(call_id, method, args))
            elif method == "add_request" and args[2] is not None and \
                    not self.engine.engine.guides.ready(args[2]):
                self._warming[args[0]] = []
                self._spawn(self._warm_then_add(call_id, args))
            else:  # now, in order with the aborts that may follow it
                self._call_inline(call_id, method, args)
        elif kind == "abort":
            self.engine.abort(msg[1])
        elif kind == "release_kv":
            self.engine.release_kv(msg[1])
        elif kind == "shutdown":
            self.done.set()
        else:
            logger.error("unknown message from the worker: %r", kind)

    def _spawn(self, work) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _warm_then_add(self, call_id: int, args: tuple) -> None:
        """A guided request whose guide is not built yet: built on a guide thread
        (engine/guide_threads.py: a schema's compile may take up to its budget, the
        vocabulary's trie a second at the first), and then added, with what came about it
        meanwhile. Inline, the build held every other request's add, abort and release."""
        request_id, params = args[0], args[2]
        try:
            await on_guide_thread(self.engine.engine.guides.warm, params)
        except Exception:  # noqa: BLE001 - the add raises it again, as its reply
            pass
        finally:
            held = self._warming.pop(request_id)
        self._call_inline(call_id, "add_request", args)
        for msg in held:
            self._handle(msg)

    def _call_inline(self, call_id: int, method: str, args: tuple) -> None:
        try:
            if method not in INLINE_METHODS:
                raise ValueError(f"the engine process has no method {method!r}")
            value = getattr(self.engine.engine, method)(*args)
            self.engine.wake()
        except Exception as e:  # noqa: BLE001 - the caller raises it
            self.pipe.reply(call_id, False, portable(e))
            return
        self.pipe.reply(call_id, True, value)

    async def _call(self, call_id: int, method: str, args: tuple) -> None:
        try:
            value = await asyncio.to_thread(getattr(self.engine.engine, method), *args)
            if method == "commit_prefilled":
                self.engine.wake()
        except Exception as e:  # noqa: BLE001 - the caller raises it
            self.pipe.reply(call_id, False, portable(e))
            return
        self.pipe.reply(call_id, True, value)


async def _serve(reader: FrameReader, writer: FrameWriter) -> None:
    spec: EngineProcSpec = reader.read_blocking(None)
    loop = asyncio.get_running_loop()
    # Side jobs (KV pulls, stats, commits) on one OpenMP thread each, as in a worker.
    loop.set_default_executor(ThreadPoolExecutor(thread_name_prefix="pdserve-engine-pool",
                                                 initializer=use_one_openmp_thread))
    pipe = _Pipe(writer)
    built = await _build(spec, pipe)
    if built is None:
        pipe.close()
        return
    llm, share, info = built
    # "ready" goes first, before the engine thread can send a step: the worker reads nothing
    # else until it has it.
    pipe.send(("ready", info))
    pipe.start_ticks()
    try:
        engine = _ChildEngine(llm, pipe, share, spec.step_timeout_s)
    except Exception as e:  # noqa: BLE001 - after "ready": the worker takes it as a death
        logger.exception("starting the engine failed")
        pipe.send(("dead", portable(e)))
        _discard(llm, share)
        pipe.close()
        return
    server = _Server(reader, pipe, engine)
    fd = reader.sock.fileno()
    loop.add_reader(fd, server.on_readable)
    try:
        await server.done.wait()
    finally:
        loop.remove_reader(fd)
        await asyncio.to_thread(engine.shutdown)
        pipe.close()


async def _build(spec: EngineProcSpec, pipe: _Pipe
                 ) -> tuple[LLMEngine, CoreShare | None, EngineProcInfo] | None:
    """The engine, its core share and what the worker learns of them; None once ("failed",
    why) is sent, everything built so far shut down again."""
    llm = share = None
    try:
        llm = await asyncio.to_thread(call_in_own_thread, LLMEngine, spec.engine)
        llm.enable_kv_events()  # the worker publishes them
        if spec.core_share is not None:
            share = CoreShare(dataclasses.replace(spec.core_share, base_threads=min(
                spec.core_share.base_threads, torch.get_num_threads())))
        handles = llm.kv_transfer_handles() if spec.engine.kv_transfer_backend else []
        return llm, share, EngineProcInfo(os.getpid(), llm.max_model_len,
                                          llm.kv_cache_layouts(), handles, llm.get_stats())
    except Exception as e:  # noqa: BLE001 - the worker reports it and exits
        if isinstance(e, ValueError):  # a bad flag: the worker says it, as without a process
            logger.error("building the engine failed: %s", e)
        else:
            logger.exception("building the engine failed")
        pipe.send(("failed", portable(e)))
        _discard(llm, share)
        return None


def _discard(llm: LLMEngine | None, share: CoreShare | None) -> None:
    """Shuts down what was built for an engine that will not run (its TP workers, KV agent)."""
    try:
        if share is not None:
            share.close()
        if llm is not None:
            llm.shutdown()
    except Exception:  # noqa: BLE001 - the process ends anyway; the first error was sent
        logger.exception("shutting the engine down failed")


def main(down_fd: int, up_fd: int, parent_pid: int = 0) -> None:
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    set_os_thread_name("engine-core")
    faulthandler.enable()
    apply_switch_interval()  # the worker checked it when it started
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    reader = FrameReader(socket.socket(fileno=down_fd))
    writer = FrameWriter(socket.socket(fileno=up_fd))
    status = 0
    try:
        asyncio.run(_serve(reader, writer))
    except SystemExit as e:
        status = exit_status(e.code)
    except BaseException:  # noqa: BLE001 - reported here, then the same exit as any
        traceback.print_exc()
        status = 1
    finally:
        reader.close()
        writer.close()
    # The worker waits for this exit when it stops: skip the interpreter's teardown, also on
    # a failure (a KV pull's thread still in a native call must not wake into it).
    exit_process(status)


if __name__ == "__main__":
    # Through the module's own name: what crosses the pipe must pickle as
    # engine.engine_proc.*, not __main__.*, which the worker cannot find.
    from engine.engine_proc import main as _main

    _main(*map(int, sys.argv[1:4]))
