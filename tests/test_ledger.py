"""The transfer ledger (router/ledger.py) and a router's presence (router/router_presence.py)
against a real redis-server."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest

from engine.block_hash import hash_request_tokens
from engine.block_pool import BlockStored
from engine.outputs import LeaseEnded
from router.ledger import (EXPIRY_MARGIN_S, MAX_LIST_LIMIT, TransferOpened, TransferPulling,
                           entry_key, pull_key)
from router.redis_server import RedisServer
from router.registry import Registry
from router.router_presence import TTL_S, Incarnation, RouterPresence, pid_namespace
from protos import common_pb2, worker_pb2, worker_pb2_grpc


def _opened(rid: str, router: str = "r1", inc: str = "inc", expires_in: float = 60.0,
            blocks: int = 3, clock_off: float = 0.0) -> TransferOpened:
    now = time.time() + clock_off  # the worker's clock
    return TransferOpened(request_id=rid, router_id=router, router_incarnation=inc,
                          prefill_address="127.0.0.1:7", num_blocks=blocks,
                          num_tokens=blocks * 16 - 5, leased_at=now, expires_at=now + expires_in)


def test_an_entry_lives_from_open_through_pull_to_its_lease_end(redis_url):
    async def body():
        reg = Registry.from_url(redis_url, "l1")
        hashes = hash_request_tokens(list(range(48)), 16)
        await reg.heartbeat(common_pb2.WorkerInfo(worker_id="p1", role="prefill"))
        # Ledger events ride the same pipeline as the block events, in order.
        await reg.publish_events("p1", [BlockStored(hashes, None, None, 16), _opened("a~1"),
                                        _opened("b~2", blocks=5)])
        entries, omitted = await reg.ledger.entries()
        assert omitted == 0
        assert [(e.request_id, e.state, e.num_blocks, e.router_id, e.prefill_worker_id)
                for e in entries] == [("a~1", "leased", 3, "r1", "p1"),
                                      ("b~2", "leased", 5, "r1", "p1")]
        assert await reg.match_prefix(hashes, ["p1"]) == {"p1": 3}
        await reg.publish_events("d1", [TransferPulling("p1", "a~1", "d1", time.time(), 60.0)])
        (a, b), _ = await reg.ledger.entries()
        assert (a.state, a.decode_worker_id, b.state) == ("pulling", "d1", "leased")
        assert a.pull_started_at > 0
        await reg.publish_events("p1", [LeaseEnded("a~1")])
        assert [e.request_id for e in (await reg.ledger.entries())[0]] == ["b~2"]
        # A pull mark arriving after the lease ended does not bring the entry back.
        await reg.publish_events("d1", [TransferPulling("p1", "a~1", "d1", time.time(), 60.0)])
        assert not await reg.r.exists(entry_key("l1", "p1", "a~1"))
        assert [e.request_id for e in (await reg.ledger.entries())[0]] == ["b~2"]
        await reg.publish_events("p1", [LeaseEnded("b~2", expired=True)])
        assert (await reg.ledger.entries()) == ([], 0)
        assert await reg.r.zcard(reg.ledger.index_key) == 0
        # The late mark lingers no longer than the lease it named.
        assert 0 < await reg.r.pttl(pull_key(entry_key("l1", "p1", "a~1"))) \
            <= (60 + EXPIRY_MARGIN_S) * 1000
        # A mark that reaches Redis before its entry's open (the workers' pipelines race)
        # shows once the entry does; the close takes it along.
        await reg.publish_events("d2", [TransferPulling("p1", "c~3", "d2", time.time(), 60.0)])
        assert (await reg.ledger.entries()) == ([], 0)
        await reg.publish_events("p1", [_opened("c~3")])
        (c,), _ = await reg.ledger.entries()
        assert (c.request_id, c.state, c.decode_worker_id) == ("c~3", "pulling", "d2")
        await reg.publish_events("p1", [LeaseEnded("c~3")])
        assert not await reg.r.exists(pull_key(entry_key("l1", "p1", "c~3")))
        await reg.r.aclose()
    asyncio.run(body())


def test_entries_expire_with_their_lease_and_leave_the_listing(redis_url, monkeypatch):
    import router.ledger
    monkeypatch.setattr(router.ledger, "EXPIRY_MARGIN_S", 0.1)

    async def body():
        reg = Registry.from_url(redis_url, "l2")
        await reg.publish_events("p1", [_opened("short", expires_in=0.1), _opened("long"),
                                        _opened("lost")])
        ttl_ms = await reg.r.pttl(entry_key("l2", "p1", "long"))
        assert 59_000 < ttl_ms <= 60_100
        await asyncio.sleep(0.4)  # Redis expired "short"'s entry: its index member is pruned
        await reg.r.delete(entry_key("l2", "p1", "lost"))  # gone before its time: pruned too
        entries, omitted = await reg.ledger.entries()
        assert [e.request_id for e in entries] == ["long"] and omitted == 0
        assert await reg.r.zcard(reg.ledger.index_key) == 1
        await reg.r.aclose()
    asyncio.run(body())


def test_no_clock_but_redis_s_decides_what_expires(redis_url, monkeypatch):
    """A worker's clock behind Redis's does not expire its entries early, and a reader's
    clock ahead of the workers' hides no live entry."""
    async def body():
        reg = Registry.from_url(redis_url, "l2b")
        await reg.publish_events("p1", [_opened("behind", clock_off=-1000.0)])
        assert 55_000 < await reg.r.pttl(entry_key("l2b", "p1", "behind")) \
            <= (60 + EXPIRY_MARGIN_S) * 1000
        import router.ledger

        class _Ahead:
            @staticmethod
            def time() -> float:
                return time.time() + 1000.0
        monkeypatch.setattr(router.ledger, "time", _Ahead)
        entries, omitted = await reg.ledger.entries()
        assert [e.request_id for e in entries] == ["behind"] and omitted == 0
        assert await reg.r.zcard(reg.ledger.index_key) == 1
        await reg.r.aclose()
    asyncio.run(body())


