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
compute 413-433 ms a prompt when borrowing held for whole steps, against 357 unshared). A
worker that goes idle bumps a second counter. An engine may lend its cores only a while after
its last step (``CoreShareConfig.lend_delay_s``, $PDSERVE_CORE_LEND_DELAY_MS): its OpenMP team
spins that long, and a borrower's team that shares a core with a spinning one stalls at every
barrier. With such a delay, a step that began meanwhile starts on its own share and takes the
lent cores at its next layer (without one, cores lent mid-step are left for the next step,
since their team still spins).

A worker holds a lock on its slot's bytes (an open file description's lock) for as long as it
has the file open: a slot is in use while someone holds its lock. The kernel drops the lock
when the process dies, before anyone reaps it, so a dead worker's slot is free and its threads
do not count, also while it is a zombie or once its pid is reused (where such locks are not
available, a slot's pid answering ``kill(pid, 0)`` stands in for it).

The file must be a regular file of this user's that only this user may write (checked on
opening): what it holds sizes this worker's threads, and a file someone else can write or
truncate could take the cores or kill the worker (a page of the mapping past the file's end is
SIGBUS). Slots naming a pid no process can have count as free. The file's size is checked again
before each access of a step; the owner truncating it between that check and the access is the
one case left that still ends in SIGBUS.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import stat
from dataclasses import dataclass

import numpy as np

from engine.ofd_locks import ofd_lock

logger = logging.getLogger(__name__)

MAX_SLOTS = 64
_SLOT_FIELDS = 2  # pid, threads in use (0: idle)
_SLOT_BYTES = _SLOT_FIELDS * 8
# The slots, then one row that counts wake-ups (a worker going idle -> busy) and lendings (busy
# -> idle).
_FILE_BYTES = (MAX_SLOTS + 1) * _SLOT_BYTES
# Linux hands out pids up to 2**22 (pid_max's ceiling): a slot naming another pid, or 0 or a
# negative one (kill(-n, 0) asks about a whole process group), no worker wrote.
_PID_MAX = 1 << 22
@dataclass(frozen=True)
class CoreShareConfig:
    # The shared file; workers naming the same path share cores.
    path: str
    # Cores the group shares (a busy worker alone takes them all).
    num_cores: int
    # This worker's own share: what it uses while others are busy too.
    base_threads: int
    # How long after its last step an engine lends its cores (engine/async_engine.py): 0 lends
    # at once. Its OpenMP team spins for a while after a step (5-10 ms on the 2-core VM), and a
    # borrower's team sharing a core with a spinning thread stalls at every barrier: lone short
    # steps took 3-4x as long (docs/benchmarks.md, session 47). Lending later keeps a borrower
    # that starts meanwhile on its own share until then, which costs a long prefill that starts
    # right after the other worker's step (cold TTFT ~15% at 10 ms), hence off by default.
    # With it, a step also grows into cores lent mid-step (all the group's workers should
    # share the setting: ``pdserve up`` passes its environment to each).
    lend_delay_s: float = 0.0

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
        d = self.lend_delay_s
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 <= d <= 1:
            raise ValueError(f"lend_delay_s must be in [0, 1] seconds, got {d!r}")


LEND_DELAY_ENV = "PDSERVE_CORE_LEND_DELAY_MS"


def lend_delay_from_env() -> float:
    """``CoreShareConfig.lend_delay_s`` from $PDSERVE_CORE_LEND_DELAY_MS (default 0)."""
    raw = os.environ.get(LEND_DELAY_ENV, "0")
    try:
        ms = float(raw)
    except ValueError:
        raise ValueError(f"{LEND_DELAY_ENV} must be a number of milliseconds, got {raw!r}") \
            from None
    if not 0 <= ms <= 1000:  # NaN fails this too
        raise ValueError(f"{LEND_DELAY_ENV} must be in [0, 1000] ms, got {raw!r}")
    return ms / 1e3


def _alive(pid: int) -> bool:
    """Without slot locks: whether a slot's pid names a live process (a zombie, or another
    process that got the pid again, answers too)."""
    if not 0 < pid <= _PID_MAX:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _slot_locks_work(fd: int) -> bool:
    """Whether this kernel and file system take open file description locks (Linux 3.15+):
    one taken and dropped again past the slots, where no worker locks."""
    if not hasattr(fcntl, "F_OFD_SETLK"):
        return False
    try:
        ofd_lock(fd, fcntl.F_OFD_SETLK, fcntl.F_RDLCK, _FILE_BYTES, 1)
        ofd_lock(fd, fcntl.F_OFD_SETLK, fcntl.F_UNLCK, _FILE_BYTES, 1)
    except OSError:
        return False
    return True


