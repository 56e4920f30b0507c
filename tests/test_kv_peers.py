"""A decode worker's KV peers (engine/kv_peers.py) against a real Redis registry: it connects
ahead to each prefill worker that appears, and lets go of one gone long enough, on every rank
(the engine side of that is tests/test_kvtransfer_engine.py; here the engine is a recorder)."""
from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import engine.kv_peers as kv_peers
from kvtransfer import KVAgentHandle
from protos import common_pb2
from router.registry import Registry
from tests.kv_owner_proc import SMALL_LAYOUT

LAYOUT = SMALL_LAYOUT
FORGET_S = 0.4


class RecordingEngine:
    """What KVPeerConnector calls on a decode LLMEngine, with the peers it would hold."""

    def __init__(self) -> None:
        self.held: set[str] = set()
        self.busy: set[str] = set()  # peers with a transfer in flight: not forgotten yet
        self.preconnects: list[list[str]] = []
        self.forgets: list[list[str]] = []

    def preconnect_kv(self, handles: list[KVAgentHandle]) -> bool:
        names = [h.agent_name for h in handles]
        self.preconnects.append(names)
        self.held.update(names)
        return True

    def kv_peer_names(self) -> list[str]:
        return sorted(self.held)

    def forget_kv_peers(self, names: list[str]) -> list[str]:
        self.forgets.append(list(names))
        self.held -= set(names) - self.busy
        return [n for n in names if n in self.busy]


def _handles(*names: str) -> list[bytes]:
    base = KVAgentHandle(backend="torch", agent_name="x", metadata=b'{"store_port": 1}',
                         base_addr=4096, num_bytes=8 * LAYOUT.bytes_per_block, device_id=0,
                         mem_type="DRAM", layout=LAYOUT, address="127.0.0.1:9")
    return [replace(base, agent_name=n).to_bytes() for n in names]


async def _registered(redis_url: str, namespace: str, *agents: str):
    """A prefill worker "p1" registered with these agents' handles, and a decode worker's
    connector (every 50 ms) over a recording engine: (registry, its info, engine, connector)."""
    reg = Registry.from_url(redis_url, namespace)
    info = common_pb2.WorkerInfo(worker_id="p1", role="prefill", address="127.0.0.1:1")
    engine = RecordingEngine()
    peers = kv_peers.KVPeerConnector(reg, engine, 0.05)
    await reg.heartbeat(info)
    await reg.set_kv_handles("p1", _handles(*agents))
    return reg, info, engine, peers


async def _rounds_until(peers: kv_peers.KVPeerConnector, pred, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not pred():
        assert time.monotonic() < deadline
        await peers.connect_new()
        await asyncio.sleep(0.05)


def test_a_prefill_worker_gone_long_enough_is_forgotten_and_connected_again_on_return(
        redis_url, monkeypatch):
    monkeypatch.setattr(kv_peers, "FORGET_AFTER_S", FORGET_S)

    async def body():
        reg, info, engine, peers = await _registered(redis_url, "peers1", "a0", "a1")
        await peers.connect_new()
        await peers.connect_new()  # already connected: not again
        assert engine.preconnects == [["a0", "a1"]] and peers.num_connected == 1
        engine.held.add("met-in-a-request")  # a peer the registry never listed
        await reg.deregister("p1")
        t0 = time.monotonic()
        engine.busy = {"a1"}
        await _rounds_until(peers, lambda: engine.forgets)
        # Not at once: a purged worker may come back with the same agents.
        assert time.monotonic() - t0 >= FORGET_S
        assert {"a0", "a1"} <= set(engine.forgets[0]) and "a1" in engine.held
        engine.busy = set()  # the busy one goes at a later round
        await _rounds_until(peers, lambda: not engine.held)
        assert "a1" in sum(engine.forgets[1:], [])
        # The census every FORGET_AFTER_S / 2 found the peer only a request met.
        assert "met-in-a-request" in sum(engine.forgets, [])
        assert peers.num_forgotten == 3 and peers.num_connected == 0  # the gauge went down
        # Back under the same agents: connected again.
        await reg.heartbeat(info)
        await reg.set_kv_handles("p1", _handles("a0", "a1"))
        await peers.connect_new()
        assert engine.preconnects == [["a0", "a1"], ["a0", "a1"]] and peers.num_connected == 1
        await reg.r.aclose()

    asyncio.run(body())


def test_a_prefill_worker_back_before_the_grace_ends_keeps_its_connections(redis_url,
                                                                           monkeypatch):
    monkeypatch.setattr(kv_peers, "FORGET_AFTER_S", FORGET_S)

    async def body():
        reg, info, engine, peers = await _registered(redis_url, "peers2", "b0")
        await peers.connect_new()
        await reg.deregister("p1")  # a stale purge, say
        await peers.connect_new()
        await asyncio.sleep(FORGET_S / 2)
        await reg.heartbeat(info)  # it comes back and publishes again
        await reg.set_kv_handles("p1", _handles("b0"))
        end = time.monotonic() + 2 * FORGET_S
        while time.monotonic() < end:
            await peers.connect_new()
            await asyncio.sleep(0.05)
        assert engine.forgets == [] and engine.held == {"b0"}
        assert engine.preconnects == [["b0"]]
        await reg.r.aclose()

    asyncio.run(body())


async def _age_heartbeat(reg: Registry, worker_id: str, by_s: float) -> None:
    """As if the worker's last heartbeat came ``by_s`` earlier (no waiting in the test)."""
    key = f"{reg.ns}:heartbeats"
    await reg.r.zadd(key, {worker_id: await reg.r.zscore(key, worker_id) - by_s})


def test_a_decode_worker_beating_fast_keeps_a_prefill_worker_that_beats_slowly(redis_url):
    """The decode worker's reads purge stale workers, but by each one's own TTL: a prefill
    worker beating every 2.5 s (the most allowed), silent for 3 s, is live, though the decode
    worker, beating every 0.5 s, would take itself for gone after 1.5 s."""
    from router.presence import WorkerPresence

    async def body():
        pinfo = common_pb2.WorkerInfo(worker_id="p-slow", role="prefill", address="127.0.0.1:1")
        dinfo = common_pb2.WorkerInfo(worker_id="d-fast", role="decode", address="127.0.0.1:2")
        prefill = WorkerPresence(redis_url, "peers-ttl", 2.5, lambda: pinfo)
        decode = WorkerPresence(redis_url, "peers-ttl", 0.5, lambda: dinfo)
        await prefill.registry.set_kv_handles("p-slow", _handles("s0"))
        await prefill.start()
        await decode.start()
        engine = RecordingEngine()
        peers = kv_peers.KVPeerConnector(decode.registry, engine, 0.5)
        router = Registry.from_url(redis_url, "peers-ttl")
        try:
            await _age_heartbeat(router, "p-slow", 3.0)
            await peers.connect_new()
            assert engine.preconnects == [["s0"]]
            assert [i.worker_id for i in await router.live_workers("prefill")] == ["p-slow"]
            assert await router.kv_handles("p-slow") == _handles("s0")
            # Past its own TTL (and the routers'), it is gone for every reader.
            await _age_heartbeat(router, "p-slow", 3.0)
            assert await decode.registry.live_workers("prefill") == []
        finally:
            await decode.stop()
            await prefill.stop()
            await router.r.aclose()

    asyncio.run(body())
