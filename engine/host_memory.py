"""The memory a new allocation in this process may take: the host's MemAvailable, or less where
a cgroup memory limit holds the process (a worker in a container: compose/, Kubernetes).

Inside a container MemAvailable is still the host's: a KV cache sized against it was mapped,
and the cgroup's OOM killer ended the worker as the cache was zeroed. A cgroup's headroom is its
limit less its usage, less the page cache it may drop first (inactive_file, as the kubelet's
working set counts it; MemAvailable counts droppable cache as available too): the checkpoint a
worker just read is charged to its cgroup as cache.

cgroup v2 (one hierarchy at /sys/fs/cgroup): memory.max ("max": none) and memory.current.
cgroup v1 (its memory controller at /sys/fs/cgroup/memory): memory.limit_in_bytes (none: a
page-rounded 2**63) and memory.usage_in_bytes. The process's cgroup is the path
/proc/self/cgroup names under the mount; a container with a cgroup namespace of its own sees
its cgroup as "/", the mount itself, and one without sees a path its mount lacks, whose levels
are then skipped. Every level up to the mount's root binds the process: a limit on a parent
slice holds its children too. Every path is under ``root``, so that tests can build a /proc
and a /sys of their own.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

# v1's "no limit" is 2**63 rounded down to a page: anything this large is none.
_V1_UNLIMITED = 1 << 62


@dataclass(frozen=True)
class AvailableMemory:
    nbytes: int
    # The cgroup whose limit bounds it (its limit file) and that limit; None: MemAvailable does.
    limit_file: str | None = None
    limit: int | None = None


@dataclass(frozen=True)
class _Controller:
    mount: str  # relative to the root
    proc_field: str  # how /proc/self/cgroup names this hierarchy's controllers ("" for v2)
    limit: str
    usage: str
    reclaimable: str  # memory.stat's droppable page cache, this level and below


_V2 = _Controller("sys/fs/cgroup", "", "memory.max", "memory.current", "inactive_file")
_V1 = _Controller("sys/fs/cgroup/memory", "memory", "memory.limit_in_bytes",
                  "memory.usage_in_bytes", "total_inactive_file")


def available_memory(root: str = "/") -> AvailableMemory | None:
    """The bytes a new allocation may take without swapping or meeting a cgroup's OOM killer:
    the least of MemAvailable and every cgroup limit's headroom; None where neither is known."""
    host = host_available(root)
    found = [] if host is None else [AvailableMemory(host)]
    found += cgroup_headrooms(root)
    return min(found, key=lambda a: a.nbytes) if found else None


def host_available(root: str = "/") -> int | None:
    """Bytes the host can give a new allocation without swapping (MemAvailable: free memory
    and the page cache it may drop); free pages where /proc/meminfo is missing (at the real
    root only); None where neither is known."""
    try:
        with open(os.path.join(root, "proc/meminfo")) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        pass
    if root != "/":
        return None
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def cgroup_headrooms(root: str = "/") -> list[AvailableMemory]:
    """The headroom under every memory limit set on this process's cgroups, v2 and v1."""
    out = []
    for ctl in (_V2, _V1):
        parts = [p for p in (_own_cgroup(root, ctl) or "").split("/") if p]
        for depth in range(len(parts), -1, -1):
            level = os.path.join(root, ctl.mount, *parts[:depth])
            headroom = _headroom(level, ctl)
            if headroom is not None:
                out.append(headroom)
    return out


def _own_cgroup(root: str, ctl: _Controller) -> str | None:
    """This process's path in the hierarchy (v2: "0::/a/b"; v1: "4:memory:/a/b", the
    controllers a comma list), or None where /proc/self/cgroup does not say."""
    try:
        with open(os.path.join(root, "proc/self/cgroup")) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        if (fields[0] == "0" and fields[1] == "") if not ctl.proc_field \
                else ctl.proc_field in fields[1].split(","):
            return fields[2]
    return None


def _headroom(level: str, ctl: _Controller) -> AvailableMemory | None:
    """One cgroup's limit less what it uses and may not drop; None where it sets no limit or
    its files are missing or unreadable."""
    limit = _read_int(os.path.join(level, ctl.limit))
    if limit is None or limit >= _V1_UNLIMITED:
        return None
    usage = _read_int(os.path.join(level, ctl.usage))
    if usage is None:
        return None
    usage -= min(usage, _stat(os.path.join(level, "memory.stat"), ctl.reclaimable))
    return AvailableMemory(max(0, limit - usage), os.path.join(level, ctl.limit), limit)


def _read_int(path: str) -> int | None:
    """A file's one integer; None for "max", a missing file, or one that does not parse."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat(path: str, key: str) -> int:
    """memory.stat's ``key``; 0 where it is missing."""
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key and value.strip().isdigit():
                    return int(value)
    except OSError:
        pass
    return 0
