"""The router's routing view against a real redis-server: a worker that registered since the
last periodic refresh takes requests at once, and concurrent refreshes agree."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from engine.block_hash import hash_request_tokens
from protos import common_pb2, worker_pb2_grpc
from router.directory import NoWorkerError, WorkerDirectory
from router.registry import Registry
from tests.serving_helpers import heartbeat_info


def test_a_worker_registered_since_the_last_refresh_is_routed_to(redis_url):
    async def body():
        # A refresh interval far longer than the test: only the miss path can see the workers.
        d = WorkerDirectory(Registry.from_url(redis_url, "dir1"), 16, refresh_interval_s=3600)
        await d.start()
        try:
            with pytest.raises(NoWorkerError) as err:
                await d.pick_prefill(hash_request_tokens(list(range(32)), 16), 32)
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
            writer = Registry.from_url(redis_url, "dir1")
            await writer.heartbeat(heartbeat_info("p1", "prefill"))
            await writer.heartbeat(heartbeat_info("d1", "decode"))
            await writer.r.aclose()
            worker, cached = await d.pick_prefill(hash_request_tokens(list(range(32)), 16), 32)
            assert (worker.worker_id, cached) == ("p1", 0)
            assert (await d.pick_decode(33)).worker_id == "d1"
            # Many requests missing at once refresh one at a time and agree on the view.
            await asyncio.gather(*(d.refresh() for _ in range(8)))
            assert sorted(d.workers) == ["d1", "p1"]
        finally:
            await d.stop()

    asyncio.run(body())


class _DecodeInfo(worker_pb2_grpc.DecodeWorkerServicer):
    """A decode worker that reports room its last heartbeat did not show."""

    def __init__(self, info: common_pb2.WorkerInfo) -> None:
        self.info = info
        self.asked = 0

    async def GetWorkerInfo(self, request, context):
        self.asked += 1
        return self.info


def test_decode_room_is_asked_of_the_worker_before_a_refusal(redis_url):
    async def body():
        server = grpc.aio.server()
        port = server.add_insecure_port("127.0.0.1:0")
        fresh = heartbeat_info("d1", "decode", address=f"127.0.0.1:{port}", num_free_blocks=50)
        servicer = _DecodeInfo(fresh)
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
        await server.start()
        d = WorkerDirectory(Registry.from_url(redis_url, "dir2"), 16, refresh_interval_s=3600)
        writer = Registry.from_url(redis_url, "dir2")
        try:
            stale = common_pb2.WorkerInfo()
            stale.CopyFrom(fresh)
            stale.num_free_blocks = 0  # its heartbeat, taken while its blocks were in use
            await writer.heartbeat(stale)
            await d.start()
            assert (await d.pick_decode(33)).worker_id == "d1"
            assert servicer.asked == 1 and d.workers["d1"].info.num_free_blocks == 50
            assert (await d.pick_decode(33)).worker_id == "d1"
            assert servicer.asked == 1  # room known: nobody asked
            with pytest.raises(NoWorkerError) as err:  # really full: refused after asking
                await d.pick_decode(51 * 16)
            assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and servicer.asked == 2
            await server.stop(0)
            with pytest.raises(NoWorkerError):  # a worker that cannot answer keeps its view
                await d.pick_decode(51 * 16)
            assert d.workers["d1"].info.num_free_blocks == 50
        finally:
            await writer.r.aclose()
            await d.stop()
            await server.stop(0)

    asyncio.run(body())


def test_a_worker_that_fails_its_probe_gets_no_requests_until_it_returns(redis_url):
    async def body():
        server = grpc.aio.server()
        port = server.add_insecure_port("127.0.0.1:0")
        infos = [heartbeat_info(w, "decode", address=f"127.0.0.1:{port}", num_free_blocks=50)
                 for w in ("d1", "d2")]
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(_DecodeInfo(infos[0]), server)
        await server.start()
        d = WorkerDirectory(Registry.from_url(redis_url, "dir3"), 16, refresh_interval_s=3600)
        writer = Registry.from_url(redis_url, "dir3")
        try:
            for info in infos:
                await writer.heartbeat(info)
            await d.start()
            assert (await d.pick_decode(33)).worker_id == "d1"  # the tie-break
            # A request that failed on d1 prefers another worker, d1 itself being fine.
            assert (await d.pick_decode(33, avoid=frozenset({"d1"}))).worker_id == "d2"
            assert await d.probe(d.workers["d1"])
            assert (await d.pick_decode(33)).worker_id == "d1"
            # d2 answers as d1 (say, its address was reused): that is not d2 serving.
            assert not await d.probe(d.workers["d2"])
            await server.stop(0)
            # Several requests failing together share one probe; d1 no longer answers.
            assert await asyncio.gather(*(d.probe(d.workers["d1"]) for _ in range(4))) == \
                [False] * 4
            with pytest.raises(NoWorkerError) as err:
                await d.pick_decode(33)
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
            # Registered again at another address (a restart): routable at once.
            infos[1].address = "127.0.0.1:2"
            await writer.heartbeat(infos[1])
            await d.refresh()
            assert (await d.pick_decode(33)).worker_id == "d2"
            # Avoiding every candidate still routes: the avoided one is better than none.
            assert (await d.pick_decode(33, avoid=frozenset({"d2"}))).worker_id == "d2"
        finally:
            await writer.r.aclose()
            await d.stop()
            await server.stop(0)

    asyncio.run(body())


class _HungInfo(worker_pb2_grpc.DecodeWorkerServicer):
    """A worker whose info calls never answer (until released)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def GetWorkerInfo(self, request, context):
        await self.release.wait()
        return common_pb2.WorkerInfo()


