"""Pacing of request migration (router/migration.py): the router's services in process over a
real gRPC server and a real Redis, its workers scripted gRPC servers on loopback.

The case from a chaos soak: Redis restarted empty, and a decode worker refused the first pull
from each prefill worker ("could not read prefill worker ...'s KV handles", marked as the KV
source's failure) until the prefill workers registered again. Moved at once, each request spent
its --migration-limit within milliseconds and failed UNAVAILABLE; a short wait would have
served it. Here the refusals stop while the router waits (the decode worker recovers as the
router logs its wait: an event, not a race against a clock), so without pacing nothing ever
stops them and the request fails, and with it the request is served."""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging

import grpc
import pytest

from client.failover import MIGRATIONS_SPENT_KEY
from engine.call_abort import KV_SOURCE_FAILED
from engine.grpc_server import GrpcServer, ServerConfig
from protos import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from router.config import RouterConfig
from router.directory import WorkerDirectory
from router.liveness import LivenessConfig
from router.prompts import load_served_model
from router.registry import Registry
from router.server import SERVICE_NAMES
from router.service import RouterServicer
from router.stats import RouterStats
from tests.serving_helpers import heartbeat_info

PROMPT = list(range(10, 50))
MAX_TOKENS = 6
# Output token number i: a continuation's workers go on from len(resume_token_ids).
WANT = [200 + i for i in range(MAX_TOKENS)]
# A wait no test may sit out: a request that waited it would end at the client's deadline.
LONG_S = 600.0
_namespaces = itertools.count()


class _Prefill(worker_pb2_grpc.PrefillWorkerServicer):
    """Prefills at once: the output token a continuation is at, and a lease."""

    def __init__(self) -> None:
        self.info = common_pb2.WorkerInfo()
        self.calls: list[str] = []
        self.released: list[str] = []
        self.release_seen = asyncio.Event()

    async def Prefill(self, request, context):
        self.calls.append(request.request_id)
        return worker_pb2.PrefillResponse(
            first_token_id=WANT[len(request.resume_token_ids)],
            kv_handle=common_pb2.KVHandle(worker_id=self.info.worker_id, lease_timeout_s=60))

    async def ReleaseKV(self, request, context):
        self.released.append(request.request_id)
        self.release_seen.set()
        return worker_pb2.ReleaseKVResponse(released=True)

    async def GetWorkerInfo(self, request, context):
        return self.info


class _Decode(worker_pb2_grpc.DecodeWorkerServicer):
    """Refuses every pull while ``refusing`` (as the KV source's failure, unless
    ``source_failed`` is off), then streams the rest of the output. ``draining``: what its
    GetWorkerInfo (the router's probe) says."""

    def __init__(self, refusing: bool = False, source_failed: bool = True,
                 draining: bool = False) -> None:
        self.info = common_pb2.WorkerInfo()
        self.refusing, self.source_failed, self.draining = refusing, source_failed, draining
        self.calls: list[str] = []

    async def Decode(self, request, context):
        self.calls.append(request.request_id)
        if self.refusing:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "could not read prefill worker p1's KV handles from the registry",
                                KV_SOURCE_FAILED if self.source_failed else ())
        for i in range(len(request.resume_token_ids) + 1, MAX_TOKENS):
            yield worker_pb2.DecodeChunk(token_ids=[WANT[i]],
                                         finish_reason="length" if i == MAX_TOKENS - 1 else "")

    async def GetWorkerInfo(self, request, context):
        info = common_pb2.WorkerInfo()
        info.CopyFrom(self.info)
        info.draining = self.draining  # its heartbeat, read before, did not say so
        return info


class _Waits(logging.Handler):
    """The router's waits before a move, as it logs them: ``on_wait`` runs as each begins."""

    def __init__(self, on_wait) -> None:
        super().__init__(logging.INFO)
        self.on_wait, self.count = on_wait, 0

    def emit(self, record: logging.LogRecord) -> None:
        if "next attempt in" in record.getMessage():
            self.count += 1
            self.on_wait()


