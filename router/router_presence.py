"""A router's presence in Redis: its id, a heartbeat, and the leases its predecessor left.

Every Prefill call names the router and this process's incarnation (a random id drawn at
start), and the prefill worker records both with the lease in the transfer ledger
(router/ledger.py). A router that dies mid-request leaves leases nobody releases: each holds
its prompt's blocks until it expires (``--kv-lease-timeout-s``, 60 s by default). A router
restarted under the same id finds them in the ledger and releases them at once, but only when
its predecessor is surely gone: it ran on this host, and its pid is dead or is this process's
(a restarted container's router has the same pid). A router that merely lost Redis may still
have decode workers pulling those blocks, and releasing them then would hand a live request
blocks that are being reused.

Starting under an id whose heartbeat is fresh waits for it to go stale (a predecessor that
just died elsewhere; one surely gone is not waited for), and refuses when it stays fresh: two
live routers with one id.
"""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass

import grpc

from client.tasks import stop_task
from protos import worker_pb2
from router.ledger import TransferLedger

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
# A router whose heartbeat is older than this is taken as gone.
TTL_S = 3.0
_RELEASE_TIMEOUT_S = 5.0
_STOP_S = 2.0


@dataclass(frozen=True)
class Incarnation:
    """One router process: ``token`` is random; host and pid tell whether it still runs."""

    token: str
    host: str
    pid: int

    def encode(self) -> str:
        return f"{self.token} {self.pid} {self.host}"

    @classmethod
    def decode(cls, s: str) -> Incarnation:
        token, pid, host = (s.split(" ", 2) + ["", ""])[:3]
        return cls(token, host, int(pid) if pid.isdigit() else 0)

    @classmethod
    def this_process(cls) -> Incarnation:
        return cls(secrets.token_hex(8), socket.gethostname(), os.getpid())

    def surely_gone(self) -> bool:
        """True only when this incarnation cannot be running (seen from this process)."""
        if self.host != socket.gethostname() or self.pid <= 0:
            return False
        if self.pid == os.getpid():
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False


def default_router_id(port: int) -> str:
    """``router-HOST-PORT``: a router restarted on its port takes its predecessor's id. With
    port 0 (chosen at bind), the pid stands in, so such a router keeps no id across restarts."""
    return f"router-{socket.gethostname()}-{port if port else os.getpid()}"


class RouterPresence:
    def __init__(self, ledger: TransferLedger, router_id: str) -> None:
        self.ledger = ledger
        self.router_id = router_id
        self.me = Incarnation.this_process()
        self.incarnation = self.me.encode()
        self._task: asyncio.Task | None = None
        self._stopping = False

    async def claim(self) -> None:
        """Waits for a predecessor's heartbeat under this id to go stale; ValueError if it
        stays fresh (another live router has this id). Redis unreachable: logged, not fatal
        (the heartbeat loop keeps trying)."""
        deadline = time.monotonic() + TTL_S + HEARTBEAT_S
        while True:
            try:
                held = await self.ledger.router_heartbeat(self.router_id)
            except Exception as e:  # noqa: BLE001 - redis-py's errors, OSError, timeouts
                logger.warning("router %s: cannot check its id in Redis: %s", self.router_id, e)
                return
            if held is None or time.time() - held[1] > TTL_S \
                    or Incarnation.decode(held[0]).surely_gone():
                break
            if time.monotonic() > deadline:
                raise ValueError(f"router id {self.router_id!r} is in use by a live router "
                                 f"({Incarnation.decode(held[0]).host}, heartbeat "
                                 f"{time.time() - held[1]:.1f} s ago): give each router its "
                                 f"own --router-id")
            await asyncio.sleep(0.25)
        await self._beat_once()

    def start(self) -> None:
        self._task = asyncio.create_task(self._beat_loop())

    async def _beat_once(self) -> bool:
        try:
            await self.ledger.router_beat(self.router_id, self.incarnation)
            return True
        except Exception as e:  # noqa: BLE001 - Redis away: retried next beat
            logger.warning("router %s: heartbeat failed: %s", self.router_id, e)
            return False

    async def _beat_loop(self) -> None:
        while not self._stopping:
            await asyncio.sleep(HEARTBEAT_S)
            await self._beat_once()

    async def reclaim(self, prefill_stub_of) -> int:
        """Releases the leases this id's earlier incarnations left, where they are surely
        gone; returns how many. ``prefill_stub_of(worker_id)``: the live prefill worker's
        stub, or None (a worker that is gone took its leases with it)."""
        try:
            entries, _ = await self.ledger.entries(limit=1 << 20)
        except Exception as e:  # noqa: BLE001
            logger.warning("router %s: cannot read the transfer ledger: %s", self.router_id, e)
            return 0
        left = [e for e in entries
                if e.router_id == self.router_id and e.router_incarnation != self.incarnation]
        mine = [e for e in left if Incarnation.decode(e.router_incarnation).surely_gone()]
        if len(mine) < len(left):
            logger.info("router %s: %d leases of an earlier incarnation that may still run "
                        "elsewhere are left to expire", self.router_id, len(left) - len(mine))
        released = 0
        for e in mine:
            stub = prefill_stub_of(e.prefill_worker_id)
            if stub is None:
                continue
            try:
                resp = await stub.ReleaseKV(worker_pb2.ReleaseKVRequest(request_id=e.request_id),
                                            timeout=_RELEASE_TIMEOUT_S)
            except grpc.aio.AioRpcError as err:
                logger.warning("router %s: releasing %s on %s failed: %s", self.router_id,
                               e.request_id, e.prefill_worker_id, err.code().name)
                continue
            released += resp.released
        if mine:
            logger.info("router %s: released %d of %d KV leases its previous incarnation left",
                        self.router_id, released, len(mine))
        return released

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            await stop_task(self._task, _STOP_S)
        try:
            async with asyncio.timeout(_STOP_S):
                await self.ledger.router_leave(self.router_id, self.incarnation)
        except Exception as e:  # noqa: BLE001 - stopping anyway; the heartbeat goes stale
            logger.warning("router %s: leaving Redis failed: %r", self.router_id, e)
