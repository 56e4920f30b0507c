"""The CPUs this process may use: what its CPU threads are sized from.

``os.cpu_count()`` is the host's CPUs. A process pinned to fewer (taskset, a container's
cpuset, Kubernetes' static CPU manager) or held to a CPU quota (``docker run --cpus``, a pod's
CPU limit: cgroup v2's cpu.max) that starts a thread per host CPU oversubscribes what it has:
OpenMP's threads then wait on each other at every barrier.
"""
from __future__ import annotations

import math
import os

# cgroup v2: where its hierarchy is mounted, and where this process says which cgroup it is in.
CGROUP_ROOT = "/sys/fs/cgroup"
PROC_CGROUP = "/proc/self/cgroup"


def usable_cpus() -> int:
    """The CPUs this process may run on, capped by its cgroup's CPU quota where one is set
    and readable; at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity on this platform
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_limit()
    if quota is not None:
        cpus = min(cpus, quota)
    return max(1, cpus)


def cgroup_cpu_limit() -> int | None:
    """The tightest cgroup v2 CPU quota on this process, in whole CPUs (a quota of 1.5 CPUs
    lets 2 threads run part of the time: 2); None where none is set or none can be read (cgroup
    v1, no /sys/fs/cgroup). A parent cgroup's quota binds its children too: every level up to
    the root counts."""
    group = _cgroup_v2_path()
    if group is None:
        return None
    limits = []
    parts = [p for p in group.split("/") if p]
    for depth in range(len(parts), -1, -1):
        limit = _read_cpu_max(os.path.join(CGROUP_ROOT, *parts[:depth], "cpu.max"))
        if limit is not None:
            limits.append(limit)
    return min(limits) if limits else None


def _cgroup_v2_path() -> str | None:
    """This process's cgroup v2 path ("0::/a/b" in /proc/self/cgroup), or None."""
    try:
        with open(PROC_CGROUP) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("0::"):
            return line[3:]
    return None


def _read_cpu_max(path: str) -> int | None:
    """cpu.max's "QUOTA PERIOD" as whole CPUs; None for "max" (no quota), a file that is not
    there, or one that does not parse."""
    try:
        with open(path) as f:
            fields = f.read().split()
    except OSError:
        return None
    if len(fields) != 2 or not all(v.isdigit() for v in fields):
        return None  # "max 100000", or something this does not understand
    quota, period = int(fields[0]), int(fields[1])
    if quota <= 0 or period <= 0:
        return None
    return max(1, math.ceil(quota / period))