def _open_share_file(path: str) -> int:
    """The share file, opened read-write (created 0600 where it is not there); ValueError for
    one this worker must not trust: see the module's docstring."""
    try:
        # O_NOFOLLOW: a link planted where the file goes must not redirect the writes.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        why = "it is a symbolic link" if e.errno == errno.ELOOP else e.strerror
        raise ValueError(f"cannot open the core share file {path!r}: {why}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"the core share file {path!r} is not a regular file")
        if st.st_uid != os.geteuid():
            raise ValueError(f"the core share file {path!r} belongs to uid {st.st_uid}, not "
                             f"to this user (uid {os.geteuid()}): whoever writes it sizes "
                             "this worker's threads")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise ValueError(f"the core share file {path!r} may be written by others (mode "
                             f"{stat.S_IMODE(st.st_mode):o}): chmod go-w, or another path")
    except BaseException:
        os.close(fd)
        raise
    return fd


class CoreShare:
    """This process's slot in a core-share group (one per worker process)."""

    def __init__(self, config: CoreShareConfig) -> None:
        self.config = config
        self._fd = _open_share_file(config.path)
        self._mm: mmap.mmap | None = None
        try:
            self._locks = _slot_locks_work(self._fd)
            # Without slot locks, claims (a slot read, then written) take turns. With them,
            # taking a slot's lock is the claim, and the file's size only ever goes from 0 to
            # its whole size: nothing to wait for (on NFS a flock is a lock on every byte, and
            # would wait for every slot's owner to exit).
            if not self._locks:
                fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                self._map()
                self._index = self._claim()
            finally:
                if not self._locks:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)
        except BaseException:
            self._unmap()
            os.close(self._fd)
            raise
        self.threads = 0
        self._wakeups_seen = 0
        self._lendings_seen = 0

    def _map(self) -> None:
        size = os.fstat(self._fd).st_size
        if size == 0:  # new
            os.ftruncate(self._fd, _FILE_BYTES)
        elif size != _FILE_BYTES:
            raise ValueError(f"the core share file {self.config.path!r} has {size} bytes, "
                             f"not the {_FILE_BYTES} of a core share file: another file, or "
                             "one cut short")
        self._allocate()
        self._mm = mmap.mmap(self._fd, _FILE_BYTES)
        # [MAX_SLOTS + 1, 2] int64: aligned 8-byte stores, so readers see whole values.
        rows = np.frombuffer(self._mm, dtype=np.int64).reshape(MAX_SLOTS + 1, _SLOT_FIELDS)
        self._slots, self._wakeups = rows[:MAX_SLOTS], rows[MAX_SLOTS]

    def _allocate(self) -> None:
        """Gives the file its disk blocks now. Truncated to size, it is sparse: the first
        store through the mapping then needs a block, and on a full disk that is SIGBUS, not
        an error (also for every later worker on a file one left sparse). Allocating changes
        no byte, so a peer's slots stay as they are."""
        try:
            os.posix_fallocate(self._fd, 0, _FILE_BYTES)
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                return  # a filesystem that cannot allocate ahead: nothing to do better
            raise ValueError(f"cannot allocate the core share file {self.config.path!r}: "
                             f"{e.strerror}") from None

    def _unmap(self) -> None:
        if self._mm is None:
            return
        self.__dict__.pop("_slots", None)  # views of the mapping: it cannot close under them
        self.__dict__.pop("_wakeups", None)
        self._mm.close()
        self._mm = None

    def _claim(self) -> int:
        me = os.getpid()
        for i in range(MAX_SLOTS):
            if self._locks:  # free: nobody holds its lock; taking it is the claim
                free = self._lock_slot(i)
            else:
                pid = int(self._slots[i, 0])
                free = pid == 0 or pid == me or not _alive(pid)
            if free:
                self._slots[i, 1] = 0
                self._slots[i, 0] = me
                return i
        raise RuntimeError(f"the core share {self.config.path!r} has no free slot "
                           f"({MAX_SLOTS} live processes)")

    def _lock_slot(self, i: int) -> bool:
        """Takes slot ``i``'s lock, held until the file is closed; False when someone holds
        it."""
        try:
            ofd_lock(self._fd, fcntl.F_OFD_SETLK, fcntl.F_WRLCK, i * _SLOT_BYTES, _SLOT_BYTES)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES):
                return False
            raise
        return True

    def _in_use(self, i: int, pid: int) -> bool:
        """Whether slot ``i``'s owner still lives: it holds the slot's lock (one of another
        open file: ours would not conflict, and ``i`` is never ours here)."""
        if not self._locks:
            return _alive(pid)
        return ofd_lock(self._fd, fcntl.F_OFD_GETLK, fcntl.F_WRLCK, i * _SLOT_BYTES,
                          _SLOT_BYTES) != fcntl.F_UNLCK

    def _whole(self) -> bool:
        """Whether the mapping may still be read: a page past the file's end is SIGBUS. A
        file cut short leaves the share: this worker then steps on its own share."""
        if self._mm is None:
            return False
        size = os.fstat(self._fd).st_size
        if size >= _FILE_BYTES:
            return True
        logger.error("the core share file %r was cut to %d bytes under this worker: it leaves "
                     "the share and steps on its own %d threads from now on", self.config.path,
                     size, self.config.base_threads)
        self._unmap()
        return False

    def others_busy_threads(self) -> int:
        """Threads the group's other live processes are using now."""
        if self._mm is None:
            return 0
        cores = self.config.num_cores
        busy = np.flatnonzero(self._slots[:, 1] > 0)
        total = 0
        for i in busy:
            if i == self._index:
                continue
            pid, threads = (int(v) for v in self._slots[i])
            # A pid no process can have, no worker wrote: free. More threads than this
            # worker's cores is a peer that counts more cores (another --core-share-cores, or
            # another affinity): it still holds every core this one would count.
            if 0 < pid <= _PID_MAX and self._in_use(i, pid):
                total += min(threads, cores)
        return total

    def _allowed(self) -> int:
        free = self.config.num_cores - self.others_busy_threads()
        return max(self.config.base_threads, min(free, self.config.num_cores))

    def threads_for_step(self) -> int:
        """Claims threads for the next step and returns how many: every core nobody else
        uses, but never fewer than this worker's own share."""
        if not self._whole():
            self.threads = self.config.base_threads
            return self.threads
        # The count as it was before the others' slots are read: a worker that wakes after
        # that read (its slot not seen) bumps it after, so this one's recheck sees the change
        # and gives back what it took from it. Read after this worker's own bump instead, a
        # bump in between would be taken as seen already.
        seen = int(self._wakeups[0])
        self._lendings_seen = int(self._wakeups[1])  # likewise: a lending after the read counts
        woke = not self.threads
        self.threads = self._allowed()
        self._slots[self._index, 1] = self.threads
        if woke:  # after the slot, so a worker that sees the count change also sees the slot
            # Racing increments may lose one, but the value still changes: enough to notice.
            self._wakeups[0] += 1
        self._wakeups_seen = seen
        return self.threads

    def recheck(self) -> int | None:
        """Mid-step: the thread count to go on with when another worker woke up since this
        step was sized and wants cores this one borrowed (fewer), or one went idle and lent
        its cores (more); None to carry on as is. One shared read when nobody woke up or went
        idle, so it can run between layers."""
        if not self.threads:  # idle: no step to resize
            return None
        if not self._whole():
            if self.threads <= self.config.base_threads:
                return None
            self.threads = self.config.base_threads
            return self.threads
        woke = self._wakeups[0] != self._wakeups_seen and self.threads > self.config.base_threads
        # Growing is safe only into cores lent late: lent at once, their team still spins.
        lent = (self.config.lend_delay_s > 0 and self._wakeups[1] != self._lendings_seen
                and self.threads < self.config.num_cores)
        if not (woke or lent):
            return None
        self._wakeups_seen = int(self._wakeups[0])
        self._lendings_seen = int(self._wakeups[1])
        allowed = self._allowed()
        if allowed == self.threads or (allowed > self.threads and not lent):
            return None
        self.threads = allowed
        self._slots[self._index, 1] = allowed
        return allowed

    def idle(self) -> None:
        """Nothing to compute: the cores are the others' to borrow (their steps under way take
        them between layers where the group lends late: ``recheck``)."""
        if self.threads:
            self.threads = 0
            if self._whole():
                self._slots[self._index, 1] = 0
                self._wakeups[1] += 1  # after the slot, as for wake-ups
                self._lendings_seen = int(self._wakeups[1])  # its own lending is no news

    def close(self) -> None:
        if self._fd < 0:
            return
        if self._whole():
            self._slots[self._index] = 0
        self._unmap()
        os.close(self._fd)  # drops the slot's lock
        self._fd = -1