def test_a_router_sweeps_index_members_whose_entry_is_gone(redis_url, monkeypatch):
    """Entries whose close never came (a worker that left for a drain, then died, is purged by
    no router) leave their index member: a listing's prune reaches only members past their
    expiry by its reader's clock. Every router's heartbeat walks the whole index."""
    import router.router_presence
    monkeypatch.setattr(router.router_presence, "HEARTBEAT_S", 0.01)
    monkeypatch.setattr(router.router_presence, "_SWEEP_EVERY_BEATS", 2)

    async def body():
        reg = Registry.from_url(redis_url, "l3s")
        lost = [_opened(f"lost-{i}", clock_off=1000.0) for i in range(30)]  # a clock ahead
        await reg.publish_events("p1", [*lost, _opened("live")])
        await reg.r.delete(*(entry_key("l3s", "p1", ev.request_id) for ev in lost))
        assert await reg.r.zcard(reg.ledger.index_key) == 31
        # ZSCAN walks small sets in one step: a cursor that takes several needs a big one.
        assert await reg.ledger.sweep(0) == 0
        assert await reg.r.zcard(reg.ledger.index_key) == 1
        await reg.publish_events("p1", lost)
        await reg.r.delete(*(entry_key("l3s", "p1", ev.request_id) for ev in lost))
        presence = RouterPresence(reg.ledger, "sweeper")
        await presence.claim()
        presence.start()
        try:
            async with asyncio.timeout(30):
                while await reg.r.zcard(reg.ledger.index_key) > 1:
                    await asyncio.sleep(0.01)
        finally:
            await presence.stop()
        assert await reg.r.zrange(reg.ledger.index_key, 0, -1) == \
            [entry_key("l3s", "p1", "live").encode()]
        await reg.r.aclose()
    asyncio.run(body())