def test_a_worker_registered_anew_is_probed_itself_not_by_its_predecessor_s_probe(redis_url):
    async def body():
        servers, addresses, hung = [], [], _HungInfo()
        for servicer in (hung, None):
            server = grpc.aio.server()
            port = server.add_insecure_port("127.0.0.1:0")
            addresses.append(f"127.0.0.1:{port}")
            info = heartbeat_info("d1", "decode", address=addresses[-1], num_free_blocks=50)
            worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer or _DecodeInfo(info),
                                                               server)
            await server.start()
            servers.append(server)
        d = WorkerDirectory(Registry.from_url(redis_url, "dir5"), 16, refresh_interval_s=3600)
        writer = Registry.from_url(redis_url, "dir5")
        try:
            await writer.heartbeat(heartbeat_info("d1", "decode", address=addresses[0],
                                                  num_free_blocks=50))
            await d.start()
            old = d.workers["d1"]
            old_probe = asyncio.ensure_future(d.probe(old))  # hangs on the wedged process
            await asyncio.sleep(0.1)
            # The worker restarts at another address, and a request fails on the new one.
            await writer.heartbeat(heartbeat_info("d1", "decode", address=addresses[1],
                                                  num_free_blocks=50))
            await d.refresh()
            new = d.workers["d1"]
            assert new.info.address == addresses[1] and not old_probe.done()
            assert await d.probe(new)  # its own answer, not the old one's timeout
            assert not await old_probe  # the old incarnation did not answer in time
            assert (await d.pick_decode(33)).info.address == addresses[1]
        finally:
            hung.release.set()
            await writer.r.aclose()
            await d.stop()
            for server in servers:
                await server.stop(0)

    asyncio.run(body())


def test_the_decode_worker_holding_most_of_a_prompt_is_found(redis_url):
    async def body():
        d = WorkerDirectory(Registry.from_url(redis_url, "dir4"), 16, refresh_interval_s=3600)
        writer = Registry.from_url(redis_url, "dir4")
        prompt = list(range(100, 200))  # 6 whole blocks
        hashes = hash_request_tokens(prompt, 16)
        full = heartbeat_info("d0", "decode", num_free_blocks=3)
        for info in (heartbeat_info("d1", "decode"), heartbeat_info("d2", "decode"), full,
                     heartbeat_info("p1", "prefill")):
            await writer.heartbeat(info)
        await writer.set_worker_blocks("d1", hashes[:2])
        await writer.set_worker_blocks("d2", hashes[:5])
        await writer.set_worker_blocks("d0", hashes)  # all of it, but no room for the prompt
        await writer.set_worker_blocks("p1", hashes)  # a prefill worker is not a candidate
        await d.start()
        try:
            w, cached = await d.longest_decode_prefix(hashes, len(prompt), frozenset())
            assert (w.worker_id, cached) == ("d2", 80)
            w, cached = await d.longest_decode_prefix(hashes, len(prompt), frozenset({"d2"}))
            assert (w.worker_id, cached) == ("d1", 32)
            other = hash_request_tokens(list(range(300, 400)), 16)
            assert await d.longest_decode_prefix(other, 100, frozenset()) == (None, 0)
        finally:
            await d.stop()
            await writer.r.aclose()

    asyncio.run(body())


