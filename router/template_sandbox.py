"""Where a request's own chat template renders (ChatPrompt.chat_template, behind
--trust-request-chat-template): child processes (router/template_child.py), each rendering
one job at a time, killed when a job runs past --request-chat-template-timeout-s or when the
request leaves, and replaced.

A template is code the client wrote. Jinja's sandbox keeps it from reaching the router's
objects; these processes keep it from the router's time and memory: before them it rendered
in a router thread that nothing could stop, so a template looping for minutes held the thread
(and, a few at once, the thread pool every large prompt tokenizes in), and one allocating
100 GB took the router down with it.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from dataclasses import dataclass, fields
from typing import Any

import grpc

from engine.config import positive_number
from engine.process_exit import describe_exit
from router.errors import RouterRejectError
from router.template_child import HEADER, MAX_RENDERED_CHARS

logger = logging.getLogger(__name__)

# A child imports transformers' renderer before it answers (~1 s; more on a loaded host).
START_TIMEOUT_S = 60.0
# A reply of more bytes than this is decoded in a thread, off the event loop.
INLINE_REPLY_BYTES = 64 * 1024
# A reply frame the router reads at most: the child's MAX_RENDERED_CHARS as UTF-8, at up to
# 4 bytes a character, JSON-escaped (6 bytes a control character), with room for the keys.
MAX_REPLY_BYTES = 6 * MAX_RENDERED_CHARS + 4096


@dataclass(frozen=True)
class TemplateSandboxConfig:
    # Processes rendering requests' templates at once; a request waits for a free one (as
    # long as its deadline lets it; the router's --max-inflight-requests bounds the waiters).
    workers: int = 2
    # Wall-clock seconds one render may take; past it the process is killed and the request
    # gets INVALID_ARGUMENT. Models' templates render in milliseconds.
    timeout_s: float = 5.0
    # Memory one render may allocate beyond what the process holds when it starts.
    memory_mb: int = 1024

    def __post_init__(self) -> None:
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) \
                or not 1 <= self.workers <= 64:
            raise ValueError(f"request_chat_template_workers must be an integer in [1, 64], "
                             f"got {self.workers!r}")
        positive_number("request_chat_template_timeout_s", self.timeout_s)
        if isinstance(self.memory_mb, bool) or not isinstance(self.memory_mb, int) \
                or self.memory_mb < 64:
            raise ValueError(f"request_chat_template_memory_mb must be an integer >= 64, "
                             f"got {self.memory_mb!r}")


@dataclass(frozen=True)
class RenderJob:
    """engine.chat_template.render_template's arguments, as the child receives them."""
    template: str
    conversation: list[dict]
    special_tokens: dict[str, str]
    tools: list[dict] | None
    add_generation_prompt: bool
    continue_final_message: bool
    kwargs: dict[str, Any]

    def encode(self) -> bytes:
        """The job as the child reads it; ~10 ms a MB of chat, so off the event loop for a
        large one (ServedModel encodes in the thread that built the job)."""
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)},
                          ensure_ascii=False).encode()