def test_listing_is_bounded_expiring_first_and_ids_never_collide(redis_url):
    async def body():
        reg = Registry.from_url(redis_url, "l3")
        await reg.publish_events("p", [_opened(f"r{i}", expires_in=60 - i) for i in range(5)])
        # Worker "a:b" with request "c" and worker "a" with request "b:c" are different keys.
        await reg.publish_events("a:b", [_opened("c")])
        await reg.publish_events("a", [_opened("b:c")])
        entries, omitted = await reg.ledger.entries(limit=3)
        assert [e.request_id for e in entries] == ["r4", "r3", "r2"] and omitted == 4
        every, _ = await reg.ledger.entries()
        assert {(e.prefill_worker_id, e.request_id) for e in every} >= {("a:b", "c"),
                                                                        ("a", "b:c")}
        for bad in (0, MAX_LIST_LIMIT + 1):
            with pytest.raises(ValueError, match="limit"):
                await reg.ledger.entries(limit=bad)
        await reg.r.aclose()
    asyncio.run(body())


def test_a_purged_worker_takes_its_entries_with_it(redis_url):
    async def body():
        reg = Registry.from_url(redis_url, "l4")
        await reg.publish_events("p1", [_opened("x")])
        await reg.publish_events("p10", [_opened("y")])
        await reg.deregister("p1")
        assert [(e.prefill_worker_id, e.request_id)
                for e in (await reg.ledger.entries())[0]] == [("p10", "y")]
        # A worker started again under its id: its predecessor's leases died with it.
        await reg.publish_events("p10", [_opened("z"), LeaseEnded("y")])
        await reg.publish_events("p10", [_opened("w")])
        await reg.publish_events("d1", [TransferPulling("p10", "w", "d1", time.time(), 60.0)])
        await reg.clear_worker("p10")
        assert (await reg.ledger.entries()) == ([], 0)
        assert not await reg.r.keys("l4:wxfers:*") and not await reg.r.keys("l4:xpull:*")
        await reg.r.aclose()
    asyncio.run(body())


def test_a_non_event_is_refused(redis_url):
    async def body():
        reg = Registry.from_url(redis_url, "l5")
        with pytest.raises(TypeError, match="not a KV-cache or ledger event"):
            await reg.publish_events("p1", ["nonsense"])
        await reg.r.aclose()
    asyncio.run(body())


# --- router presence -------------------------------------------------------------------------
def test_incarnations_are_gone_only_when_surely_so():
    me = Incarnation.this_process()
    ns = pid_namespace()
    assert ns and me.pidns == ns
    assert Incarnation.decode(me.encode()) == me
    assert Incarnation(me.token + "x", me.host, os.getpid(), ns).surely_gone()  # pid reused
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    assert Incarnation("t", me.host, int(dead.stdout), ns).surely_gone()
    assert Incarnation("t", "another-host", int(dead.stdout), ns).surely_gone()
    assert not Incarnation("t", me.host, os.getppid(), ns).surely_gone()  # alive
    # Another pid namespace (a container) proves nothing, though its host name is ours and
    # its pid is dead here or is even our own.
    for pid in (int(dead.stdout), os.getpid()):
        assert not Incarnation("t", me.host, pid, "another-boot/4026531836").surely_gone()
        assert not Incarnation("t", me.host, pid, "").surely_gone()
    assert not Incarnation.decode("garbage").surely_gone()
    assert Incarnation.decode(Incarnation("t", "h", 5).encode()) == Incarnation("t", "h", 5)
    # Free text from a Prefill call: a pid that is a digit only to isdigit(), or past any
    # pid (os.kill overflows), names no process.
    for pid in ("\u00b2", str(10 ** 20), str(2 ** 22 + 1)):
        assert Incarnation.decode(f"t {pid} {ns} h") == Incarnation("t", "h", 0, ns)
    assert not Incarnation("t", me.host, 10 ** 20, ns).surely_gone()


class _Stub:
    def __init__(self) -> None:
        self.released: list[str] = []

    async def ReleaseKV(self, req: worker_pb2.ReleaseKVRequest, timeout: float):
        self.released.append(req.request_id)
        return worker_pb2.ReleaseKVResponse(released=True)