def test_a_worker_registered_at_another_address_has_its_old_channel_closed(redis_url,
                                                                           monkeypatch):
    from grpc import ChannelConnectivity

    from router import directory

    monkeypatch.setattr(directory, "RETIRE_AFTER_S", 0.0)

    async def body():
        d = WorkerDirectory(Registry.from_url(redis_url, "dir6"), 16, refresh_interval_s=3600)
        writer = Registry.from_url(redis_url, "dir6")
        try:
            info = heartbeat_info("d1", "decode")
            await writer.heartbeat(info)
            await d.start()
            old = d.workers["d1"]
            info.address = "127.0.0.1:2"  # the worker restarted on another port
            await writer.heartbeat(info)
            await d.refresh()
            assert d.workers["d1"] is not old and d.workers["d1"].info.address == info.address
            for _ in range(100):
                await asyncio.sleep(0.01)
                if old.channel.get_state() == ChannelConnectivity.SHUTDOWN:
                    break
            assert old.channel.get_state() == ChannelConnectivity.SHUTDOWN
            assert d.workers["d1"].channel.get_state() != ChannelConnectivity.SHUTDOWN
        finally:
            await writer.r.aclose()
            await d.stop()

    asyncio.run(body())


def test_routing_picks_an_avoided_worker_with_room_over_a_refusal_and_ignores_unroutable_limits(
        redis_url):
    """A migrated request avoids the worker that failed it only while another can take it: a
    full one cannot. Ties go to the smaller id ("d1" before "d10"). The cluster's
    max_model_len is the routable workers' (a draining one's shorter limit refused prompts
    the others take)."""
    async def body():
        d = WorkerDirectory(Registry.from_url(redis_url, "dir7"), 16, refresh_interval_s=3600)
        writer = Registry.from_url(redis_url, "dir7")
        try:
            roomy, full = heartbeat_info("d10", "decode"), heartbeat_info("d2", "decode")
            full.num_free_blocks = 0
            for info in (roomy, full):
                info.max_model_len = 4096
                await writer.heartbeat(info)
            await d.refresh()
            d._ask_fresh = _no_fresh_info  # the heartbeats are the workers' own view here
            assert (await d.pick_decode(33, avoid=frozenset({"d10"}))).worker_id == "d10"
            tie = heartbeat_info("d1", "decode")
            tie.max_model_len = 4096
            await writer.heartbeat(tie)
            for wid in ("p1", "p10"):
                p = heartbeat_info(wid, "prefill")
                p.max_model_len = 4096
                await writer.heartbeat(p)
            old = heartbeat_info("p0", "prefill")
            old.max_model_len, old.draining = 256, True  # on its way out
            await writer.heartbeat(old)
            await d.refresh()
            assert (await d.pick_decode(33)).worker_id == "d1"
            worker, _ = await d.pick_prefill(hash_request_tokens(list(range(32)), 16), 32)
            assert worker.worker_id == "p1"
            assert d.max_model_len() == 4096
            d.check_prompt_fits(1000)
        finally:
            await writer.r.aclose()
            await d.stop()

    asyncio.run(body())


def test_routers_sharing_idle_workers_send_their_requests_to_different_ones(redis_url):
    """Each router counts only its own requests in flight: with one tie order shared by all,
    four routers with a request each sent all four to one prefill and one decode worker
    while the other two idled. Each router orders tied workers by its own id instead."""
    async def body():
        writer = Registry.from_url(redis_url, "dir10")
        for wid, role in (("p1", "prefill"), ("p2", "prefill"), ("d1", "decode"),
                          ("d2", "decode")):
            await writer.heartbeat(heartbeat_info(wid, role))
        routers = [WorkerDirectory(Registry.from_url(redis_url, "dir10"), 16,
                                   refresh_interval_s=3600, tie_seed=f"router-{i}")
                   for i in range(4)]
        try:
            prefills, decodes = [], []
            for d in routers:
                await d.refresh()
                worker, _ = await d.pick_prefill(hash_request_tokens(list(range(32)), 16), 32)
                prefills.append(worker.worker_id)
                decodes.append((await d.pick_decode(33)).worker_id)
            assert sorted(set(prefills)) == ["p1", "p2"], prefills
            assert sorted(set(decodes)) == ["d1", "d2"], decodes
            # A router's own order is the same at every pick: its routing stays deterministic.
            again = await routers[0].pick_prefill(hash_request_tokens(list(range(32)), 16), 32)
            assert again[0].worker_id == prefills[0]
        finally:
            await writer.r.aclose()
            for d in routers:
                await d.stop()

    asyncio.run(body())


