"""What the router counts and times for a request whose path has a detour: a prefill worker
that fails before the first token, a decode worker refusing for room, a resumed request. The
router's request path in process, its workers' calls replaced by scripted legs (the cluster
tests in tests/test_serving*.py cover the same figures on plain paths)."""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import time

import grpc
import pytest

from client.liveness import WatchedCalls, rpc_error
from engine.call_abort import KV_SOURCE_FAILED, REFUSED
from protos import common_pb2, router_pb2, worker_pb2
from router import chunks as router_chunks
from router import service
from router.config import RouterConfig
from router.directory import NoWorkerError
from router.migration import RequestRun
from router.placement import Placement
from router.prompts import load_served_model
from router.stats import RouterStats

PROMPT = list(range(10, 50))


class _Worker:
    def __init__(self, worker_id: str, role: str) -> None:
        self.worker_id = worker_id
        self.calls = WatchedCalls()
        self.info = common_pb2.WorkerInfo(worker_id=worker_id, role=role)


class _Directory:
    def __init__(self) -> None:
        self.decodes = [_Worker("decode-1", "decode"), _Worker("decode-2", "decode")]

    def check_prompt_fits(self, num_tokens: int, requested_len: int = 0) -> None:
        pass

    async def pick_decode(self, num_tokens: int, avoid) -> _Worker:
        return next(d for d in self.decodes if d.worker_id not in avoid)

    async def probe(self, worker) -> bool:
        return True

    @contextlib.contextmanager
    def watched(self, worker):
        yield

    @contextlib.contextmanager
    def inflight(self, worker):
        yield

    @contextlib.contextmanager
    def in_use(self, worker):
        yield


class _Context:
    def time_remaining(self):
        return None


def _servicer(remote_prefill, prefills=None, **config) -> service.RouterServicer:
    """A router whose every request is prefilled remotely, by ``remote_prefill``'s legs, on
    the workers ``prefills`` yields (a new one each attempt by default)."""
    s = service.RouterServicer(RouterConfig(model="tiny-llama", redis_url="redis://unused",
                                            log_requests=False, **config),
                               _Directory(), load_served_model("tiny-llama", "auto", None),
                               RouterStats(8))
    if prefills is None:
        prefills = iter(_Worker(f"prefill-{i}", "prefill") for i in range(1, 10))

    async def place(hashes, num_tokens, avoid, requested_len):
        return Placement(next(prefills), None, False, 0, 0)

    s.placer.place = place
    s._remote_prefill = remote_prefill
    return s


def _request(**extra) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=PROMPT), **extra)


async def _tokens(run: RequestRun, n: int, gap_s: float):
    """``n`` tokens a leg streams, ``gap_s`` apart; the last one final."""
    for i in range(n):
        await asyncio.sleep(gap_s)
        if i == 0:
            run.timings.ttft_s = time.monotonic() - run.t0
        run.usage.completion_tokens += 1
        chunk = router_pb2.GenerateChunk(request_id=run.request_id, token_ids=[100 + i])
        if i == n - 1:
            end = worker_pb2.DecodeChunk(finish_reason="length")
            router_chunks.finish_chunk(chunk, end, run)
        yield chunk


def test_a_prefill_that_fails_before_the_first_token_is_counted_and_timed_once():
    attempts = []

    async def remote_prefill(run, request, prefill, avoid, context, counted):
        run.calls(prefill)
        attempts.append(prefill.worker_id)
        if len(attempts) == 1:
            await asyncio.sleep(0.5)  # the worker dies mid-prefill
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                       grpc.aio.Metadata(), "worker gone")
        async for chunk in _tokens(run, 2, 0.001):
            yield chunk

    s = _servicer(remote_prefill)
    req = _request(sampling=common_pb2.SamplingParams(max_tokens=2))
    out = asyncio.run(_collect(s, req))
    assert attempts == ["prefill-1", "prefill-2"] and s.stats.requests_migrated == 1
    # One request, one prompt routed and prefilled: the second attempt is the same request's.
    assert s.stats.requests_prefilled_remotely == 1
    assert s.stats.prompt_tokens_routed == len(PROMPT)
    # Its router queue is the time before the first dispatch, not the failed prefill's 0.5 s.
    t = out[-1].usage.timings
    assert t.router_queue_s < 0.25 < t.ttft_s


