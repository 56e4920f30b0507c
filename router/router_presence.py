"""A router's presence in Redis: its id, a heartbeat, and the leases its predecessor left.

Every Prefill call names the router and this process's incarnation (a random id drawn at
start), and the prefill worker records both with the lease in the transfer ledger
(router/ledger.py). A router that dies mid-request leaves leases nobody releases: each holds
its prompt's blocks until it expires (``--kv-lease-timeout-s``, 60 s by default). A router
restarted under the same id finds them in the ledger and releases at once those nobody is
pulling (and keeps trying while Redis or a worker does not answer, until each is answered for
or expired: ``reclaim``), but only when its predecessor is surely gone: it ran in this
process's pid namespace (same kernel boot, same namespace) and its pid is dead or is this
process's. A hostname proves nothing (containers may share one, each with its own pid 1),
and a router that merely lost Redis may still have decode workers about to pull those blocks:
releasing them then would hand a live request blocks that are being reused. Leases not
proven orphaned expire.

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
from protos import worker_pb2, worker_pb2_grpc
from router.ledger import MAX_LIST_LIMIT, LedgerEntry, TransferLedger
from router.router_peers import RouterPeers

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
# A router that has not beaten for this long is taken as gone (Redis expires its key).
TTL_S = 3.0
_RELEASE_TIMEOUT_S = 5.0
_STOP_S = 2.0
# A reclaim reads the ledger this often while it runs.
_RECLAIM_ROUND_S = 1.0
# ...and for at least this long with every read answered: a worker puts back the entries a
# Redis restart or a purge lost at its next heartbeat (router/presence.py; at most 2.5 s
# apart), and a router restarted with Redis may read the ledger before any has.
_RECLAIM_SETTLE_S = 10.0
# Every router walks the ledger's index for members whose entry expired, a step (a thousand
# members) this many beats apart: cheap, and stale members go within minutes.
_SWEEP_EVERY_BEATS = 10
# Linux's largest pid (PID_MAX_LIMIT): an incarnation naming a larger one names no process.
_MAX_PID = 2 ** 22


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
        # Free text from a Prefill call: '²' is a digit to isdigit() and none to int(), and a
        # huge pid overflows os.kill. Any pid but a real one is 0, never surely gone.
        ok = pid.isascii() and pid.isdigit() and len(pid) <= 8 and int(pid) <= _MAX_PID
        return cls(token, host, int(pid) if ok else 0, "" if pidns == "-" else pidns)

    @classmethod
    def this_process(cls) -> Incarnation:
        # The host is shortened: the incarnation rides in every Prefill call.
        return cls(secrets.token_hex(8), socket.gethostname()[:64], os.getpid(), pid_namespace())

    def surely_gone(self) -> bool:
        """True only when this incarnation cannot be running (seen from this process)."""
        if not self.pidns or self.pidns != pid_namespace() or not 0 < self.pid <= _MAX_PID:
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
    def __init__(self, ledger: TransferLedger, router_id: str,
                 peers: RouterPeers | None = None) -> None:
        """``peers``: beaten with the heartbeat, so routing knows this router's place among
        the routers sharing the namespace (router/router_peers.py)."""
        self.ledger = ledger
        self.router_id = router_id
        self.peers = peers
        self.me = Incarnation.this_process()
        self.incarnation = self.me.encode()
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._displaced = False  # another incarnation holds our id (see _beat_once)
        self._beat_failed = False  # a heartbeat failed since the last one that went through
        self._maybe_alive = 0  # leases left to expire, as last logged (predecessor_entries)

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
            # Once per outage, not once a second while it lasts.
            if not self._beat_failed:
                logger.warning("router %s: heartbeat failed: %s", self.router_id, e)
            self._beat_failed = True
            return False
        if self._beat_failed:
            logger.info("router %s: heartbeat goes through again", self.router_id)
        self._beat_failed = False
        if not held and not self._displaced:
            # Our key expired (Redis was out of reach for a TTL) and another router took the
            # id: both now serve under it. Its leases and ours stay apart by incarnation.
            logger.error("router %s: another router now beats under this id; give each "
                         "router its own --router-id", self.router_id)
        self._displaced = not held
        return held

    async def _beat_loop(self) -> None:
        cursor, beats = 0, 0
        while not self._stopping:
            await asyncio.sleep(HEARTBEAT_S)
            if await self._beat_once():
                await self.beat_peers()
            beats += 1
            if beats % _SWEEP_EVERY_BEATS == 0:
                cursor = await self._sweep(cursor)

    async def beat_peers(self) -> None:
        """This router's beat among its peers; a failure keeps the place last known (the
        heartbeat's own failure says Redis is away)."""
        if self.peers is None:
            return
        try:
            await self.peers.beat()
        except Exception as e:  # noqa: BLE001 - redis-py's errors, OSError, timeouts
            logger.debug("router %s: peers beat failed: %r", self.router_id, e)

    async def _sweep(self, cursor: int) -> int:
        """One step of the ledger index's sweep (TransferLedger.sweep); the next cursor."""
        try:
            return await self.ledger.sweep(cursor)
        except Exception as e:  # noqa: BLE001 - Redis away: the beat says so; begun again
            logger.debug("router %s: ledger sweep failed: %s", self.router_id, e)
            return 0

    async def reclaim(self, prefill_stub_of) -> int:
        """Releases the leases this id's earlier incarnations left, where they are surely
        gone; returns how many. A task for the router's life until done: it reads the ledger
        until Redis answers, asks every lease's worker at once (one that hangs delays no
        other), and tries again each round what was not answered. It ends once every such
        lease seen was answered for and the ledger has been read for ``_RECLAIM_SETTLE_S``
        without a failure: entries Redis lost come back with their worker's republish (a
        restart, a purge), a few heartbeats later. A lease whose worker does not answer is
        tried until its entry expires with it, so the leases' TTLs bound the task once Redis
        answers. ``prefill_stub_of(worker_id)``: the stub of a prefill worker in the router's
        view, or None: then the entry's address is dialed (the view may be empty yet, and a
        draining worker left it but holds its leases until its drain ends)."""
        run = _Reclaim(self, prefill_stub_of)
        try:
            return await run.until_done()
        finally:
            await run.close()

    async def predecessor_entries(self) -> list[LedgerEntry]:
        """The ledger's leases of this id's earlier incarnations that are surely gone, and
        that nobody pulls. Raises as the ledger read does."""
        entries = await self._all_entries()
        # A lease being pulled is left to its pull, which releases it: the puller may not
        # have heard of the cut yet and would read blocks already reused.
        left = [e for e in entries if e.router_id == self.router_id
                and e.router_incarnation != self.incarnation and not e.decode_worker_id]
        mine = [e for e in left if _surely_gone(e.router_incarnation)]
        if len(mine) < len(left) and len(left) - len(mine) != self._maybe_alive:
            logger.info("router %s: %d leases of an earlier incarnation that may still run "
                        "elsewhere are left to expire", self.router_id, len(left) - len(mine))
        self._maybe_alive = len(left) - len(mine)
        return mine

    async def _all_entries(self) -> list[LedgerEntry]:
        """Every entry of the ledger, a page at a time: one listing's limit cut the leases
        of a cluster holding more, and an earlier incarnation's past it were never seen.
        Entries dropped meanwhile shift the pages: one skipped so is read next round."""
        entries, offset = [], 0
        while True:
            page, more = await self.ledger.entries(limit=MAX_LIST_LIMIT, offset=offset)
            entries += page
            if not more:
                return entries
            offset += MAX_LIST_LIMIT

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            await stop_task(self._task, _STOP_S)
        try:
            async with asyncio.timeout(_STOP_S):
                await self.ledger.router_leave(self.router_id, self.incarnation)
                if self.peers is not None:
                    await self.peers.leave()
        except Exception as e:  # noqa: BLE001 - stopping anyway; the heartbeat goes stale
            logger.warning("router %s: leaving Redis failed: %r", self.router_id, e)


