"""The Redis registry and prefix index against a real redis-server."""
from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
import time

import grpc
import pytest

from engine.block_hash import hash_request_tokens
from engine.block_pool import BlockRemoved, BlockStored
from protos import common_pb2, router_pb2
from router.redis_server import RedisServer, free_port
from router import redis_database, registry as registry_mod
from router.registry import Registry
from router.stats import RouterStats
from tests.proc_signals import reap
from tests.serving_helpers import heartbeat_info


def _run(coro):
    return asyncio.run(coro)


def test_stale_workers_drop_out_and_take_their_blocks(redis_url):
    async def body():
        reg = Registry.from_url(redis_url, "t1", ttl_s=0.5)
        hashes = hash_request_tokens(list(range(64)), 16)
        await reg.heartbeat(heartbeat_info("a"))
        await reg.heartbeat(heartbeat_info("b", "decode"))
        await reg.publish_events("a", [BlockStored(hashes, None, None, 16)])
        assert [w.worker_id for w in await reg.live_workers("prefill")] == ["a"]
        assert await reg.match_prefix(hashes, ["a"]) == {"a": 4}
        time.sleep(0.7)
        await reg.heartbeat(heartbeat_info("b", "decode"))  # b keeps beating, a went silent
        assert [w.worker_id for w in await reg.live_workers()] == ["b"]
        assert await reg.r.scard(f"t1:block:{hashes[0].hex()}") == 0
        await reg.r.aclose()

    _run(body())


def test_match_counts_leading_blocks_only(redis_url):
    async def body():
        reg = Registry.from_url(redis_url, "t2")
        hashes = hash_request_tokens(list(range(80)), 16)  # 5 blocks
        for wid in "xy":  # blocks are listed only under registered workers
            await reg.heartbeat(heartbeat_info(wid))
        await reg.publish_events("x", [BlockStored(hashes[:2], None, None, 16),
                                       BlockStored([hashes[3]], hashes[2], None, 16)])
        await reg.publish_events("y", [BlockStored(hashes, None, None, 16)])
        await reg.publish_events("y", [BlockRemoved([hashes[4]])])
        assert await reg.match_prefix(hashes, ["x", "y", "z"]) == {"x": 2, "y": 4, "z": 0}
        await reg.deregister("y")
        assert await reg.match_prefix(hashes, ["x", "y"]) == {"x": 2, "y": 0}
        assert await reg.set_drained("x", True)
        assert (await reg.live_workers())[0].draining
        await reg.r.aclose()

    _run(body())


def test_bad_inputs(redis_url):
    with pytest.raises(ValueError, match="namespace"):
        Registry.from_url(redis_url, "a:b")

    async def body():
        reg = Registry.from_url(redis_url, "t3")
        with pytest.raises(ValueError, match="bad worker info"):
            await reg.heartbeat(common_pb2.WorkerInfo(worker_id="w", role="chef"))
        await reg.r.aclose()

    _run(body())


def test_kv_handles_are_published_and_leave_with_their_worker(redis_url, monkeypatch):
    async def body():
        reg = Registry.from_url(redis_url, "t-kvh", ttl_s=0.5)
        # With the key its KV handles are signed with (kvtransfer/handle_mac.py), read apart.
        await reg.set_kv_handles("p", [b"rank0\x00bytes", b"rank1"], b"key-p")
        await reg.heartbeat(heartbeat_info("p"))
        assert await reg.kv_handles("p") == [b"rank0\x00bytes", b"rank1"]
        assert await reg.kv_source("p") == ([b"rank0\x00bytes", b"rank1"], b"key-p")
        await reg.set_kv_handles("p", [b"new"], b"key-2")  # a restart replaces, never appends
        assert await reg.kv_source("p") == ([b"new"], b"key-2")
        await reg.deregister("p")
        assert await reg.kv_source("p") == ([], b"")
        await reg.set_kv_handles("q", [b"x"], b"key-q")
        await reg.heartbeat(heartbeat_info("q"))
        time.sleep(0.7)
        assert await reg.live_workers() == []  # stale: purged with its handles and key
        assert await reg.kv_source("q") == ([], b"")
        # A worker that died after writing its handles, before any beat went through, is
        # purged by nobody: its handles expire by themselves, and each beat puts that off.
        monkeypatch.setattr(registry_mod, "KV_HANDLES_TTL_S", 0.3)
        await reg.set_kv_handles("died", [b"x"], b"key-d")
        await reg.set_kv_handles("beats", [b"y"], b"key-b")
        for _ in range(5):
            await reg.heartbeat(heartbeat_info("beats"), ttl_s=5.0)
            await asyncio.sleep(0.1)
        assert await reg.kv_source("died") == ([], b"")
        assert await reg.kv_source("beats") == ([b"y"], b"key-b")
        await reg.r.aclose()

    _run(body())