def test_a_refused_decode_legs_wait_counts_as_decode_queue_but_not_the_next_legs_own_time():
    s = _servicer(None)
    legs = []

    async def decode(dreq, worker, context, run):
        run.calls(worker)
        legs.append(worker.worker_id)
        if len(legs) == 1:
            raise NoWorkerError(grpc.StatusCode.RESOURCE_EXHAUSTED, "no room")
        await asyncio.sleep(1.0)  # the worker pulls for 0.8 s, queues, steps
        first = worker_pb2.DecodeChunk(token_ids=[7])
        first.timings.queue_s, first.timings.kv_transfer_s, first.timings.first_step_s = (
            0.05, 0.8, 0.1)
        router_chunks.record_first_decode_chunk(first, False, run)
        yield router_pb2.GenerateChunk(token_ids=[7])

    s._decode = decode
    run = RequestRun("r", PROMPT, time.monotonic())
    dreq = worker_pb2.DecodeRequest(prompt_token_ids=PROMPT)
    dreq.kv_handle.lease_timeout_s = 20.0

    async def body():
        chunks, _ = await s._start_decode(run, dreq, _Worker("prefill-1", "prefill"),
                                          frozenset(), _Context(), time.monotonic() + 20,
                                          service._DecodeLeg())
        await chunks.aclose()

    asyncio.run(body())
    assert legs == ["decode-1", "decode-2"] and s.stats.decode_waits == 1
    t = run.timings
    assert t.kv_transfer_s == 0.8 and t.first_decode_step_s == 0.1
    # The worker's own queue and the wait before its leg opened (a backoff of ~10 ms); not
    # the leg's pull and first step, which have their own phases.
    assert 0.05 < t.decode_queue_s < 0.5


def _resumed_run(gap_s: float):
    """A request resumed with 50 output tokens the client brought, streaming 10 more
    ``gap_s`` apart: the router and its chunks."""
    async def remote_prefill(run, request, prefill, avoid, context, counted):
        run.calls(prefill)
        async for chunk in _tokens(run, 10, gap_s):
            yield chunk

    s = _servicer(remote_prefill)
    req = _request(resume_token_ids=[7] * 50, sampling=common_pb2.SamplingParams(max_tokens=60))
    return s, asyncio.run(_collect(s, req))


def test_tpot_of_a_resumed_request_spaces_only_the_tokens_this_call_streamed():
    s, out = _resumed_run(0.01)
    usage = out[-1].usage
    assert usage.completion_tokens == 60  # the 50 the client brought count as output
    assert s.stats.tpot.count == 1
    assert s.stats.tpot.total == pytest.approx(
        (usage.timings.e2e_s - usage.timings.ttft_s) / 9)


async def _collect(s: service.RouterServicer, req) -> list[router_pb2.GenerateChunk]:
    return [c async for c in s._generate(req, _Context(), time.monotonic())]


def test_the_default_timeout_is_one_deadline_for_the_whole_request():
    """Without a client deadline, --default-timeout-s counts from the request's arrival: each
    call to a worker (and each migration) gets what is left of it, not the whole again."""
    s = service.RouterServicer(RouterConfig(model="tiny-llama", redis_url="redis://unused",
                                            log_requests=False, default_timeout_s=10.0),
                               _Directory(), load_served_model("tiny-llama", "auto", None),
                               RouterStats(8))
    run = RequestRun("r", PROMPT, time.monotonic() - 3.0)  # arrived 3 s ago
    assert 6.0 < s._timeout(_Context(), run) <= 7.0
    late = RequestRun("r", PROMPT, time.monotonic() - 10.5)
    with pytest.raises(service.RouterRejectError) as err:
        s._timeout(_Context(), late)
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_a_worker_lost_after_the_default_timeout_ends_the_request_deadline_exceeded():
    """A failure that lands once --default-timeout-s is spent moves nothing, and says so:
    UNAVAILABLE would send the client on to another router with no time left."""
    async def remote_prefill(run, request, prefill, avoid, context, counted):
        run.calls(prefill)
        yield router_pb2.GenerateChunk(request_id=run.request_id, token_ids=[100])
        await asyncio.sleep(0.4)  # decoding, while the 0.3 s default timeout runs out
        raise rpc_error(grpc.StatusCode.UNAVAILABLE, "decode worker lost")

    s = _servicer(remote_prefill, default_timeout_s=0.3)
    with pytest.raises(service.RouterRejectError) as err:
        asyncio.run(_collect(s, _request(sampling=common_pb2.SamplingParams(max_tokens=5))))
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert isinstance(err.value.__cause__, grpc.aio.AioRpcError)
    assert s.stats.requests_migrated == 0


