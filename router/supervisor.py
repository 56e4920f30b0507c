"""``pdserve up``'s supervision: a service that crashes is started again.

Requests running on a worker that crashes move to the others (router/migration.py); the
supervisor brings the cluster's capacity back. A worker is started again on a new port, under
a new name, and registers like any new worker; the router on its own port; the bundled Redis
on its own port (the workers then republish what they keep there). A worker that exits cleanly
(0: it was told to stop and drained) was scaled down and stays down. When a role crashes more
than ``max_restarts`` times within ``RESTART_WINDOW_S``, or a service cannot be started again,
the supervisor gives up and ``pdserve up`` stops everything, as without supervision.
"""
from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from router.launcher import Cluster, Proc
from router.redis_server import RedisServer

RESTART_WINDOW_S = 600.0


@dataclass
class Supervisor:
    cluster: Cluster
    # Crashes tolerated per role ("router", "prefill", "decode", "redis") within the window;
    # 0: the first crash stops the cluster.
    max_restarts: int = 5
    say: Callable[[str], None] = print
    _crashes: dict[str, collections.deque] = field(
        default_factory=lambda: collections.defaultdict(collections.deque))

    def __post_init__(self) -> None:
        if not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(f"max_restarts must be an integer >= 0, got {self.max_restarts!r}")

    def check(self) -> int | None:
        """Starts again what crashed since the last check; an exit code once the cluster
        cannot go on, else None."""
        redis = self.cluster.redis
        if redis is not None and redis.proc.poll() is not None:
            if not self._may_restart("redis", f"redis-server exited with {redis.proc.returncode}"):
                return 1
            self.cluster.redis = RedisServer(port=redis.port, host=redis.host,
                                             exit_with_parent=True)
            self.say(f"pdserve up: redis-server serving again on {redis.host}:{redis.port}")
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
            if not self._may_restart(proc.role, f"{proc.name} exited with {code}"):
                return 1
            if not self._respawn(proc):
                return 1
        return None

    def _may_restart(self, role: str, what: str) -> bool:
        now = time.monotonic()
        crashes = self._crashes[role]
        while crashes and now - crashes[0] > RESTART_WINDOW_S:
            crashes.popleft()
        crashes.append(now)
        if len(crashes) > self.max_restarts:
            self.say(f"pdserve up: {what}; {len(crashes)} {role} crashes within "
                     f"{RESTART_WINDOW_S:.0f} s (--max-restarts {self.max_restarts}); stopping")
            return False
        self.say(f"pdserve up: {what}; starting it again ({len(crashes)} of "
                 f"{self.max_restarts} within {RESTART_WINDOW_S:.0f} s)")
        return True

    def _respawn(self, proc: Proc) -> bool:
        try:
            new = self.cluster.respawn(proc)
        except RuntimeError as e:
            self.say(f"pdserve up: {proc.role} could not be started again ({e}); stopping")
            return False
        self.say(f"pdserve up: {new.name} serving on {new.address}")
        return True