def test_long_chains_are_matched_across_round_trips(redis_url):
    """Chains longer than one server-side walk (router.registry._MATCH_CHUNK blocks): a worker
    that drops out exactly at a chunk's end, one in the next chunk, one that holds it all."""
    from router.registry import _MATCH_CHUNK

    async def body():
        reg = Registry.from_url(redis_url, "t-long")
        n = 2 * _MATCH_CHUNK + 10
        hashes = hash_request_tokens(list(range(16 * n)), 16)
        assert len(hashes) == n
        for wid in ("edge", "mid", "all"):
            await reg.heartbeat(heartbeat_info(wid))
        await reg.publish_events("edge", [BlockStored(hashes[:_MATCH_CHUNK], None, None, 16)])
        cut = _MATCH_CHUNK + 7
        await reg.publish_events("mid", [BlockStored(hashes[:cut], None, None, 16)])
        await reg.publish_events("all", [BlockStored(hashes, None, None, 16)])
        want = {"edge": _MATCH_CHUNK, "mid": cut, "all": n, "none": 0}
        assert await reg.match_prefix(hashes, ["edge", "mid", "all", "none"]) == want
        # A repeated candidate is answered once; an empty chain matches nothing.
        assert await reg.match_prefix(hashes, ["mid", "mid"]) == {"mid": cut}
        assert await reg.match_prefix([], ["all"]) == {"all": 0}
        await reg.r.aclose()

    _run(body())


def test_a_worker_stops_even_when_redis_stops_answering():
    """A Redis that hangs (here: SIGSTOPped) must not hold a worker's stop: leaving the registry
    gives up after its timeout and the heartbeat expires on its own."""
    from router.presence import WorkerPresence

    async def body(server):
        presence = WorkerPresence(server.url, "t-stuck", 0.2, lambda: heartbeat_info("w"))
        await presence.start()
        server.proc.send_signal(signal.SIGSTOP)
        try:
            await asyncio.wait_for(presence.stop(), 30)  # bounded by the presence, not here
        finally:
            server.proc.send_signal(signal.SIGCONT)
        patient = Registry.from_url(server.url, "t-stuck", ttl_s=60)
        # Not deregistered: the leave's steps stopped at its timeout (its first, sent before,
        # may have landed as Redis resumed), its heartbeat entry still there ...
        assert await patient.r.zscore(patient._k("heartbeats"), "w") is not None
        strict = Registry.from_url(server.url, "t-stuck", ttl_s=0.6)
        assert await strict.live_workers() == []  # ... but its heartbeat is stale
        for reg in (patient, strict):
            await reg.r.aclose()

    with RedisServer() as server:
        _run(body(server))


def test_a_call_to_a_hung_redis_times_out_and_the_registry_recovers(monkeypatch):
    """The Registry bounds each call itself (no socket_timeout in redis-py): a call to a
    Redis that stopped answering fails with redis-py's TimeoutError, and the same Registry
    (the router keeps one for its life) works again once Redis answers."""
    import redis.exceptions

    import router.redis_bound
    monkeypatch.setattr(router.redis_bound, "REDIS_TIMEOUT_S", 0.5)

    async def body(server):
        reg = Registry.from_url(server.url, "t-hung")
        await reg.heartbeat(heartbeat_info("w"))
        server.proc.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(redis.exceptions.TimeoutError, match="live_workers"):
                await reg.live_workers()
            with pytest.raises(redis.exceptions.TimeoutError, match="heartbeat"):
                await reg.heartbeat(heartbeat_info("w"))  # a pipeline
        finally:
            server.proc.send_signal(signal.SIGCONT)
        await reg.heartbeat(heartbeat_info("w2"))
        assert [w.worker_id for w in await reg.live_workers()] == ["w", "w2"]
        await reg.r.aclose()

    with RedisServer() as server:
        _run(body(server))