def test_a_resumed_requests_output_is_not_counted_as_prompt_tokens():
    s, out = _resumed_run(0.001)
    # The 50 resumed tokens were counted as output where they were made.
    assert out[-1].usage.prompt_tokens == s.stats.prompt_tokens_routed == len(PROMPT)


class _CancelledContext(_Context):
    """A call the client cancels, or whose deadline passes, meanwhile."""

    def __init__(self, remaining: float | None) -> None:
        self.remaining = remaining

    def time_remaining(self):
        return self.remaining

    def done(self):
        return True

    async def write(self, msg):
        pass


@pytest.mark.parametrize("deadline", [True, False])
def test_a_request_the_client_ends_is_counted_as_failed(deadline):
    """gRPC cancels the handler at the client's deadline or cancel: a CancelledError, which
    the ``except Exception`` that counted failures never saw. Such a request was neither
    failed nor finished, and requests_total drifted from their sum."""
    async def remote_prefill(run, request, prefill, avoid, context, counted):
        run.calls(prefill)
        async for chunk in _tokens(run, 100, 0.05):  # a long generation
            yield chunk

    async def run():
        s = _servicer(remote_prefill)
        ctx = _CancelledContext(10.0 if deadline else None)
        task = asyncio.ensure_future(s.Generate(_request(
            sampling=common_pb2.SamplingParams(max_tokens=100)), ctx))
        await asyncio.sleep(0.2)
        if deadline:
            ctx.remaining = 0.0
        task.cancel()  # what grpc.aio does at the deadline and at the client's cancel
        with pytest.raises(asyncio.CancelledError):
            await task
        return s.stats

    stats = asyncio.run(run())
    assert (stats.requests_total, stats.requests_failed, sum(stats.finished.values()),
            stats.requests_in_flight) == (1, 1, 0, 0)


def test_a_prefill_cut_by_the_routers_own_cap_is_a_worker_failure_not_the_clients_deadline():
    cut = grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(),
                               grpc.aio.Metadata(), "Deadline Exceeded")
    assert service._past_prefill_cap(cut, None)  # no client deadline: only the cap ran out
    assert service._past_prefill_cap(cut, 5.0)
    assert not service._past_prefill_cap(cut, 0.0)  # the client's own deadline
    other = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                 grpc.aio.Metadata(), "gone")
    assert not service._past_prefill_cap(other, 5.0)


def test_a_local_prefills_cached_tokens_count_prompt_tokens_only():
    # A continuation's prompt and resumed output run together on the decode worker: its hits
    # may reach past the prompt, which is all usage.cached_tokens counts.
    run = RequestRun("r", PROMPT, time.monotonic(), resumed=list(range(60, 90)))
    first = worker_pb2.DecodeChunk(token_ids=[7], num_cached_tokens=64)
    router_chunks.record_first_decode_chunk(first, True, run)
    assert run.usage.cached_tokens == len(PROMPT) == 40


def test_a_continuation_finished_by_its_prefill_names_no_decode_worker():
    # Cut one token short of its end, the request's continuation ends with its prefill: the
    # usage must not name the failed attempt's decode worker as if it had finished it.
    attempts = []

    async def remote_prefill(run, request, prefill, avoid, context, counted):
        run.calls(prefill)
        attempts.append(prefill.worker_id)
        if len(attempts) == 1:
            run.usage.decode_worker_id = "decode-hung"
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                       grpc.aio.Metadata(), "worker hung")
        async for chunk in _tokens(run, 1, 0.001):
            yield chunk

    s = _servicer(remote_prefill)
    out = asyncio.run(_collect(s, _request(sampling=common_pb2.SamplingParams(max_tokens=1))))
    assert len(attempts) == 2 and out[-1].usage.migrations == 1
    assert out[-1].usage.decode_worker_id == ""


def _unavailable(message: str, refused: bool) -> grpc.aio.AioRpcError:
    return rpc_error(grpc.StatusCode.UNAVAILABLE, message, REFUSED if refused else ())


