"""A router's presence in Redis: its id, a heartbeat, and the leases its predecessor left.

Every Prefill call names the router and this process's incarnation (a random id drawn at
start), and the prefill worker records both with the lease in the transfer ledger
(router/ledger.py). A router that dies mid-request leaves leases nobody releases: each holds
its prompt's blocks until it expires (``--kv-lease-timeout-s``, 60 s by default). A router
restarted under the same id finds them in the ledger and releases at once those nobody is
pulling, but only when its predecessor is surely gone: it ran in this process's pid namespace
(same kernel boot, same namespace) and its pid is dead or is this process's. A hostname
proves nothing (containers may share one, each with its own pid 1), and a router that merely
lost Redis may still have decode workers about to pull those blocks: releasing them then
would hand a live request blocks that are being reused. Leases not proven orphaned expire.

The heartbeat is a key in Redis that expires ``TTL_S`` after its last beat, so liveness is
judged on Redis's clock alone. Starting under an id whose key is held waits for it to expire
(a predecessor that just died elsewhere; one surely gone is not waited for), and refuses when
it stays held: two live routers with one id.
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
from router.ledger import MAX_LIST_LIMIT, TransferLedger

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
# A router that has not beaten for this long is taken as gone (Redis expires its key).
TTL_S = 3.0
_RELEASE_TIMEOUT_S = 5.0
_STOP_S = 2.0


def check_router_id(value) -> str:
    """A router id: at most 128 printable characters without spaces ("" for the default)."""
    return _check_name("router_id", value, 128, spaces=False)


def check_worker_id(value) -> str:
    """A worker id as --worker-id gives it: as a router id ("" for the default; "{port}" is
    filled in once the port is bound)."""
    return _check_name("worker_id", value, 128, spaces=False)


def check_served_model_name(value) -> str:
    """A --served-model-name: what workers register their model as and a router matches
    them by ("" for the default, the --model's folder name)."""
    return _check_name("served_model_name", value, 256, spaces=False)


def check_incarnation(value) -> str:
    """An incarnation as a Prefill call names it: at most 256 printable characters."""
    return _check_name("router_incarnation", value, 256, spaces=True)


def _check_name(name: str, value, max_chars: int, spaces: bool) -> str:
    # They reach logs, tables and Redis keys: nothing that could break a line or a key.
    if not isinstance(value, str) or len(value) > max_chars or not value.isprintable() or (
            not spaces and any(c.isspace() for c in value)):
        shown = f"{value[:40]!r}{'...' if len(value) > 40 else ''}" \
            if isinstance(value, str) else repr(value)
        raise ValueError(f"{name} must be at most {max_chars} printable characters"
                         f"{'' if spaces else ' without spaces'}, got {shown}")
    return value


def pid_namespace() -> str:
    """This process's pid namespace, as ``BOOT_ID/NS_INODE`` ("" where /proc does not tell).
    Two namespaces that exist at once never share an inode; one that ended may pass its
    inode on, but then every process in it has ended too."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}" if boot else ""
    except OSError:
        return ""


@dataclass(frozen=True)
class Incarnation:
    """One router process: ``token`` is random; pid namespace and pid tell whether it still
    runs; ``host`` is for people reading the ledger."""

    token: str
    host: str
    pid: int
    pidns: str = ""

    def encode(self) -> str:
        return f"{self.token} {self.pid} {self.pidns or '-'} {self.host}"

    @classmethod
    def decode(cls, s: str) -> Incarnation:
        token, pid, pidns, host = (s.split(" ", 3) + ["", "", ""])[:4]
        return cls(token, host, int(pid) if pid.isdigit() else 0,
                   "" if pidns == "-" else pidns)

    @classmethod
    def this_process(cls) -> Incarnation:
        # The host is shortened: the incarnation rides in every Prefill call.
        return cls(secrets.token_hex(8), socket.gethostname()[:64], os.getpid(), pid_namespace())

    def surely_gone(self) -> bool:
        """True only when this incarnation cannot be running (seen from this process)."""
        if not self.pidns or self.pidns != pid_namespace() or self.pid <= 0:
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


def default_router_id(host: str, port: int) -> str:
    """``router-HOSTNAME-PORT``, with the bind address before the port unless it is a
    wildcard (two routers may share a port on two addresses): a router restarted on its
    address and port takes its predecessor's id. With port 0 (chosen at bind), the pid stands
    in, so such a router keeps no id across restarts."""
    where = "" if host in _WILDCARDS else f"{host}-"
    return f"router-{socket.gethostname()}-{where}{port if port else os.getpid()}"


_WILDCARDS = ("", "0.0.0.0", "::", "[::]")


class RouterPresence:
    def __init__(self, ledger: TransferLedger, router_id: str) -> None:
        self.ledger = ledger
        self.router_id = router_id
        self.me = Incarnation.this_process()
        self.incarnation = self.me.encode()
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._displaced = False  # another incarnation holds our id (see _beat_once)

    async def claim(self) -> None:
        """Waits for a predecessor's heartbeat under this id to expire; ValueError if it
        stays (another live router has this id). Redis unreachable: logged, not fatal (the
        heartbeat loop keeps trying)."""
        deadline = time.monotonic() + TTL_S + HEARTBEAT_S
        while True:
            try:
                held = await self.ledger.router_holder(self.router_id)
                gone = held is not None and Incarnation.decode(held).surely_gone()
                if (held is None or gone) and await self.ledger.router_claim(
                        self.router_id, self.incarnation, TTL_S, held if gone else ""):
                    return
            except Exception as e:  # noqa: BLE001 - redis-py's errors, OSError, timeouts
                logger.warning("router %s: cannot check its id in Redis: %s", self.router_id, e)
                return
            if time.monotonic() > deadline and held is not None:
                raise ValueError(f"router id {self.router_id!r} is in use by a live router "
                                 f"(on {Incarnation.decode(held).host or 'an unknown host'}): "
                                 f"give each router its own --router-id")
            await asyncio.sleep(0.25)

    def start(self) -> None:
        self._task = asyncio.create_task(self._beat_loop())

    async def _beat_once(self) -> bool:
        try:
            held = await self.ledger.router_claim(self.router_id, self.incarnation, TTL_S)
        except Exception as e:  # noqa: BLE001 - Redis away: retried next beat
            logger.warning("router %s: heartbeat failed: %s", self.router_id, e)
            return False
        if not held and not self._displaced:
            # Our key expired (Redis was out of reach for a TTL) and another router took the
            # id: both now serve under it. Its leases and ours stay apart by incarnation.
            logger.error("router %s: another router now beats under this id; give each "
                         "router its own --router-id", self.router_id)
        self._displaced = not held
        return held

    async def _beat_loop(self) -> None:
        while not self._stopping:
            await asyncio.sleep(HEARTBEAT_S)
            await self._beat_once()

    async def reclaim(self, prefill_stub_of) -> int:
        """Releases the leases this id's earlier incarnations left, where they are surely
        gone; returns how many. ``prefill_stub_of(worker_id)``: the live prefill worker's
        stub, or None (a worker that is gone took its leases with it)."""
        try:
            entries, _ = await self.ledger.entries(limit=MAX_LIST_LIMIT)
        except Exception as e:  # noqa: BLE001
            logger.warning("router %s: cannot read the transfer ledger: %s", self.router_id, e)
            return 0
        # A lease being pulled is left to its pull, which releases it: the puller may not
        # have heard of the cut yet and would read blocks already reused.
        left = [e for e in entries if e.router_id == self.router_id
                and e.router_incarnation != self.incarnation and not e.decode_worker_id]
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