def _surely_gone(incarnation: str) -> bool:
    """Whether a ledger entry's incarnation is surely gone; False for one that cannot be
    told: a bad entry must not stop the others being reclaimed."""
    try:
        return Incarnation.decode(incarnation).surely_gone()
    except Exception as e:  # noqa: BLE001 - free text from a Prefill call, and os.kill
        logger.debug("incarnation %r: cannot tell whether it runs: %r", incarnation[:80], e)
        return False


class _Reclaim:
    """One run of ``RouterPresence.reclaim``: the releases in flight, answered, to retry."""

    def __init__(self, presence: RouterPresence, prefill_stub_of) -> None:
        self.presence = presence
        self.name = presence.router_id
        self.stub_of = prefill_stub_of
        # By (worker id, request id): ReleaseKVs in flight, and the workers' answers
        # (released, or not held any more). One that failed is in neither: sent again.
        self.sent: dict[tuple[str, str], asyncio.Task] = {}
        self.answered: dict[tuple[str, str], bool] = {}
        self.channels: dict[str, grpc.aio.Channel] = {}  # addresses dialed
        self.logged: set = set()  # failures logged, once each

    async def until_done(self) -> int:
        loop = asyncio.get_running_loop()
        settled_at = loop.time() + _RECLAIM_SETTLE_S
        while not self.presence._stopping:
            self._collect()
            try:
                entries = await self.presence.predecessor_entries()
            except Exception as e:  # noqa: BLE001 - redis-py's errors, OSError, timeouts
                self._log_once("read", "cannot read the transfer ledger (retrying): %s", e)
                settled_at = loop.time() + _RECLAIM_SETTLE_S
            else:
                pending = self._send(entries)
                if not pending and loop.time() >= settled_at:
                    break
            await asyncio.sleep(_RECLAIM_ROUND_S)
        released = sum(self.answered.values())
        if self.answered or self.sent:
            logger.info("router %s: released %d of %d KV leases its previous incarnation left",
                        self.name, released, len(self.answered) + len(self.sent))
        return released

    def _collect(self) -> None:
        """The answers in; a failed call is forgotten, so this round sends it again."""
        for key, task in list(self.sent.items()):
            if task.done():
                del self.sent[key]
                if task.result() is not None:
                    self.answered[key] = task.result()

    def _send(self, entries: list[LedgerEntry]) -> int:
        """A ReleaseKV for each entry neither answered nor in flight, all at once; how many
        listed are not answered yet. Entries gone from the ledger (released, expired, their
        worker purged) wait for nothing."""
        pending = 0
        for e in entries:
            key = (e.prefill_worker_id, e.request_id)
            if key in self.answered:
                continue
            pending += 1
            if key not in self.sent:
                self.sent[key] = asyncio.create_task(self._release(e))
        return pending

    async def _release(self, e: LedgerEntry) -> bool | None:
        """Whether the worker's answer says it released the lease; None if it gave none."""
        stub = self.stub_of(e.prefill_worker_id) or self._dial(e.prefill_address)
        try:
            resp = await stub.ReleaseKV(worker_pb2.ReleaseKVRequest(request_id=e.request_id),
                                        timeout=_RELEASE_TIMEOUT_S)
        except Exception as err:  # noqa: BLE001 - an RPC's failure, or an address gRPC refuses
            why = err.code().name if isinstance(err, grpc.aio.AioRpcError) else repr(err)
            self._log_once((e.prefill_worker_id, e.request_id),
                           "releasing %s on %s failed (retried while it is listed): %s",
                           e.request_id, e.prefill_worker_id, why)
            return None
        return resp.released

    def _dial(self, address: str) -> worker_pb2_grpc.PrefillWorkerStub:
        channel = self.channels.get(address)
        if channel is None:
            channel = self.channels[address] = grpc.aio.insecure_channel(address)
        return worker_pb2_grpc.PrefillWorkerStub(channel)

    def _log_once(self, what, message: str, *args) -> None:
        # Retried every round: one line per failing thing, not one per round.
        if what not in self.logged:
            self.logged.add(what)
            logger.warning("router %s: " + message, self.name, *args)

    async def close(self) -> None:
        for task in self.sent.values():
            task.cancel()
        for channel in self.channels.values():
            await channel.close()