def test_a_workers_refusal_before_any_work_sends_the_request_on_without_a_migration():
    """A worker that began draining (or whose engine died) since the router last heard of it
    refuses at admission: the request goes to another worker, and no migration is spent, so
    it succeeds with --migration-limit 0 (a rolling restart's race must not fail requests)."""
    attempts, ids = [], []

    async def remote_prefill(run, request, prefill, avoid, context, counted):
        run.calls(prefill)
        attempts.append((prefill.worker_id, set(avoid)))
        ids.append(run.attempt_id)
        if len(attempts) == 1:
            raise _unavailable(f"worker {prefill.worker_id} is draining", refused=True)
        async for chunk in _tokens(run, 2, 0.001):
            yield chunk

    s = _servicer(remote_prefill, migration_limit=0)
    out = asyncio.run(_collect(s, _request(sampling=common_pb2.SamplingParams(max_tokens=2))))
    assert attempts == [("prefill-1", set()), ("prefill-2", {"prefill-1"})]
    assert [t for c in out for t in c.token_ids] == [100, 101]
    assert out[-1].usage.migrations == 0 and s.stats.requests_migrated == 0
    assert s.stats.requests_rerouted == 1
    # A new id for the new attempt (the refused one's may still be known where it went), and
    # the request counted as routed and prefilled once.
    assert len(set(ids)) == 2
    assert s.stats.requests_prefilled_remotely == 1
    assert s.stats.prompt_tokens_routed == len(PROMPT)


@pytest.mark.parametrize("refused", [True, False])
def test_a_worker_refusing_again_or_failing_spends_a_migration(refused):
    """The free move is once per worker: the same worker refusing again (the only one left)
    spends a migration, as any UNAVAILABLE that is no refusal does."""
    same = _Worker("prefill-1", "prefill")
    attempts = []

    async def remote_prefill(run, request, prefill, avoid, context, counted):
        run.calls(prefill)
        attempts.append(prefill.worker_id)
        raise _unavailable("worker prefill-1 is draining", refused=refused)
        yield  # an async generator, as the real leg is

    s = _servicer(remote_prefill, prefills=itertools.repeat(same), migration_limit=1)
    with pytest.raises(service.MigrationsSpent):
        asyncio.run(_collect(s, _request(sampling=common_pb2.SamplingParams(max_tokens=2))))
    # Refused: a free try, then one migration, then spent. Failed: one migration, then spent.
    assert len(attempts) == (3 if refused else 2)
    assert s.stats.requests_migrated == 1 and s.stats.migrations_exhausted == 1


def test_a_decode_leg_that_cannot_read_the_kv_blames_the_prefill_worker():
    """A decode worker that could not read the request's KV says its source failed: the
    continuation avoids that prefill worker (one dying is alive to a probe for a moment), and
    for its own attempt only, the decode worker that said so (another pair first)."""
    attempts = []

    async def remote_prefill(run, request, prefill, avoid, context, counted):
        run.calls(prefill)
        attempts.append(set(avoid))
        if len(attempts) == 1:
            run.calls(s.directory.decodes[0])
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "cannot read from NIXL agent 'p1'",
                            KV_SOURCE_FAILED)
        async for chunk in _tokens(run, 2, 0.001):
            yield chunk

    s = _servicer(remote_prefill)
    out = asyncio.run(_collect(s, _request(sampling=common_pb2.SamplingParams(max_tokens=2))))
    assert attempts == [set(), {"prefill-1", "decode-1"}]
    assert out[-1].usage.migrations == 1


def test_no_release_is_sent_for_a_prefill_the_worker_refused():
    """A worker that refused the Prefill (by status, or a draining worker's UNAVAILABLE marked
    as a refusal) leased nothing: the router sends it no ReleaseKV. Any other failure leaves
    it unknown, and gets one."""
    assert service._refused_by_worker(rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "full"))
    assert service._refused_by_worker(_unavailable("draining", refused=True))
    assert not service._refused_by_worker(_unavailable("engine died", refused=False))
    assert not service._refused_by_worker(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "late"))


class _DecodeCall:
    """A per-request Decode call: its chunks, then ``error`` as the call's status."""

    def __init__(self, chunks: list, error: BaseException | None) -> None:
        self.chunks, self.error, self.cancelled = chunks, error, False

    def __aiter__(self):
        return self._read()

    async def _read(self):
        for chunk in self.chunks:
            await asyncio.sleep(0)
            yield chunk
        if self.error is not None:
            raise self.error

    def cancel(self) -> bool:
        self.cancelled = True
        return True


