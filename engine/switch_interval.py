"""``PDSERVE_SWITCH_INTERVAL_MS``: how long a thread may hold the GIL while another waits for it.

CPython makes a waiting thread wait up to ``sys.getswitchinterval()`` (5 ms) before it asks the
holder to let go. Where the engine's step is mostly Python (a GPU host: the kernels are queued,
the host schedules and samples) its thread holds the GIL nearly all the time, and every other
thread of that process pays up to 5 ms each time it needs the GIL: the event loop forwarding a
step's outputs, a KV pull's thread polling NIXL every 0.2 ms. Ten 0.2 ms polls beside a busy
Python thread took 54 ms at 5 ms, 14 at 1 ms, 9 at 0.5 ms (ad hoc, 2-core VM); the H100's KV
transfers took 42-59 ms at 32 concurrent streams against ~6 ms alone (docs/benchmarks.md,
session 33). A shorter interval costs the busy thread more forced switches, which on a 2-core
CPU host measured slower (session 32), so it is opt-in until a GPU run measures it.

Every service process (``engine.grpc_server.run``) and engine process applies it at start.
"""
from __future__ import annotations

import math
import os
import sys
from collections.abc import Mapping

ENV = "PDSERVE_SWITCH_INTERVAL_MS"
# Below a few tens of microseconds the forced switches are most of what the threads do; past
# 100 ms a waiting thread (a health check's handler) could stall for longer than a probe waits.
MIN_MS, MAX_MS = 0.05, 100.0


def switch_interval_s(environ: Mapping[str, str] = os.environ) -> float | None:
    """The interval ``environ`` asks for, in seconds; None when it asks for none (unset or
    empty). A value that is not a number of milliseconds in [MIN_MS, MAX_MS] is a ValueError."""
    raw = environ.get(ENV, "").strip()
    if not raw:
        return None
    try:
        ms = float(raw)
    except ValueError:
        raise ValueError(f"{ENV} must be a number of milliseconds, got {raw!r}") from None
    if not math.isfinite(ms) or not MIN_MS <= ms <= MAX_MS:
        raise ValueError(f"{ENV} must be in [{MIN_MS:g}, {MAX_MS:g}] ms, got {raw!r}")
    return ms / 1000.0


def apply_switch_interval(environ: Mapping[str, str] = os.environ) -> None:
    """Sets this process's switch interval from ``environ``; leaves CPython's when unset."""
    seconds = switch_interval_s(environ)
    if seconds is not None:
        sys.setswitchinterval(seconds)