def test_a_restarted_router_releases_only_what_a_surely_gone_predecessor_left(redis_url,
                                                                             monkeypatch):
    import router.router_presence
    monkeypatch.setattr(router.router_presence, "_RECLAIM_ROUND_S", 0.05)
    monkeypatch.setattr(router.router_presence, "_RECLAIM_SETTLE_S", 0.2)

    async def body():
        reg = Registry.from_url(redis_url, "l6")
        host, ns = socket.gethostname(), pid_namespace()
        dead = Incarnation("old", host, os.getpid(), ns)  # this pid, in this namespace
        elsewhere = Incarnation("far", host + "-other", 4242, "other-boot/1")
        container = Incarnation("ctr", host, os.getpid(), "other-boot/2")  # hostname shared
        await reg.publish_events("p1", [
            _opened("mine-1", "r1", dead.encode()), _opened("mine-2", "r1", dead.encode()),
            _opened("pulled", "r1", dead.encode()),
            _opened("other-router", "r2", dead.encode()),
            _opened("maybe-alive", "r1", elsewhere.encode()),
            _opened("other-container", "r1", container.encode()),
            # Entries no incarnation wrote: they stopped every other lease's reclaim.
            _opened("odd-pid", "r1", "tok \u00b2 - host"),
            _opened("huge-pid", "r1", f"tok {10 ** 20} {ns} host")])
        await reg.publish_events("d1", [TransferPulling("p1", "pulled", "d1", time.time(), 60.0)])
        presence = RouterPresence(reg.ledger, "r1")
        await presence.claim()
        await reg.publish_events("p1", [_opened("current", "r1", presence.incarnation)])
        stub = _Stub()
        n = await presence.reclaim(lambda wid: stub if wid == "p1" else None)
        assert n == 2 and sorted(stub.released) == ["mine-1", "mine-2"]
        await presence.stop()
        assert await reg.ledger.router_holder("r1") is None
        await reg.r.aclose()
    asyncio.run(body())


def test_a_router_logs_a_failing_heartbeat_once_per_outage(caplog):
    class Ledger:
        up = False

        async def router_claim(self, router_id, incarnation, ttl_s):
            if not self.up:
                raise ConnectionError("Redis away")
            return True

    async def body():
        ledger = Ledger()
        presence = RouterPresence(ledger, "r1")
        for up in (False, False, False, True, False, False):
            ledger.up = up
            assert await presence._beat_once() == up
    with caplog.at_level("INFO", logger="router.router_presence"):
        asyncio.run(body())
    assert [r.getMessage() for r in caplog.records] == [
        "router r1: heartbeat failed: Redis away",
        "router r1: heartbeat goes through again",
        "router r1: heartbeat failed: Redis away"]


def test_a_restarted_router_finds_its_predecessors_leases_past_one_listings_limit(
        redis_url, monkeypatch):
    """One listing's limit (10 000) cut a cluster's leases: those of the predecessor past it,
    expiring later, were never released."""
    import router.router_presence
    monkeypatch.setattr(router.router_presence, "MAX_LIST_LIMIT", 2)

    async def body():
        reg = Registry.from_url(redis_url, "l6b")
        dead = Incarnation("old", socket.gethostname(), os.getpid(), pid_namespace())
        # Others' leases expire first and fill the first pages.
        await reg.publish_events("p1", [_opened(f"other-{i}", "r2", dead.encode(),
                                                expires_in=30.0 + i) for i in range(5)])
        await reg.publish_events("p1", [_opened(f"mine-{i}", "r1", dead.encode(),
                                                expires_in=60.0 + i) for i in range(3)])
        presence = RouterPresence(reg.ledger, "r1")
        mine = await presence.predecessor_entries()
        assert sorted(e.request_id for e in mine) == ["mine-0", "mine-1", "mine-2"]
        await reg.r.aclose()
    asyncio.run(body())