def test_a_failure_after_the_final_chunk_moves_nothing():
    """Per-request decode calls: the status that follows the final chunk was read, and a
    failure then (the worker lost, a health-check cut) moved the finished request, which
    generated past its end."""
    s = service.RouterServicer(RouterConfig(model="tiny-llama", redis_url="redis://unused",
                                            log_requests=False, decode_stream="per-request"),
                               _Directory(), load_served_model("tiny-llama", "auto", None),
                               RouterStats(8))
    lost = rpc_error(grpc.StatusCode.UNAVAILABLE, "the worker went away")
    call = _DecodeCall([worker_pb2.DecodeChunk(token_ids=[7]),
                        worker_pb2.DecodeChunk(token_ids=[8], finish_reason="stop")], lost)
    decode = _Worker("decode-1", "decode")
    decode.decode_stub = type("Stub", (), {"Decode": lambda _self, req, timeout: call})()
    run = RequestRun("r", PROMPT, time.monotonic())

    async def read():
        legs = s._decode_chunks(worker_pb2.DecodeRequest(request_id="r"), decode, _Context(),
                                run)
        return [c async for c in legs]

    chunks = asyncio.run(read())
    assert [list(c.token_ids) for c in chunks] == [[7], [8]]
    assert chunks[-1].finish_reason == "stop"


def test_a_decode_stream_that_ends_ok_before_its_final_chunk_is_a_worker_failure():
    """The router closed the client's stream OK, the request counted finished, with part of
    its output: now the leg fails UNAVAILABLE, and the request moves as from a lost worker."""
    from router.migration import is_migratable

    s = service.RouterServicer(RouterConfig(model="tiny-llama", redis_url="redis://unused",
                                            log_requests=False, decode_stream="per-request"),
                               _Directory(), load_served_model("tiny-llama", "auto", None),
                               RouterStats(8))
    call = _DecodeCall([worker_pb2.DecodeChunk(token_ids=[7])], None)
    decode = _Worker("decode-1", "decode")
    decode.decode_stub = type("Stub", (), {"Decode": lambda _self, req, timeout: call})()
    run = RequestRun("r", PROMPT, time.monotonic())
    got = []

    async def read():
        legs = s._decode_chunks(worker_pb2.DecodeRequest(request_id="r"), decode, _Context(),
                                run)
        async for c in legs:
            got.append(list(c.token_ids))

    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(read())
    assert got == [[7]] and is_migratable(err.value)
    assert "without a finish reason" in err.value.details()


def test_the_drain_counts_a_request_still_tokenizing():
    """A large prompt tokenizes in a thread before the request is admitted: a SIGTERM then
    found the router with nothing in flight, and its stop cut the request."""
    async def remote_prefill(run, request, prefill, avoid, context, counted):
        run.calls(prefill)
        async for chunk in _tokens(run, 2, 0.001):
            yield chunk

    async def run():
        s = _servicer(remote_prefill)
        tokenized = asyncio.Event()
        real = s.model.prompt_ids_async

        async def slow(request):
            await tokenized.wait()
            return await real(request)

        s.model.prompt_ids_async = slow
        task = asyncio.ensure_future(_collect(s, _request(
            sampling=common_pb2.SamplingParams(max_tokens=2))))
        await asyncio.sleep(0.05)
        counted = (s.stats.requests_in_flight, s.num_inflight())
        tokenized.set()
        await task
        bad = asyncio.ensure_future(_collect(s, router_pb2.GenerateRequest()))  # no prompt
        with pytest.raises(ValueError):
            await bad
        return counted, s.num_inflight()

    counted, after = asyncio.run(run())
    assert counted == (0, 1) and after == 0


def test_a_request_its_decode_worker_prefills_is_listed_in_prefill_there_until_its_first_token():
    from router.directory import WorkerHandle
    from router.inflight import InflightRequest

    decode = WorkerHandle(common_pb2.WorkerInfo(worker_id="decode-1", role="decode"),
                          None, None, None)
    run = RequestRun("r1", PROMPT, time.monotonic())
    listed = InflightRequest("r1", [run], task=None, received=time.monotonic())
    assert listed.info(time.monotonic()).phase == "routing"
    run.calls(decode)
    run.usage.prefill_worker_id = run.usage.decode_worker_id = "decode-1"  # _local_prefill's
    info = listed.info(time.monotonic())
    assert (info.phase, info.prefill_worker_id, info.decode_worker_id) == \
        ("prefill", "decode-1", "decode-1")
    run.emitted.append(7)  # its first token
    info = listed.info(time.monotonic())
    assert (info.phase, info.prefill_worker_id) == ("decode", "decode-1")