class _Renderer:
    """One child process and its pipes."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def start(cls, config: TemplateSandboxConfig) -> _Renderer:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "router.template_child", str(os.getpid()),
            str(config.memory_mb), str(2 * config.timeout_s + 1),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        renderer = cls(proc)
        try:
            ready = await asyncio.wait_for(renderer.read(), START_TIMEOUT_S)
        except BaseException:
            renderer.kill()
            raise
        if ready != {"ready": True}:
            renderer.kill()
            raise RuntimeError(f"the chat template process started with {ready!r}")
        return renderer

    async def call(self, payload: bytes) -> dict:
        self.proc.stdin.write(HEADER.pack(len(payload)) + payload)
        await self.proc.stdin.drain()
        return await self.read()

    async def read(self) -> dict:
        head = await self.proc.stdout.readexactly(HEADER.size)
        size = HEADER.unpack(head)[0]
        if size > MAX_REPLY_BYTES:
            raise RuntimeError(f"the chat template process sent a {size}-byte frame")
        body = await self.proc.stdout.readexactly(size)
        if size > INLINE_REPLY_BYTES:
            return await asyncio.to_thread(json.loads, body)
        return json.loads(body)

    def kill(self) -> None:
        if self.proc.returncode is None:
            try:
                self.proc.kill()
            except ProcessLookupError:
                pass

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None


class TemplateSandbox:
    """Renders RenderJobs in ``config.workers`` child processes; start() on the event loop
    that renders, close() when done."""

    def __init__(self, config: TemplateSandboxConfig) -> None:
        self.config = config
        self._free: asyncio.Queue[_Renderer | None] | None = None
        self._renderers: set[_Renderer] = set()
        self._refills: set[asyncio.Task] = set()

    async def start(self) -> None:
        """Starts every child now, so no request pays a child's start; one that fails to
        start is tried again when a request needs it."""
        self._free = asyncio.Queue()
        started = await asyncio.gather(*(self._start() for _ in range(self.config.workers)),
                                       return_exceptions=True)
        for r in started:
            if isinstance(r, BaseException):
                logger.warning("a chat template process did not start: %s", r)
                r = None
            self._free.put_nowait(r)

    async def close(self) -> None:
        for task in list(self._refills):
            task.cancel()
        await asyncio.gather(*self._refills, return_exceptions=True)
        for r in list(self._renderers):
            r.kill()
        await asyncio.gather(*(r.proc.wait() for r in self._renderers),
                             return_exceptions=True)
        self._renderers.clear()

    @property
    def pids(self) -> list[int]:
        """The live children's pids (for tests and stats)."""
        return [r.proc.pid for r in self._renderers if r.alive]

    async def render(self, job: RenderJob) -> str:
        """The rendered text; ValueError (INVALID_ARGUMENT) when the template does not parse,
        refuses the conversation, fails on it or runs past its time or memory;
        RouterRejectError UNAVAILABLE when no child process can be started."""
        return await self.render_encoded(job.encode())

    async def render_encoded(self, payload: bytes) -> str:
        """render, for a job already encoded (RenderJob.encode)."""
        if self._free is None:
            raise RuntimeError("TemplateSandbox.render before start()")
        renderer = await self._free.get()
        try:
            if renderer is None or not renderer.alive:
                if renderer is not None:
                    renderer = self._retire(renderer)
                renderer = await self._replace()
            try:
                answer = await asyncio.wait_for(renderer.call(payload), self.config.timeout_s)
            except TimeoutError:
                renderer = self._retire(renderer)
                raise ValueError(f"the chat template ran past {self.config.timeout_s:g} s "
                                 "(--request-chat-template-timeout-s)") from None
            except (asyncio.IncompleteReadError, ConnectionError):
                code = await _exit_status(renderer)
                renderer = self._retire(renderer)
                raise ValueError(f"the chat template ended the process rendering it "
                                 f"({code})") from None
            except BaseException:  # the request left (cancel, deadline): the job may run on
                renderer = self._retire(renderer)
                raise
            if answer.get("retire"):
                renderer = self._retire(renderer)
        finally:
            if renderer is None:  # its replacement starts now, not on the next request
                self._refill_later()
            else:
                self._free.put_nowait(renderer)
        if "text" in answer:
            return answer["text"]
        if answer.get("bug"):
            logger.error("a chat template process failed: %s", answer["error"])
            raise RuntimeError(answer["error"])
        raise ValueError(answer["error"])

    async def _start(self) -> _Renderer:
        r = await _Renderer.start(self.config)
        self._renderers.add(r)
        return r

    def _refill_later(self) -> None:
        task = asyncio.get_running_loop().create_task(self._refill())
        self._refills.add(task)
        task.add_done_callback(self._refills.discard)

    async def _refill(self) -> None:
        try:
            r = await self._start()
        except Exception as e:  # tried again when a request needs it
            logger.warning("a chat template process did not start: %s", e)
            r = None
        self._free.put_nowait(r)

    async def _replace(self) -> _Renderer:
        try:
            return await self._start()
        except (OSError, RuntimeError, TimeoutError, asyncio.IncompleteReadError) as e:
            logger.error("a chat template process did not start: %s", e)
            raise RouterRejectError(grpc.StatusCode.UNAVAILABLE,
                                    "the router could not start a process to render the "
                                    "request's chat template") from None

    def _retire(self, renderer: _Renderer) -> None:
        """Kills ``renderer``; what its slot holds from now (None: start one when needed)."""
        renderer.kill()
        self._renderers.discard(renderer)
        return None


async def _exit_status(renderer: _Renderer) -> str:
    """How a child that closed its pipe ended (it may have closed the pipe only)."""
    try:
        code = await asyncio.wait_for(renderer.proc.wait(), 2.0)
    except TimeoutError:
        return "it closed its pipe"
    return describe_exit(code)