@contextlib.asynccontextmanager
async def _cluster(redis_url: str, decodes: list[_Decode], on_wait=lambda: None, **config):
    """One prefill worker, ``decodes``, registered in a fresh namespace, and a router over
    them: (its address, the prefill worker, the router's servicer, the waits it logged)."""
    ns = f"pacing-{next(_namespaces)}"
    servers = []
    prefill = _Prefill()
    writer = Registry.from_url(redis_url, ns, ttl_s=60)
    directory = WorkerDirectory(Registry.from_url(redis_url, ns, ttl_s=60), 16, 3600)
    router = GrpcServer(ServerConfig(), SERVICE_NAMES)
    waits = _Waits(on_wait)
    log = logging.getLogger("router.service")
    level = log.level
    log.setLevel(logging.INFO)
    log.addHandler(waits)
    try:
        workers = [("p1", "prefill", prefill, worker_pb2_grpc.add_PrefillWorkerServicer_to_server)]
        workers += [(f"d{i}", "decode", d, worker_pb2_grpc.add_DecodeWorkerServicer_to_server)
                    for i, d in enumerate(decodes, 1)]
        for wid, role, servicer, add in workers:
            server = grpc.aio.server()
            servers.append(server)
            add(servicer, server)
            port = server.add_insecure_port("127.0.0.1:0")
            servicer.info = heartbeat_info(wid, role, address=f"127.0.0.1:{port}",
                                           num_total_blocks=100, max_model_len=1024)
            await server.start()
            await writer.heartbeat(servicer.info, ttl_s=60)
        await directory.start()
        cfg = RouterConfig(model="tiny-llama", redis_url=redis_url, namespace=ns,
                           log_requests=False, decode_stream="per-request",
                           liveness=LivenessConfig(interval_s=0), **config)
        servicer = RouterServicer(cfg, directory, load_served_model("tiny-llama", "auto", None),
                                  RouterStats(8))
        router_pb2_grpc.add_RouterServicer_to_server(servicer, router.server)
        await router.start()
        yield router.address, prefill, servicer, waits
    finally:
        log.removeHandler(waits)
        log.setLevel(level)
        await router.server.stop(0)
        await directory.stop()
        await writer.r.aclose()
        for server in servers:
            await server.stop(0)