def test_a_router_id_beating_elsewhere_is_refused_and_a_stale_one_is_taken(redis_url,
                                                                           monkeypatch):
    import router.router_presence

    # Shorter waits before refusing and before taking a stale id: this test's whole time.
    # The others below beat with the real TTL_S, so a claim's wait can be short.
    ttl = 1.5
    monkeypatch.setattr(router.router_presence, "TTL_S", 0.3)
    monkeypatch.setattr(router.router_presence, "HEARTBEAT_S", 0.25)

    async def body():
        reg = Registry.from_url(redis_url, "l7")
        host, ns = socket.gethostname(), pid_namespace()
        for other in (Incarnation("live", host + "-other", 1, "other-boot/1"),
                      Incarnation("here", host, os.getppid(), ns),  # alive, our namespace
                      Incarnation("ctr", host, os.getpid(), "other-boot/2")):
            beats = asyncio.create_task(_beat_forever(reg, "taken", other.encode()))
            await asyncio.sleep(0.1)
            with pytest.raises(ValueError, match="in use by a live router"):
                await RouterPresence(reg.ledger, "taken").claim()
            beats.cancel()
            await reg.ledger.router_leave("taken", other.encode())
        # The heartbeat is Redis's key, expiring a TTL after the last beat.
        monkeypatch.setattr(router.router_presence, "TTL_S", ttl)
        other = Incarnation("gone", host + "-other", 1, "other-boot/1").encode()
        assert await reg.ledger.router_claim("stale", other, ttl)
        assert 0 < await reg.r.pttl("l7:router:stale") <= ttl * 1000
        assert await reg.ledger.live_routers(["stale", "never"]) == {"stale"}
        # A predecessor that stopped beating is waited out, then its id is taken.
        t0 = time.monotonic()
        p = RouterPresence(reg.ledger, "stale")
        await p.claim()
        assert time.monotonic() - t0 >= ttl - 0.5
        assert await reg.ledger.router_holder("stale") == p.incarnation
        # Its beats do not take the id back from the new holder.
        assert not await reg.ledger.router_claim("stale", other, ttl)
        assert not await p.ledger.router_leave("stale", other)
        assert await reg.ledger.live_routers(["stale"]) == {"stale"}
        await p.stop()
        assert await reg.ledger.live_routers(["stale"]) == set()
        await reg.r.aclose()
    asyncio.run(body())


def test_a_router_that_died_leaves_no_key_behind(redis_url, monkeypatch):
    import router.router_presence

    monkeypatch.setattr(router.router_presence, "TTL_S", 1.5)  # the wait below

    async def body():
        reg = Registry.from_url(redis_url, "l8")
        p = RouterPresence(reg.ledger, "crashed")
        await p.claim()
        assert await reg.r.keys("l8:*") == [b"l8:router:crashed"]
        await asyncio.sleep(1.5 + 0.2)  # never left, never beat again
        assert await reg.r.keys("l8:*") == []
        await reg.r.aclose()
    asyncio.run(body())


async def _beat_forever(reg: Registry, router_id: str, incarnation: str) -> None:
    while True:
        await reg.ledger.router_claim(router_id, incarnation, TTL_S)
        await asyncio.sleep(0.2)


@pytest.mark.parametrize("value", ["two words", "a\nb", "x" * 129, 7])
def test_a_bad_router_id_is_refused(value):
    from router.config import RouterConfig

    with pytest.raises(ValueError, match="router_id"):
        RouterConfig(model="m", redis_url="redis://x", router_id=value)
    assert RouterConfig(model="m", redis_url="redis://x", router_id="r-1.a:b").router_id


def test_the_default_router_id_names_host_and_port():
    from router.router_presence import default_router_id

    host = socket.gethostname()
    assert default_router_id("0.0.0.0", 50051) == f"router-{host}-50051"
    assert default_router_id("[::]", 50051) == f"router-{host}-50051"
    assert default_router_id("10.0.0.5", 50051) == f"router-{host}-10.0.0.5-50051"
    assert default_router_id("127.0.0.1", 0) == f"router-{host}-127.0.0.1-{os.getpid()}"
    from router.router_presence import check_router_id
    assert check_router_id(default_router_id("[fe80::1]", 50051))


