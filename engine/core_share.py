"""CPU cores shared by co-located workers: a busy worker borrows the cores of idle ones.

``pdserve up`` on one host gives each worker rank its share of the cores (OMP_NUM_THREADS), so
that workers busy at the same time never oversubscribe them. But a prefill worker is idle
while its prompts decode, and a decode worker is idle while the next prompt prefills (at low
load, most of the time): each then leaves its cores unused while the other computes on a
share. With a core share, every worker of a group records in a small shared file how many
threads its current step uses (0 when idle), and sizes its next step from what the others
hold: all the group's cores when the others are idle, its own share when they are busy.

A worker that wakes up bumps a shared counter; a worker running on borrowed cores checks it
between decoder layers (``recheck``) and gives the cores back at once, so a long prefill step
does not keep two cores while the decode worker needs one (measured at concurrency 8: prefill
compute 413-433 ms a prompt when borrowing held for whole steps, against 357 unshared). Slots
are claimed by pid; the slot of a process that died is reclaimed, and a dead process's threads
are not counted.
"""
from __future__ import annotations

import fcntl
import mmap
import os
from dataclasses import dataclass

import numpy as np

MAX_SLOTS = 64
_SLOT_FIELDS = 2  # pid, threads in use (0: idle)
# The slots, then one row whose first field counts wake-ups (a worker going idle -> busy).
_FILE_BYTES = (MAX_SLOTS + 1) * _SLOT_FIELDS * 8


@dataclass(frozen=True)
class CoreShareConfig:
    # The shared file; workers naming the same path share cores.
    path: str
    # Cores the group shares (a busy worker alone takes them all).
    num_cores: int
    # This worker's own share: what it uses while others are busy too.
    base_threads: int

    def __post_init__(self) -> None:
        if not self.path or "\0" in self.path:
            raise ValueError(f"core share path must be a file path, got {self.path!r}")
        for name in ("num_cores", "base_threads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.base_threads > self.num_cores:
            raise ValueError(f"base_threads ({self.base_threads}) exceeds the group's "
                             f"{self.num_cores} cores")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


class CoreShare:
    """This process's slot in a core-share group (one per worker process)."""

    def __init__(self, config: CoreShareConfig) -> None:
        self.config = config
        try:
            self._fd = os.open(config.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise ValueError(f"cannot open the core share file {config.path!r}: "
                             f"{e.strerror}") from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                if os.fstat(self._fd).st_size < _FILE_BYTES:
                    os.ftruncate(self._fd, _FILE_BYTES)
                self._mm = mmap.mmap(self._fd, _FILE_BYTES)
                # [MAX_SLOTS, 2] int64: aligned 8-byte stores, so readers see whole values.
                rows = np.frombuffer(self._mm, dtype=np.int64).reshape(
                    MAX_SLOTS + 1, _SLOT_FIELDS)
                self._slots, self._wakeups = rows[:MAX_SLOTS], rows[MAX_SLOTS]
                self._index = self._claim()
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        except BaseException:
            os.close(self._fd)
            raise
        self.threads = 0
        self._wakeups_seen = 0

    def _claim(self) -> int:
        me = os.getpid()
        for i in range(MAX_SLOTS):
            pid = int(self._slots[i, 0])
            if pid == 0 or pid == me or not _alive(pid):
                self._slots[i, 1] = 0
                self._slots[i, 0] = me
                return i
        raise RuntimeError(f"the core share {self.config.path!r} has no free slot "
                           f"({MAX_SLOTS} live processes)")

    def others_busy_threads(self) -> int:
        """Threads the group's other live processes are using now."""
        busy = np.flatnonzero(self._slots[:, 1] > 0)
        total = 0
        for i in busy:
            if i == self._index:
                continue
            pid, threads = (int(v) for v in self._slots[i])
            if pid and _alive(pid):
                total += threads
        return total

    def _allowed(self) -> int:
        free = self.config.num_cores - self.others_busy_threads()
        return max(self.config.base_threads, min(free, self.config.num_cores))

    def threads_for_step(self) -> int:
        """Claims threads for the next step and returns how many: every core nobody else
        uses, but never fewer than this worker's own share."""
        woke = not self.threads
        self.threads = self._allowed()
        self._slots[self._index, 1] = self.threads
        if woke:  # after the slot, so a worker that sees the count change also sees the slot
            # Racing increments may lose one, but the value still changes: enough to notice.
            self._wakeups[0] += 1
        self._wakeups_seen = int(self._wakeups[0])
        return self.threads

    def recheck(self) -> int | None:
        """Mid-step: the fewer threads to drop to when another worker woke up since this
        step was sized and wants cores this one borrowed; None to carry on as is. One shared
        read when nobody woke up, so it can run between layers."""
        if self.threads <= self.config.base_threads or self._wakeups[0] == self._wakeups_seen:
            return None
        self._wakeups_seen = int(self._wakeups[0])
        allowed = self._allowed()
        if allowed >= self.threads:
            return None
        self.threads = allowed
        self._slots[self._index, 1] = allowed
        return allowed

    def idle(self) -> None:
        """Nothing to compute: the cores are the others' to borrow."""
        if self.threads:
            self.threads = 0
            self._slots[self._index, 1] = 0

    def close(self) -> None:
        if self._fd < 0:
            return
        self._slots[self._index] = 0
        del self._slots, self._wakeups
        self._mm.close()
        os.close(self._fd)
        self._fd = -1
