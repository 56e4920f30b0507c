"""``pdserve up``'s supervision: a service that crashes is started again.

Requests running on a worker that crashes move to the others (router/migration.py); the
supervisor brings the cluster's capacity back. A worker is started again on a new port, under
a new name, and registers like any new worker; the router on its own port; the bundled Redis
on its own port (the workers then republish what they keep there). A worker that exits cleanly
(0: it was told to stop, and drained or had not served yet) was scaled down and stays down.
When a role crashes more than ``max_restarts`` times within ``RESTART_WINDOW_S`` (the user's
budget; 0: fail fast), the supervisor gives up and ``pdserve up`` stops everything, as without
supervision. A service whose new process exits while starting (its model folder unreadable for
a moment, Redis refusing it) is started again after a wait that doubles each time (2 s, 4 s, ...
at most 60 s; other services are looked after meanwhile), each failed start counting as one
more crash of its role: it was given up at its first failed start, with restarts left. A worker
that cannot be started again (its role's budget spent on such starts, as one whose
configuration is refused, exiting 2 at every start, spends it; it is healthy but refused by
the router, as serving another model than the router's, or not listed by it within 30 s; it
is not healthy within --start-timeout) is lost, said loudly with why its first process exited
and why the last new one failed (their last stderr lines): the cluster
serves on without it while it still has a worker of each role it was started with, the
router and Redis (what every request needs; its other workers' requests are not cut, and
the user decides when to stop it); it stops once it has none left of a role, or when the
router or Redis cannot be started again. A worker that crashes again before the router lists
it counts one more crash of its role at the next check; one started while the registry
(Redis) is unreachable is taken as serving (it registers once Redis is back, as any worker
does), and said so.

Where the launcher is PID 1 (``docker run <image> up`` without --init), the processes its
services leave when they crash (an engine process, TP ranks) are re-parented to it: the
supervisor reaps them, or they would stay zombies for the cluster's life.
"""
from __future__ import annotations

import collections
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from router.launcher import Cluster, Proc, StartAborted, StartExited
from router.redis_server import RedisServer

RESTART_WINDOW_S = 600.0
# The wait before a service whose new process exited while starting is started again,
# doubled at each such exit, up to the most.
RETRY_BACKOFF_S = 2.0
RETRY_BACKOFF_MAX_S = 60.0
# Enough for any wait > 0 to reach the most (2**64 times 1e-18 s is 18 s).
_MAX_DOUBLINGS = 64


@dataclass
class PendingStart:
    """A service to start again once ``due`` (time.monotonic()): its new process exited while
    starting."""
    proc: Proc  # the process that crashed: how to start it, and its name in messages
    what: str  # how that one exited
    due: float
    failed_starts: int