# --- a worker's republish, the listing's times and liveness ----------------------------------
def test_a_republish_makes_the_worker_s_entries_what_it_holds(redis_url):
    """Redis lost an entry of a lease still held (a restart, a purge of the worker) and kept
    one whose close was lost (a failed flush): the worker's republish puts its entries right,
    each for what is left of its lease, keeping the pull mark of a lease being pulled."""
    async def body():
        reg = Registry.from_url(redis_url, "l9")
        held = [_opened("pulled"), _opened("lost")]
        await reg.publish_events("p1", [*held, _opened("closed")])
        await reg.publish_events("d1", [TransferPulling("p1", "pulled", "d1", time.time(), 60.0)])
        await reg.publish_events("p2", [_opened("another-worker-s")])
        await reg.r.delete(entry_key("l9", "p1", "lost"))
        left = [dataclasses.replace(e, remaining_s=30.0 - i) for i, e in enumerate(held)]
        await reg.ledger.replace_worker("p1", left)
        listed = {(e.prefill_worker_id, e.request_id): e for e in (await reg.ledger.entries())[0]}
        assert sorted(listed) == [("p1", "lost"), ("p1", "pulled"), ("p2", "another-worker-s")]
        assert listed["p1", "pulled"].decode_worker_id == "d1"
        assert not await reg.r.exists(entry_key("l9", "p1", "closed"))
        assert await reg.r.zscore(reg.ledger.index_key, entry_key("l9", "p1", "closed")) is None
        assert await reg.r.smembers("l9:wxfers:p1") == {
            entry_key("l9", "p1", r).encode() for r in ("pulled", "lost")}
        # Kept for what was left of it, and listed so: ends in under 29 s, began over 31 s ago.
        lost = listed["p1", "lost"]
        assert 0 < await reg.r.pttl(entry_key("l9", "p1", "lost")) <= (29 + EXPIRY_MARGIN_S) * 1000
        assert 0 < lost.expires_in_s <= 29 and 31 <= lost.age_s < 60
        # The worker's set outlives its longest entry.
        assert await reg.r.pttl("l9:wxfers:p1") > (29 + EXPIRY_MARGIN_S) * 1000
        # A new, empty Redis gets them all back.
        await reg.r.flushdb()
        await reg.ledger.replace_worker("p1", left)
        assert sorted(e.request_id for e in (await reg.ledger.entries())[0]) == ["lost", "pulled"]
        await reg.r.aclose()
    asyncio.run(body())


class _Routerless:
    """What ListTransfers reads of the router: the registry."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry


async def _list_transfers(reg: Registry) -> dict:
    from router.admin import RouterAdminServicer
    from protos import router_pb2

    resp = await RouterAdminServicer(_Routerless(reg), None, None).ListTransfers(
        router_pb2.ListTransfersRequest(), None)
    return {t.transfer_id: t for t in resp.transfers}


def test_listed_times_are_redis_s_not_other_hosts_clocks(redis_url):
    """Workers whose clocks are minutes off the router's: their leases are listed as Redis
    counts them."""
    async def body():
        reg = Registry.from_url(redis_url, "l10")
        for name, off in (("behind", -120.0), ("ahead", 120.0), ("in-sync", 0.0)):
            await reg.publish_events(f"p-{name}", [_opened(name, clock_off=off)])
        # The decode worker's clock is off too; the pull began with 50 s of the lease left.
        await reg.publish_events("d1", [TransferPulling("p-ahead", "ahead", "d1",
                                                        time.time() - 1000.0, 50.0)])
        listed = await _list_transfers(reg)
        assert sorted(listed) == ["ahead", "behind", "in-sync"]
        for t in listed.values():
            assert 55 < t.expires_in_s <= 60 and 0 <= t.age_s < 5
        assert listed["ahead"].state == "pulling" and 0 <= listed["ahead"].pull_s < 5
        assert listed["behind"].pull_s == 0
        await reg.r.aclose()
    asyncio.run(body())


def test_a_lease_s_router_lives_only_as_the_incarnation_that_took_it(redis_url):
    async def body():
        reg = Registry.from_url(redis_url, "l11")
        assert await reg.ledger.router_claim("r1", "now", TTL_S)
        await reg.publish_events("p1", [_opened("by-this-one", "r1", "now"),
                                        _opened("by-a-predecessor", "r1", "before"),
                                        _opened("no-incarnation", "r1", ""),
                                        _opened("by-a-router-gone", "r2", "now")])
        listed = await _list_transfers(reg)
        assert {k: t.router_live for k, t in listed.items()} == {
            "by-this-one": True, "by-a-predecessor": False, "no-incarnation": False,
            "by-a-router-gone": False}
        await reg.r.aclose()
    asyncio.run(body())


# --- a restarted router's reclaim ------------------------------------------------------------
class _PrefillWorker(worker_pb2_grpc.PrefillWorkerServicer):
    """A prefill worker's ReleaseKV, served: answering, or never (a hung worker)."""

    def __init__(self, hung: bool = False) -> None:
        self.hung = hung
        self.released: list[str] = []

    async def ReleaseKV(self, request, context):
        if self.hung:
            await asyncio.Event().wait()
        self.released.append(request.request_id)
        return worker_pb2.ReleaseKVResponse(released=True)


