"""Keeping a worker's OpenMP threads few enough that GNU OpenMP lets them spin.

Between two kernels of a step, the engine thread's OpenMP team waits for the next parallel
region: libgomp spins ``GOMP_SPINCOUNT`` rounds, then sleeps on a futex, and a sleeper costs
a wake-up (tens of microseconds on a VM) at the next region. But once the process's libgomp
threads outnumber its CPUs, libgomp cuts every spin to ~100 rounds: then the team sleeps and
wakes around nearly every kernel. Each OS thread that ever ran a parallel region on more than
one thread keeps a team of its own (its pool lives as long as the thread), so a worker that
built its engine (packing weights on every core) in one thread and steps it in another counts
both teams. On 2 cores that was 3 threads against 2 CPUs: ~90 sleeps a step instead of 2-5,
and a prefill step of 62 tokens over a 448-token cached prefix took 30 ms against 25, a
510-token one 170 ms against 157 (``pdserve bench serve``'s shared-prefix phase, the
engine on 2 threads).

So work that runs parallel regions before the engine thread takes over runs in a thread of
its own that ends with it, taking its team along; and the threads that serve the engine's
side jobs (the event loop's executor, the torch KV backend's connection threads) run their
tensor work on one thread, starting no team at all.
"""
from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable
from typing import TypeVar

import torch

from engine.thread_names import named_thread

T = TypeVar("T")


def call_in_own_thread(fn: Callable[..., T], *args, name: str = "pdserve-build") -> T:
    """``fn(*args)`` in a new thread, joined before returning its result (or raising its
    exception here): the OpenMP team it started ends with that thread."""
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn(*args))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            error.append(e)

    thread = named_thread(run, name)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The GNU OpenMP runtime torch loaded (found by path: its file name varies between
    builds), or None where torch runs on another one."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line}
    except OSError:
        return None
    for path in sorted(paths):
        if os.path.basename(path).startswith("libgomp") and os.path.exists(path):
            return ctypes.CDLL(path)  # the loaded library's handle: dlopen finds it by path
    return None


def use_one_openmp_thread() -> None:
    """This thread's parallel regions run on one thread from now on; other threads keep
    their counts. torch.set_num_threads cannot do it: it also sets the process-wide count
    that every thread which has not run a parallel region yet adopts at its first one (the
    engine thread included)."""
    # torch gives a thread its count at the thread's first parallel use (or count query):
    # now, so that it cannot overwrite ours later.
    torch.get_num_threads()
    lib = _libgomp()
    if lib is not None:
        lib.omp_set_num_threads(ctypes.c_int(1))
