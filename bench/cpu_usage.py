"""Where a benchmark point's CPU went: the machine's busy cores and each service's share.

On a host where the services share few cores, a serving path's cost is less its own CPU than
the stall it puts on the engine's multi-threaded steps (docs/benchmarks.md, session 34): the
figures say how much of the cores each process took while a load ran. Read from Linux's /proc
(utime + stime of every thread of a process and of the processes it started: a TP worker's
ranks, an engine process); elsewhere there is nothing to read and the meter reports None.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from router.proc_family import descendants

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def process_cpu_s(pid: int) -> float:
    """CPU seconds of one process, all its threads; 0 for one that is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and of its live descendants."""
    return sum(process_cpu_s(p) for p in (pid, *descendants(pid)))


def machine_busy_s() -> float | None:
    """CPU seconds the whole machine spent not idle, summed over its cores; None off Linux."""
    try:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    # user, nice, system, irq, softirq: not idle or iowait, nor steal (a VM's other tenants);
    # guest time is inside user already
    return (sum(values[:3]) + sum(values[5:7])) * _TICK_S


@dataclass
class CPUShare:
    """Cores used over ``wall_s``: by the whole machine and by each named group of processes."""

    wall_s: float
    machine_cores: float
    cores: dict[str, float] = field(default_factory=dict)

    @staticmethod
    def pooled(shares: list[CPUShare | None]) -> CPUShare | None:
        """One share over several runs, each weighted by its length (runs not measured, None,
        left out)."""
        shares = [s for s in shares if s is not None and s.wall_s > 0]
        if not shares:
            return None
        wall = sum(s.wall_s for s in shares)
        machine = sum(s.machine_cores * s.wall_s for s in shares) / wall
        names = dict.fromkeys(n for s in shares for n in s.cores)
        return CPUShare(wall, machine, {n: sum(s.cores.get(n, 0.0) * s.wall_s for s in shares)
                                        / wall for n in names})


class CPUMeter:
    """Measures named groups of processes (``{"router": [pid], "decode": [pid, pid]}``), each
    with its descendants except for the groups named in ``alone``, between ``start()`` and
    ``stop()``."""

    def __init__(self, groups: dict[str, list[int]], alone: frozenset[str] = frozenset()) -> None:
        self.groups = groups
        self.alone = alone
        self._t0 = 0.0
        self._machine0: float | None = None
        self._cpu0: dict[str, float] = {}

    def _cpu(self) -> dict[str, float]:
        return {name: sum(process_cpu_s(p) if name in self.alone else tree_cpu_s(p) for p in pids)
                for name, pids in self.groups.items()}

    def start(self) -> None:
        self._cpu0 = self._cpu()
        self._machine0 = machine_busy_s()
        self._t0 = time.perf_counter()

    def stop(self) -> CPUShare | None:
        """The shares since ``start()``; None where /proc cannot be read."""
        wall = time.perf_counter() - self._t0
        machine = machine_busy_s()
        cpu = self._cpu()
        if machine is None or self._machine0 is None or wall <= 0:
            return None
        return CPUShare(wall, (machine - self._machine0) / wall,
                        {n: max(0.0, cpu[n] - self._cpu0[n]) / wall for n in self.groups})