@dataclass
class Supervisor:
    cluster: Cluster
    # Crashes tolerated per role ("router", "prefill", "decode", "redis") within the window;
    # 0: the first crash stops the cluster.
    max_restarts: int = 5
    say: Callable[[str], None] = print
    # True once a stop is asked (pdserve up's SIGTERM, Ctrl-C): a restart waiting for its
    # service to become healthy gives up then, rather than after --start-timeout.
    should_stop: Callable[[], bool] = lambda: False
    # Reap the zombies that are not the cluster's own children: orphans re-parented to this
    # process, which happens where it is PID 1 (a container's init).
    reap_orphans: bool = field(default_factory=lambda: os.getpid() == 1)
    _crashes: dict[str, collections.deque] = field(
        default_factory=lambda: collections.defaultdict(collections.deque))
    # The workers given up on, each with why: the cluster serves on without them.
    lost: list[str] = field(default_factory=list)
    # The first wait before a start that exited is tried again (RETRY_BACKOFF_S).
    retry_backoff_s: float = RETRY_BACKOFF_S
    # The services waiting to be started again, each until its due time.
    pending: list[PendingStart] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(f"max_restarts must be an integer >= 0, got {self.max_restarts!r}")
        if not self.retry_backoff_s >= 0:
            raise ValueError(f"retry_backoff_s must be >= 0, got {self.retry_backoff_s!r}")

    def check(self) -> int | None:
        """Starts again what crashed since the last check; an exit code once the cluster
        cannot go on, else None (also when a restart was given up for a stop asked
        meanwhile: the caller's loop stops)."""
        # A start that fails in this check is tried again at a later one, however short its
        # wait: a check returns once what crashed was dealt with.
        now = time.monotonic()
        if self.reap_orphans:
            reap_zombies(keep=self._own_pids())
        redis = self.cluster.redis
        if redis is not None and redis.proc.poll() is not None:
            if not self._may_restart("redis", f"redis-server exited with {redis.proc.returncode}"):
                return 1
            if not self._restart_redis(redis):
                return 1
        for proc in list(self.cluster.procs):
            code = proc.popen.poll()
            if code is None:
                continue
            if code == 0:
                if proc.role == "router":
                    self.say("pdserve up: the router stopped; stopping")
                    return 0
                self.say(f"pdserve up: {proc.name} stopped cleanly (scaled down); "
                         "not started again")
                self.cluster.stop_proc(proc)
                continue
            # Its last stderr lines (a refused configuration's "pdserve: error: ..."), once
            # its engine process or TP ranks, which share its stderr, are gone too.
            what = f"{proc.name} exited with {code}{proc.last_words(wait_s=1.0)}"
            if not self._may_restart(proc.role, what):
                return 1
            code = self._respawn(proc, what)
            if code is not None or self.should_stop():  # stopping: start no more
                return code
        for start in [s for s in self.pending if s.due <= now]:
            self.pending.remove(start)
            code = self._respawn(start.proc, start.what, start.failed_starts)
            if code is not None or self.should_stop():
                return code
        return None

    def _own_pids(self) -> set[int]:
        """The cluster's own children, which their Popen objects wait for."""
        pids = {proc.popen.pid for proc in self.cluster.procs}
        if self.cluster.redis is not None:
            pids.add(self.cluster.redis.proc.pid)
        return pids

    def _restart_redis(self, redis: RedisServer) -> bool:
        try:
            self.cluster.redis = RedisServer(port=redis.port, host=redis.host,
                                             exit_with_parent=True)
        except (RuntimeError, OSError) as e:  # its port taken meanwhile, it never answered
            self.say(f"pdserve up: redis-server could not be started again ({e}); stopping")
            return False
        self.say(f"pdserve up: redis-server serving again on {redis.host}:{redis.port}")
        return True

    def _count_crash(self, role: str) -> int:
        """One more crash of ``role``: how many within the window."""
        now = time.monotonic()
        crashes = self._crashes[role]
        while crashes and now - crashes[0] > RESTART_WINDOW_S:
            crashes.popleft()
        crashes.append(now)
        return len(crashes)

    def _may_restart(self, role: str, what: str) -> bool:
        n = self._count_crash(role)
        if n > self.max_restarts:
            self.say(f"pdserve up: {what}; {n} {role} crashes within "
                     f"{RESTART_WINDOW_S:.0f} s (--max-restarts {self.max_restarts}); stopping")
            return False
        self.say(f"pdserve up: {what}; starting it again ({n} of "
                 f"{self.max_restarts} within {RESTART_WINDOW_S:.0f} s)")
        return True

    def _start_failed(self, proc: Proc, what: str, failed_starts: int,
                      e: StartExited) -> int | None:
        """``proc``'s new process exited while starting (``e``): started again later while
        its role's budget lasts, else lost."""
        why = f"{proc.role} could not be started again ({e}) after {what}"
        n = self._count_crash(proc.role)
        if n > self.max_restarts:
            return self._lost(proc, f"{why}; {n} {proc.role} crashes within "
                                    f"{RESTART_WINDOW_S:.0f} s (--max-restarts "
                                    f"{self.max_restarts})")
        # The doubling bounded too: past 2**1023 it is no float (a start refused at every try,
        # under a budget the longest waits never spend, gets there in 17 hours).
        doublings = min(failed_starts - 1, _MAX_DOUBLINGS)
        wait_s = min(self.retry_backoff_s * 2 ** doublings, RETRY_BACKOFF_MAX_S)
        self.pending.append(PendingStart(proc, what, time.monotonic() + wait_s, failed_starts))
        self.say(f"pdserve up: {why}; starting it again in {wait_s:.0f} s ({n} of "
                 f"{self.max_restarts} within {RESTART_WINDOW_S:.0f} s)")
        return None

    def _respawn(self, proc: Proc, what: str, failed_starts: int = 0) -> int | None:
        """None once ``proc`` serves again (or crashed again: the next check counts it), once
        its start was given up for a stop, once it waits to be started again, or once it is
        lost and the cluster serves on without it; 1 when it cannot be started again and the
        cluster cannot serve without it. ``what``: how it exited, for the message;
        ``failed_starts``: its new processes that exited while starting so far."""
        unconfirmed = None
        try:
            new = self.cluster.respawn(proc, should_abort=self.should_stop)
            if new.role != "router":  # healthy is not enough: the router must take it
                try:
                    unconfirmed = self.cluster.wait_listed(new, should_abort=self.should_stop)
                except RuntimeError:
                    # Serving, but sent nothing: it would hold its GPU for no request.
                    self.cluster.stop_proc(new)
                    raise
        except StartAborted:
            self.say(f"pdserve up: a stop was asked while {proc.role} started again; "
                     "not waiting for it")
            return None
        except StartExited as e:
            return self._start_failed(proc, what, failed_starts + 1, e)
        except (RuntimeError, OSError) as e:  # OSError: the process could not even start
            return self._lost(proc, f"{proc.role} could not be started again ({e}) after "
                                    f"{what}")
        if new.popen.poll() is not None:  # crashed again: the next check counts it
            self.say(f"pdserve up: {unconfirmed} before the router listed it")
            return None
        note = f" (the router could not say if it lists it: {unconfirmed})" if unconfirmed else ""
        self.say(f"pdserve up: {new.name} serving on {new.address}{note}")
        return None

    def _lost(self, proc: Proc, why: str) -> int | None:
        """``proc`` cannot be started again (``why``): 1 when the cluster cannot serve
        without it (the router, or the last worker of its role), else None, said loudly."""
        left = {role: sum(p.role == role for p in self.cluster.procs)
                for role in ("prefill", "decode")}
        if not left.get(proc.role):  # the router, Redis, or the last worker of its role
            what = ("nothing serves without the router" if proc.role == "router"
                    else f"no {proc.role} worker left")
            self.say(f"pdserve up: {why}; stopping: {what}")
            return 1
        self.lost.append(f"{proc.name}: {why}")
        counts = ", ".join(f"{n} {role}" for role, n in left.items())
        self.say(f"pdserve up: DEGRADED: {why}; serving on without it ({counts} workers "
                 f"left; {len(self.lost)} lost since the start)")
        return None


def reap_zombies(keep: set[int]) -> list[int]:
    """Reaps this process's zombie children but those in ``keep`` (whose Popen objects must
    see their exit status: one reaped here would look like a clean exit, 0, to them); the
    pids reaped. ``waitpid(-1)`` cannot leave some children out, so the zombies are found in
    /proc."""
    reaped = []
    for pid in _zombie_children():
        if pid in keep:
            continue
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                reaped.append(pid)
        except ChildProcessError:  # reaped meanwhile (a Popen's own wait)
            pass
    return reaped


def _zombie_children() -> list[int]:
    me = os.getpid()
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        fields = stat.rpartition(")")[2].split()
        if len(fields) >= 2 and fields[0] == "Z" and fields[1] == str(me):
            found.append(int(entry))
    return found