async def _no_fresh_info(workers) -> None:
    pass


def test_a_decode_worker_whose_fresh_info_says_draining_is_not_picked(redis_url):
    """Asked for room its heartbeat did not show, a worker that answers draining (its drain
    began since the heartbeat) was picked all the same, from the list taken before asking,
    and refused the request."""
    async def body():
        server = grpc.aio.server()
        port = server.add_insecure_port("127.0.0.1:0")
        fresh = heartbeat_info("d1", "decode", address=f"127.0.0.1:{port}", num_free_blocks=50,
                               draining=True)
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(_DecodeInfo(fresh), server)
        await server.start()
        d = WorkerDirectory(Registry.from_url(redis_url, "dir-drain"), 16,
                            refresh_interval_s=3600)
        writer = Registry.from_url(redis_url, "dir-drain")
        try:
            stale = common_pb2.WorkerInfo()
            stale.CopyFrom(fresh)
            stale.num_free_blocks, stale.draining = 0, False
            await writer.heartbeat(stale)
            await d.start()
            with pytest.raises(NoWorkerError) as err:
                await d.pick_decode(33)
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
        finally:
            await writer.r.aclose()
            await d.stop()
            await server.stop(0)

    asyncio.run(body())


@pytest.mark.parametrize("threshold, ahead, local", [(1, 0, False), (1, 1, True),
                                                      (2, 1, False), (2, 2, True)])
def test_local_prefill_counts_the_requests_already_on_the_prefill_worker(
        redis_url, threshold, ahead, local):
    """The request's own in-flight count, taken at its pick, was counted as one already
    there: threshold 1 sent every short prompt to the decode worker while the prefill
    worker idled."""
    from router.config import RouterConfig
    from router.local_prefill import LocalPrefillConfig
    from router.placement import Placer

    async def body():
        ns = f"dir-local-{threshold}-{ahead}"
        writer = Registry.from_url(redis_url, ns)
        await writer.heartbeat(heartbeat_info("p1", "prefill"))
        await writer.heartbeat(heartbeat_info("d1", "decode"))
        await writer.r.aclose()
        d = WorkerDirectory(Registry.from_url(redis_url, ns), 16, refresh_interval_s=3600)
        await d.start()
        try:
            placer = Placer(RouterConfig(model="tiny-llama", redis_url=redis_url,
                                         local_prefill=LocalPrefillConfig(
                                             max_local_prefill_length=100,
                                             local_prefill_queue_threshold=threshold)), d)
            holds = [d.hold_inflight(d.workers["p1"]) for _ in range(ahead)]
            where = await placer.place([], 10, frozenset(), 0)
            assert where.local == local
            where.release_prefill()
            for release in holds:
                release()
            assert d.workers["p1"].inflight == 0
        finally:
            await d.stop()

    asyncio.run(body())


def test_a_workers_misses_start_over_with_each_busy_spell_though_a_stream_stays_open(
        redis_url):
    """A decode worker's DecodeMany stream stays registered with its calls while idle, so
    WatchedCalls.add never saw it idle: two misses of a stall long past counted with the first
    miss of the next busy spell, and three in a row cut every request on the stream."""
    async def body():
        writer = Registry.from_url(redis_url, "dir-misses")
        await writer.heartbeat(heartbeat_info("d1", "decode"))
        await writer.r.aclose()
        d = WorkerDirectory(Registry.from_url(redis_url, "dir-misses"), 16,
                            refresh_interval_s=3600)
        await d.start()
        try:
            w = d.workers["d1"]
            key, _ = w.calls.add(lambda reason: None)  # the stream, open for good
            with d.watched(w):
                w.calls.misses = 2  # a stall in this busy spell
                with d.watched(w):  # another request in the same spell
                    assert w.calls.misses == 2
            with d.watched(w):  # the next spell, hours later
                assert w.calls.misses == 0
            w.calls.remove(key)
        finally:
            await d.stop()

    asyncio.run(body())