async def _until_republished(republished: list, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if republished:
            return
        await asyncio.sleep(0.05)


def test_a_worker_dropped_from_the_registry_puts_its_entries_back(redis_url, caplog):
    """A router purges a worker whose heartbeat came late, its KV handles, index entries and
    an admin's drain with it; the worker's next heartbeat registers it again, and it puts them
    back (a new empty Redis is the same case)."""
    from router.presence import WorkerPresence

    async def body():
        info = heartbeat_info("w-drop")
        republished = []

        async def republish(registry: Registry) -> None:
            republished.append(time.monotonic())
            await registry.set_kv_handles("w-drop", [b"handle"])

        presence = WorkerPresence(redis_url, "drop", 0.1, lambda: info, republish)
        await presence.registry.set_kv_handles("w-drop", [b"handle"])
        await presence.start()
        router = Registry.from_url(redis_url, "drop")
        try:
            await router.set_drained("w-drop", True)  # `pdserve admin drain`
            await asyncio.sleep(0.35)  # beats of a registered worker put nothing back
            assert republished == [] and await router.kv_handles("w-drop") == [b"handle"]
            await router.deregister("w-drop")  # what a router's purge of it does
            assert await router.kv_handles("w-drop") == [] and not await router.live_workers()
            await _until_republished(republished)
            assert len(republished) == 1
            assert [(i.worker_id, i.draining) for i in await router.live_workers()] == \
                [("w-drop", True)]
            assert await router.kv_handles("w-drop") == [b"handle"]
        finally:
            await presence.stop()
            await router.r.aclose()

    with caplog.at_level(logging.WARNING, logger="router.presence"):
        _run(body())
    assert "worker w-drop had been dropped from the registry (a purge?)" in caplog.text


def test_a_worker_held_past_its_heartbeat_ttl_says_how_long(redis_url, caplog):
    """An event loop held past the heartbeat's TTL (a CPU-starved worker): a router purges the
    worker as stale, its next beat registers it again, and its log says how far apart the
    beats were."""
    from router.presence import WorkerPresence

    async def body():
        info = heartbeat_info("w-held")
        republished = []

        async def republish(registry: Registry) -> None:
            republished.append(True)

        presence = WorkerPresence(redis_url, "held", 0.1, lambda: info, republish)
        await presence.start()
        router = Registry.from_url(redis_url, "held", ttl_s=presence.beat_ttl_s)
        try:
            time.sleep(presence.beat_ttl_s + 0.3)  # holds the loop: no beat goes out
            assert not await router.live_workers()  # stale: the router purges it
            await _until_republished(republished)
            assert republished
            assert [i.worker_id for i in await router.live_workers()] == ["w-held"]
        finally:
            await presence.stop()
            await router.r.aclose()

    with caplog.at_level(logging.WARNING, logger="router.presence"):
        _run(body())
    assert "worker w-held had dropped out of the registry" in caplog.text
    gap = float(caplog.text.split("went through ")[1].split(" s apart")[0])
    assert gap > 1.0


@pytest.mark.parametrize("interval", [0, -1, 2.6, 6.0])
def test_a_worker_cannot_beat_slower_than_the_routers_ttl_allows(interval):
    from engine.config import EngineConfig
    from engine.worker_runtime import WorkerConfig

    engine = EngineConfig("tiny-llama", role="prefill", kv_transfer_backend="nixl")
    assert WorkerConfig(engine=engine, heartbeat_interval_s=2.5).heartbeat_interval_s == 2.5
    with pytest.raises(ValueError, match="heartbeat_interval_s"):
        WorkerConfig(engine=engine, heartbeat_interval_s=interval)


def test_liveness_goes_by_redis_clock_not_the_hosts(redis_url, monkeypatch):
    """A worker on a host whose clock runs a minute behind the router's is as live as any: its
    heartbeats are stamped, and judged, by Redis's clock."""
    real = time.time

    async def body():
        worker = Registry.from_url(redis_url, "skew")
        router = Registry.from_url(redis_url, "skew")
        try:
            monkeypatch.setattr(time, "time", lambda: real() - 60.0)  # the worker's host
            await worker.heartbeat(heartbeat_info("behind"))
            monkeypatch.setattr(time, "time", lambda: real() + 60.0)  # the router's, ahead
            assert [i.worker_id for i in await router.live_workers()] == ["behind"]
        finally:
            monkeypatch.setattr(time, "time", real)
            await worker.r.aclose()
            await router.r.aclose()

    _run(body())


class _AbortContext:
    async def abort(self, code, details="", trailing_metadata=()):  # grpc.aio's signature
        raise _Aborted(code)


class _Aborted(Exception):
    def __init__(self, code) -> None:
        self.code = code


class _Directory:
    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    async def refresh(self) -> None:
        pass


def test_a_drain_lands_only_on_a_registered_worker_and_says_what_the_routers_see(redis_url):
    """A drain racing the worker's deregistration must not leave its id drained for the next
    worker registered under it (ids are role-port); an undrain clears a flag a gone worker
    left; the reply is the worker's state as the routers see it, its own flag included."""
    from router.admin import RouterAdminServicer

    async def body():
        reg = Registry.from_url(redis_url, "t-drain")
        admin = RouterAdminServicer(_Directory(reg), RouterStats(8), None)

        async def drain(wid: str, undrain: bool = False) -> bool:
            return (await admin.DrainWorker(router_pb2.DrainWorkerRequest(
                worker_id=wid, undrain=undrain), _AbortContext())).draining

        assert not await reg.set_drained("decode-1", True)  # gone before the drain landed
        await reg.heartbeat(heartbeat_info("decode-1", "decode"))
        assert [i.draining for i in await reg.live_workers()] == [False]
        with pytest.raises(_Aborted) as err:
            await drain("nobody")
        assert err.value.code == grpc.StatusCode.NOT_FOUND
        assert await drain("decode-1") is True
        assert await drain("decode-1", undrain=True) is False
        # A worker that is shutting down says it is draining itself: an undrain cannot end that.
        stopping = heartbeat_info("decode-1", "decode")
        stopping.draining = True
        await reg.heartbeat(stopping)
        assert await drain("decode-1", undrain=True) is True
        # A flag left by a worker that is gone can be cleared; then the id is unknown again.
        await reg.r.sadd("t-drain:drained", "decode-9")
        assert await drain("decode-9", undrain=True) is False
        with pytest.raises(_Aborted):
            await drain("decode-9", undrain=True)
        # This router's own refresh failing after the drain was written: the drain stands,
        # and the admin is told so (not UNAVAILABLE, as though nothing had happened).
        await reg.heartbeat(heartbeat_info("decode-2", "decode"))

        async def refresh_fails() -> None:
            raise ConnectionError("Redis went away")

        admin.directory.refresh = refresh_fails
        assert await drain("decode-2") is True
        assert [i.draining for i in await reg.live_workers() if i.worker_id == "decode-2"] == \
            [True]
        await reg.r.aclose()

    _run(body())


def test_a_worker_started_while_redis_is_away_registers_once_it_answers(caplog):
    """The worker has loaded its model when it registers: a Redis that does not answer then
    (restarting, or started after the workers) made it exit, to load the model again. It
    serves, and registers with what it holds at the first beat that goes through."""
    from router.presence import WorkerPresence
    from router.redis_server import free_port

    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"

    async def body():
        republished = []

        async def prepare(registry: Registry) -> None:
            await registry.set_kv_handles("w-late", [b"handle"])

        async def republish(registry: Registry) -> None:
            republished.append(1)
            await prepare(registry)

        presence = WorkerPresence(url, "late", 0.1, lambda: heartbeat_info("w-late"), republish)
        await presence.start(prepare)  # nothing listens on the port yet
        try:
            with RedisServer(port=port):
                router = Registry.from_url(url, "late")
                try:
                    for _ in range(300):  # bounded: 30 s
                        if await router.live_workers():
                            break
                        await asyncio.sleep(0.1)
                    assert [w.worker_id for w in await router.live_workers()] == ["w-late"]
                    assert await router.kv_handles("w-late") == [b"handle"]
                    assert republished == [1]
                finally:
                    await router.r.aclose()
                await presence.stop()
        finally:
            await presence.stop()

    with caplog.at_level(logging.INFO, logger="router.presence"):
        _run(body())
    assert "registering in Redis failed" in caplog.text
    assert "registry entries republished (Redis answered after the worker's start)" in caplog.text


def test_a_worker_leaving_for_a_drain_keeps_its_kv_handles_until_it_stops(redis_url):
    """Its leases outlive its registration by the drain, and the decode workers pulling them
    read its KV handles (decode_svc/kv_sources.py refuses a handle its worker has not
    registered): deleted at the leave, every such pull failed and its lease ran out."""
    from router.presence import WorkerPresence

    async def body():
        presence = WorkerPresence(redis_url, "leave", 0.1,
                                  lambda: heartbeat_info("p-leave", "prefill"))

        async def prepare(registry: Registry) -> None:
            await registry.set_kv_handles("p-leave", [b"handle"])

        await presence.start(prepare)
        reader = Registry.from_url(redis_url, "leave")
        try:
            await presence.leave()
            assert [i.worker_id for i in await reader.live_workers()] == []  # not routed to
            assert await reader.kv_handles("p-leave") == [b"handle"]  # still read
            await presence.stop()
            assert await reader.kv_handles("p-leave") == []
        finally:
            await reader.r.aclose()

    _run(body())


def test_a_database_past_the_servers_count_is_refused_as_a_service_starts(redis_url, capsys,
                                                                         monkeypatch):
    """Redis refuses to SELECT a database past its `databases` setting (16 by default), on
    every connection: a router or worker started on one retried registering for good, never
    routed to nor routing. Each refuses it as it starts, before it loads its model, and so
    does pdserve up before it starts any; a server not answering yet is no error."""
    from engine.cli import main
    from router import launcher

    url = redis_url.rsplit("/", 1)[0] + "/20"
    said = f"redis_url '{url}': the Redis server has no database 20: it has 16 (0 to 15"
    with pytest.raises(ValueError) as e:
        _run(redis_database.check_redis_database(url))
    assert said in str(e.value)
    for fine in (redis_url.rsplit("/", 1)[0] + "/15", "redis://127.0.0.1:1/20"):
        assert _run(redis_database.check_redis_database(fine)) is None

    def no_start(self, *args, **kwargs):
        raise AssertionError("a service was started")

    monkeypatch.setattr(launcher.Cluster, "start", no_start)
    assert main(["up", "--redis-url", url]) == 2
    assert said in capsys.readouterr().err
    for role in ("router", "prefill", "decode"):  # each as it starts alone
        proc = subprocess.run([sys.executable, "-m", "engine.cli", role, "--model", "tiny-llama",
                               "--redis-url", url, "--port", "0"], capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert said in proc.stderr


def _serving(proc: subprocess.Popen) -> None:
    """Until ``proc`` prints its serving line (AssertionError if it exits first)."""
    for line in proc.stdout:
        if " serving on " in line:
            return
    raise AssertionError(f"exited with {proc.wait()} before serving")


# The slow tier (8 s): a Redis that comes up refusing the database; a Redis that is down,
# hangs or comes back is tests/test_serving_redis_outage.py's and test_supervisor's.
@pytest.mark.slow
def test_a_service_started_before_redis_stops_once_redis_refuses_its_database(tmp_path):
    """Redis down as the services start: their start-up check cannot ask, and they serve.
    Once Redis answers, it refuses the database on every connection, which they took for an
    outage and retried for good, logging the refusal. Each stops then as that check would
    have refused it: one error naming the URL and the server's count, `pdserve: error:` and
    status 2, no traceback."""
    port = free_port()
    url = f"redis://127.0.0.1:{port}/20"
    said = f"redis_url '{url}': the Redis server has no database 20: it has 16 (0 to 15"
    procs = {}
    try:
        for role in ("router", "prefill", "decode"):
            with open(tmp_path / role, "w") as err:
                procs[role] = subprocess.Popen(
                    [sys.executable, "-m", "engine.cli", role, "--model", "tiny-llama",
                     "--redis-url", url, "--port", "0"],
                    stdout=subprocess.PIPE, stderr=err, text=True)
        for proc in procs.values():
            _serving(proc)
        with RedisServer(port=port):
            codes = {role: proc.wait(timeout=120) for role, proc in procs.items()}
    finally:
        for proc in procs.values():
            reap(proc)
    for role, code in codes.items():
        err = (tmp_path / role).read_text()
        assert code == 2, err
        assert f"pdserve: error: {said}" in err
        assert err.count("stopping: a configuration error") == 1, err
        assert "Traceback" not in err, err