async def _serve(servicer) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    worker_pb2_grpc.add_PrefillWorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _until(pred, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def test_a_reclaim_waits_out_redis_and_dials_workers_out_of_its_view(monkeypatch):
    """Redis hangs as the router starts, and its view of the workers is empty: the reclaim
    tries again until the ledger reads, releases at the entries' addresses, and a worker that
    hangs holds up no other; it ends once every lease is answered for or gone."""
    import router.redis_bound
    import router.router_presence
    monkeypatch.setattr(router.redis_bound, "REDIS_TIMEOUT_S", 0.5)
    monkeypatch.setattr(router.router_presence, "_RECLAIM_ROUND_S", 0.05)
    monkeypatch.setattr(router.router_presence, "_RECLAIM_SETTLE_S", 0.2)
    monkeypatch.setattr(router.router_presence, "_RELEASE_TIMEOUT_S", 60.0)

    async def body(redis: RedisServer):
        reg = Registry.from_url(redis.url, "l12")
        dead = Incarnation("old", socket.gethostname(), os.getpid(), pid_namespace()).encode()
        answering, hung = _PrefillWorker(), _PrefillWorker(hung=True)
        (s1, a1), (s2, a2) = await _serve(answering), await _serve(hung)
        await reg.publish_events("p1", [dataclasses.replace(_opened(r, "r1", dead),
                                                            prefill_address=a1)
                                        for r in ("a~1", "b~2")])
        await reg.publish_events("p2", [dataclasses.replace(_opened("c~3", "r1", dead),
                                                            prefill_address=a2)])
        presence = RouterPresence(reg.ledger, "r1")
        failed = 0
        read = reg.ledger.entries

        async def counted(*args, **kwargs):
            nonlocal failed
            try:
                return await read(*args, **kwargs)
            except Exception:
                failed += 1
                raise
        reg.ledger.entries = counted
        os.kill(redis.proc.pid, signal.SIGSTOP)
        try:
            task = asyncio.create_task(presence.reclaim(lambda wid: None))
            assert await _until(lambda: failed >= 2)
        finally:
            os.kill(redis.proc.pid, signal.SIGCONT)
        assert await _until(lambda: sorted(answering.released) == ["a~1", "b~2"])
        assert not task.done()  # the hung worker's lease is still listed, its call in flight
        await reg.r.delete(entry_key("l12", "p2", "c~3"))  # as its expiry would
        assert await asyncio.wait_for(task, 20) == 2
        await s1.stop(0)
        await s2.stop(0)
        await reg.r.aclose()

    with RedisServer() as redis:
        asyncio.run(body(redis))
