"""Faults in an engine process a test starts (tests/test_engine_process_faults.py), or in a
worker process (tests/test_grpc_server_stop.py).

With this folder on PYTHONPATH, Python imports this module as the process starts, before its
main module runs; ``PDSERVE_TEST_FAULT`` names the fault and its arguments (``name:a,b``). The
faults patch the engine process's own code from outside: what the code under test does about
them is what the tests check.
"""
from __future__ import annotations

import os

FAULT_ENV = "PDSERVE_TEST_FAULT"


def slow_kv_cache_layouts(seconds: str) -> None:
    """Building the engine's info takes this long: a main thread descheduled on a loaded host
    (an engine thread already stepping then sends before "ready" does)."""
    import time

    from engine.llm_engine import LLMEngine

    layouts = LLMEngine.kv_cache_layouts

    def slow(self):
        time.sleep(float(seconds))
        return layouts(self)

    LLMEngine.kv_cache_layouts = slow


def hold_gil_at_step(busy_step: str, seconds: str) -> None:
    """The busy_step'th step with requests calls C that keeps the GIL for ``seconds`` (libc's
    sleep through ctypes.PyDLL: a hung extension call): nothing else in the process runs."""
    import ctypes

    from engine.llm_engine import LLMEngine

    step, busy = LLMEngine.step, [0]

    def held(self):
        if self.has_unfinished_requests():
            busy[0] += 1
            if busy[0] == int(busy_step):
                ctypes.PyDLL(None).sleep(int(seconds))
        return step(self)

    LLMEngine.step = held


def unpicklable_kv_peer_names() -> None:
    """kv_peer_names answers with a value that cannot be pickled."""
    from engine.llm_engine import LLMEngine

    LLMEngine.kv_peer_names = lambda self: [lambda: "no pickle"]


class _Unloadable:
    """Pickles; unpickling it raises (as a class the worker cannot import would)."""

    def __reduce__(self):
        return (int, ("not a number",))


def unloadable_kv_peer_names() -> None:
    """kv_peer_names answers with a value the worker cannot unpickle."""
    from engine.llm_engine import LLMEngine

    LLMEngine.kv_peer_names = lambda self: [_Unloadable()]


def load_until_stopped(marker: str) -> None:
    """Building the engine writes ``marker``, then lasts until the process was told to stop
    (its SIGTERM seen: engine/process_exit.py), as a large model's load outlasts a stop."""
    from engine.llm_engine import LLMEngine
    from engine.process_exit import stop_asked

    init = LLMEngine.__init__

    def slow(self, *args, **kwargs):
        with open(marker, "w"):
            pass
        if not stop_asked.wait(120):
            raise RuntimeError("no stop asked while loading")
        init(self, *args, **kwargs)

    LLMEngine.__init__ = slow


def quit_grace(seconds: str) -> None:
    """No fault: rank 0's shutdown kills the ranks that have not quit after ``seconds``
    instead of 5 s (engine/tp_executor.py), for a test whose rank is stopped and never quits,
    and where how long the shutdown waits on it is not the point."""
    from engine import tp_executor

    tp_executor._QUIT_GRACE_S = float(seconds)


def guides_wait_for(marker: str) -> None:
    """Building a guide (a schema's or a pattern's, on a first request for it) writes the
    name of its thread to ``marker``.building, then lasts until ``marker`` exists, as a large
    schema's compile or a large vocabulary's trie does."""
    import time

    from engine import guided_regex

    init = guided_regex.TokenGuide.__init__

    def slow(self, *args, **kwargs):
        import threading

        with open(marker + ".building", "w") as f:
            f.write(threading.current_thread().name)
        deadline = time.monotonic() + 120
        while not os.path.exists(marker):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{marker} never appeared")
            time.sleep(0.01)
        init(self, *args, **kwargs)

    guided_regex.TokenGuide.__init__ = slow


FAULTS = {f.__name__: f for f in (slow_kv_cache_layouts, hold_gil_at_step,
                                  unpicklable_kv_peer_names, unloadable_kv_peer_names,
                                  load_until_stopped, quit_grace, guides_wait_for)}


def _apply(spec: str) -> None:
    name, _, args = spec.partition(":")
    FAULTS[name](*(args.split(",") if args else ()))


if os.environ.get(FAULT_ENV):
    _apply(os.environ[FAULT_ENV])