async def _generate(address: str, got: list[int], timeout: float | None = 30.0, started=None,
                    request_id: str = ""):
    """Streams the request, its token ids into ``got``; the final chunk, or the call's error.
    ``started``: gets the call once it is made."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = router_pb2_grpc.RouterStub(channel).Generate(router_pb2.GenerateRequest(
            request_id=request_id, token_ids=router_pb2.TokenIds(ids=PROMPT),
            sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)),
            timeout=timeout)
        if started is not None:
            started.set_result(call)
        final = None
        try:
            async for chunk in call:
                got.extend(chunk.token_ids)
                final = chunk
        except grpc.aio.AioRpcError as e:
            return e
        return final


async def _until(pred, what: str) -> None:
    for _ in range(600):  # bounded: 30 s
        if pred():
            return
        await asyncio.sleep(0.05)
    pytest.fail(f"{what}: not within 30 s")


@pytest.mark.parametrize("backoff_s", [0.0, 0.05])
def test_a_refusal_that_repeats_is_waited_out_rather_than_spending_every_migration(
        redis_url, backoff_s):
    decode = _Decode(refusing=True)

    def recovered() -> None:
        decode.refusing = False

    async def body():
        async with _cluster(redis_url, [decode], recovered,
                            migration_backoff_s=backoff_s) as (address, prefill, router, waits):
            got: list[int] = []
            end = await _generate(address, got)
            return got, end, prefill, router, waits

    got, end, prefill, router, waits = asyncio.run(body())
    if backoff_s == 0:
        # Each attempt's prefill streamed one more token; each pull was refused.
        assert isinstance(end, grpc.aio.AioRpcError), end
        assert end.code() == grpc.StatusCode.UNAVAILABLE
        assert (MIGRATIONS_SPENT_KEY, "1") in tuple(end.trailing_metadata())
        assert len(decode.calls) == 4 and router.stats.migrations_exhausted == 1
        assert got == WANT[:4] and waits.count == 0
    else:
        assert not isinstance(end, grpc.aio.AioRpcError), end
        assert got == WANT  # nothing repeated, nothing lost
        assert end.finish_reason == "length" and end.usage.migrations == 1
        assert len(decode.calls) == 2 and len(prefill.calls) == 2 and waits.count == 1
        assert len(set(decode.calls)) == 2  # each attempt its own id


def test_a_move_away_from_a_worker_that_no_longer_serves_does_not_wait(redis_url):
    """A decode worker that failed the stream and whose probe says it is draining is skipped
    by every request: the move to the other one goes at once, however long the backoff."""
    leaving = _Decode(refusing=True, source_failed=False, draining=True)
    other = _Decode()

    async def body():
        async with _cluster(redis_url, [leaving, other],
                            migration_backoff_s=LONG_S) as (address, prefill, router, waits):
            # d1 first: the workers tie, and their ids break it.
            got: list[int] = []
            end = await _generate(address, got)
            return got, end, waits

    got, end, waits = asyncio.run(body())
    assert not isinstance(end, grpc.aio.AioRpcError), end
    assert got == WANT and end.usage.migrations == 1 and end.usage.decode_worker_id == "d2"
    assert len(leaving.calls) == 1 and len(other.calls) == 1 and waits.count == 0


def test_the_move_after_a_pull_refused_as_its_sources_failure_tries_another_decode_worker(
        redis_url):
    """The failure is blamed on the prefill worker, which the next attempt avoids; with it the
    decode worker that refused, so a decode worker that refuses every pull (its view of the
    prefill workers' keys lost with Redis) does not take each move in turn."""
    stuck, other = _Decode(refusing=True), _Decode()

    async def body():
        async with _cluster(redis_url, [stuck, other], migration_backoff_s=0,
                            migration_limit=1) as (address, prefill, router, waits):
            got: list[int] = []
            return got, await _generate(address, got)

    got, end = asyncio.run(body())
    assert not isinstance(end, grpc.aio.AioRpcError), end
    assert got == WANT and end.usage.migrations == 1 and end.usage.decode_worker_id == "d2"
    assert len(stuck.calls) == 1 and len(other.calls) == 1


def _nothing_held(router: RouterServicer) -> bool:
    return (router.num_inflight() == 0 and len(router.inflight) == 0
            and all(w.inflight == 0 and w.users == 0
                    for w in router.directory.workers.values()))


@pytest.mark.parametrize("whose", ["client", "operator"])
def test_a_cancel_during_the_wait_ends_the_request_at_once_holding_nothing(redis_url, whose):
    """The client's cancel, or the operator's (RouterAdmin.CancelRequest's)."""
    decode = _Decode(refusing=True)

    async def body():
        waiting = asyncio.Event()
        async with _cluster(redis_url, [decode], waiting.set,
                            migration_backoff_s=LONG_S) as (address, prefill, router, waits):
            started = asyncio.get_running_loop().create_future()
            got: list[int] = []
            stream = asyncio.ensure_future(_generate(address, got, started=started,
                                                     request_id="paced"))
            await asyncio.wait([asyncio.ensure_future(waiting.wait()), stream],
                               return_when=asyncio.FIRST_COMPLETED)
            assert waiting.is_set(), f"the request ended without waiting: {stream.result()}"
            if whose == "client":
                (await started).cancel()
                with pytest.raises(asyncio.CancelledError):  # grpc.aio's end of a cancel
                    await stream
            else:
                assert router.inflight.cancel("paced")
                end = await stream
                assert isinstance(end, grpc.aio.AioRpcError), end
                assert end.code() == grpc.StatusCode.CANCELLED
                assert "operator" in end.details()
            await _until(lambda: _nothing_held(router), "the router let go of the request")
            # The failed attempt's lease is released, not left to expire.
            await asyncio.wait_for(prefill.release_seen.wait(), 30)
            return got, prefill, router

    got, prefill, router = asyncio.run(body())
    assert got == WANT[:1]
    assert len(prefill.calls) == 1 and len(decode.calls) == 1
    assert prefill.released == prefill.calls
    assert router.stats.requests_failed == 1 and router.stats.requests_migrated == 0


@pytest.mark.parametrize("whose", ["client", "router"])
def test_a_deadline_during_the_wait_ends_the_request_deadline_exceeded(redis_url, whose):
    """The client's deadline, or the router's --default-timeout-s for a client that set none:
    the wait is cut there, and no other attempt is made."""
    decode = _Decode(refusing=True)
    config = {"default_timeout_s": 1.0} if whose == "router" else {}

    async def body():
        async with _cluster(redis_url, [decode], migration_backoff_s=LONG_S,
                            **config) as (address, prefill, router, waits):
            got: list[int] = []
            end = await _generate(address, got, timeout=1.0 if whose == "client" else None)
            await _until(lambda: _nothing_held(router), "the router let go of the request")
            return got, end, prefill, router, waits

    got, end, prefill, router, waits = asyncio.run(body())
    assert isinstance(end, grpc.aio.AioRpcError), end
    assert end.code() == grpc.StatusCode.DEADLINE_EXCEEDED, end.details()
    assert got == WANT[:1] and waits.count == 1
    assert len(prefill.calls) == 1 and len(decode.calls) == 1
    assert router.stats.requests_failed == 1 and router.stats.requests_migrated == 0


@pytest.mark.parametrize("value", [-1, float("inf"), float("nan"), True, "0.2"])
def test_a_bad_migration_backoff_is_refused(value):
    with pytest.raises(ValueError, match="migration_backoff_s"):
        RouterConfig(model="tiny-llama", redis_url="redis://localhost:6379",
                     migration_backoff_s=value)


def test_the_migration_backoff_flag_reaches_the_config():
    import argparse

    from engine.cli_serve import _router_config, add_router_args

    p = argparse.ArgumentParser()
    add_router_args(p)
    args = p.parse_args(["--redis-url", "redis://x"])
    assert args.migration_backoff_s == \
        RouterConfig(model="m", redis_url="redis://x").migration_backoff_s
    args = p.parse_args(["--redis-url", "redis://x", "--migration-backoff-s", "0"])
    args.model = "tiny-llama"
    assert _router_config(args).migration_backoff_s == 0
