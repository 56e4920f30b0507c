"""DecodeMany: many requests on one stream to a real decode worker (decode_svc/mux.py), and the
router's end of it (router/decode_mux.py).

The requests are local prefills (the decode worker runs the prompt itself), so a decode worker
alone serves them; the cluster is an aggregated one (no prefill worker). The cluster tests in
test_serving*.py drive the same stream through the router, KV pulls and migration included.
"""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc

import grpc
import pytest

from client import Client
from engine import SamplingParams
from protos import router_pb2, worker_pb2, worker_pb2_grpc
from router.decode_mux import DecodeMux
from router.launcher import Cluster, ClusterSpec
from tests.decode_stream import DecodeStream as _Stream
from tests.decode_stream import ended as _ended
from tests.decode_stream import local_request as _request
from tests.decode_stream import start as _start
from tests.serving_helpers import (WORKER_ARGS, decisive_prompts, explain_greedy_mismatch,
                                   free_port, parse_metrics, random_prompts, scrape,
                                   wait_all_blocks_free)

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster():
    with Cluster(ClusterSpec(num_prefill=0, worker_args=WORKER_ARGS)) as c:
        yield c


def _decode_address(cluster) -> str:
    return next(p.address for p in cluster.procs if p.name.startswith("decode"))


def _tokens(events: list[worker_pb2.DecodeEvent]) -> list[int]:
    return [t for ev in events for t in ev.chunk.token_ids]


def test_requests_on_one_stream_match_the_in_process_engine_and_share_messages(cluster,
                                                                                 reference):
    max_tokens = [12, 20, 16, 9, 24, 14]
    prompts = decisive_prompts(reference, 6, seed=71, max_tokens=max_tokens, lo=10, hi=60)
    want = reference.generate(prompts, [SamplingParams(max_tokens=m, **GREEDY)
                                        for m in max_tokens])
    assert len({tuple(w.token_ids) for w in want}) == len(want)  # diverse outputs

    async def run():
        s = _Stream(_decode_address(cluster))
        for i, (p, m) in enumerate(zip(prompts, max_tokens)):
            s.send(_start(_request(f"r{i}", p, m)))
        s.close_sending()  # the worker ends the stream once every request is done
        by_rid = await s.read_until(lambda _: False)
        await s.close()
        return s.batches, by_rid

    batches, by_rid = asyncio.run(run())
    for i, w in enumerate(want):
        events = by_rid[f"r{i}"]
        assert _tokens(events) == w.token_ids, \
            explain_greedy_mismatch(reference, prompts[i], _tokens(events), w.token_ids)
        assert "".join(ev.chunk.text_delta for ev in events) == w.text
        assert events[-1].chunk.finish_reason == "length"
        assert events[0].chunk.HasField("timings")
    # One engine step's outputs for several requests travel in one message.
    assert max(len(b.events) for b in batches) >= 2
    assert len(batches) < sum(len(b.events) for b in batches)
    wait_all_blocks_free([_decode_address(cluster)])


@pytest.mark.parametrize("start, code, match", [
    (_start(_request("", [1, 2, 3], 4)), grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty"),
    (_start(_request("bad-vocab", [1, 99999999], 4)), grpc.StatusCode.INVALID_ARGUMENT,
     "outside the vocabulary"),
    (_start(_request("bad-timeout", [1, 2, 3], 4), timeout_s=-1.0),
     grpc.StatusCode.INVALID_ARGUMENT, "timeout_s must be"),
    (_start(_request("bad-timeout", [1, 2, 3], 4), timeout_s=float("nan")),
     grpc.StatusCode.INVALID_ARGUMENT, "timeout_s must be"),
    (_start(_request("bad-handle", [1, 2, 3], 4, first_token_id=5)),
     grpc.StatusCode.INVALID_ARGUMENT, "must not carry a first_token_id"),
    (_start(_request("bad-interval", [1, 2, 3], 4, stream_interval=2000)),
     grpc.StatusCode.INVALID_ARGUMENT, "stream_interval must be an integer in [1, 1024], got 2000"),
    (_start(_request("slow", list(range(10, 400)), 200), timeout_s=0.05),
     grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded"),
])
def test_a_failing_request_ends_alone_with_its_status(cluster, reference, start, code, match):
    prompt = decisive_prompts(reference, 1, seed=72, max_tokens=10, lo=30, hi=30)[0]
    want = reference.generate([prompt], SamplingParams(max_tokens=10, **GREEDY))[0]
    bad = start.start.request.request_id

    async def run():
        s = _Stream(_decode_address(cluster))
        s.send(_start(_request("good", prompt, 10)))
        s.send(start)
        s.close_sending()
        by_rid = await s.read_until(lambda _: False)
        await s.close()
        return by_rid

    by_rid = asyncio.run(run())
    (err,) = by_rid[bad]
    assert err.error.code == code.value[0] and match in err.error.message
    assert _tokens(by_rid["good"]) == want.token_ids
    wait_all_blocks_free([_decode_address(cluster)])


def test_a_duplicate_request_id_is_refused_and_the_first_goes_on(cluster, reference):
    prompt = decisive_prompts(reference, 1, seed=73, max_tokens=30, lo=30, hi=30)[0]
    want = reference.generate([prompt], SamplingParams(max_tokens=30, **GREEDY))[0]

    async def run():
        s = _Stream(_decode_address(cluster))
        s.send(_start(_request("dup", prompt, 30)))
        s.send(_start(_request("dup", [1, 2, 3], 4)))
        s.close_sending()
        by_rid = await s.read_until(lambda _: False)
        await s.close()
        return by_rid["dup"]

    events = asyncio.run(run())
    errors = [ev for ev in events if ev.HasField("error")]
    assert len(errors) == 1 and "already running on this stream" in errors[0].error.message
    assert _tokens(events) == want.token_ids, \
        explain_greedy_mismatch(reference, prompt, _tokens(events), want.token_ids)
    wait_all_blocks_free([_decode_address(cluster)])


def test_cancel_aborts_one_request_and_frees_its_blocks(cluster, reference):
    prompts = decisive_prompts(reference, 2, seed=74, max_tokens=[1, 40], lo=40, hi=40)
    want = reference.generate([prompts[1]], SamplingParams(max_tokens=40, **GREEDY))[0]

    async def run():
        s = _Stream(_decode_address(cluster))
        s.send(_start(_request("cut", prompts[0], 900)))
        s.send(_start(_request("kept", prompts[1], 40)))
        await s.read_until(lambda by: len(by.get("cut", [])) >= 3)
        s.send(worker_pb2.DecodeControl(cancel="cut"))
        s.send(worker_pb2.DecodeControl(cancel="never-started"))  # ignored
        by_rid = await s.read_until(lambda by: _ended(by.get("kept", [])))
        await s.close()
        return by_rid

    by_rid = asyncio.run(run())
    assert _tokens(by_rid["kept"]) == want.token_ids, \
        explain_greedy_mismatch(reference, prompts[1], _tokens(by_rid["kept"]), want.token_ids)
    assert not any(ev.chunk.finish_reason or ev.HasField("error") for ev in by_rid.get("cut", []))
    wait_all_blocks_free([_decode_address(cluster)])


def test_dropping_the_stream_aborts_every_request_on_it(cluster):
    prompts = random_prompts(3, seed=75, lo=20, hi=50)

    async def run():
        s = _Stream(_decode_address(cluster))
        for i, p in enumerate(prompts):
            s.send(_start(_request(f"d{i}", p, 900)))
        await s.read_until(lambda by: len(by) == 3)
        await s.close()  # the router went away: no half-close, the call is cancelled

    asyncio.run(run())
    wait_all_blocks_free([_decode_address(cluster)])


def _heartbeat(interval_s: float, misses: int = 3) -> worker_pb2.DecodeControl:
    return worker_pb2.DecodeControl(
        heartbeat=worker_pb2.DecodeHeartbeat(interval_s=interval_s, misses=misses))


def test_a_caller_that_stops_its_heartbeats_is_taken_as_hung(cluster, reference):
    """A router that hangs keeps its stream open and silent: once `misses` heartbeat intervals
    pass without a control message, the worker aborts the stream's requests (blocks freed) and
    ends it, instead of decoding for nobody. A caller that keeps beating keeps its requests."""
    prompts = decisive_prompts(reference, 2, seed=78, max_tokens=[1, 200], lo=20, hi=40)
    want = reference.generate([prompts[1]], SamplingParams(max_tokens=200, **GREEDY))[0]

    async def run():
        hung, kept = _Stream(_decode_address(cluster)), _Stream(_decode_address(cluster))
        # The kept caller may miss 2 s of beats: starved by other load on the host, this
        # process can send none for 0.6 s (3 intervals), and the worker then rightly takes
        # its stream as hung (likely session 48's lone miss here, logged without detail).
        for s, rid, prompt, n, misses in ((hung, "h", prompts[0], 900, 3),
                                          (kept, "k", prompts[1], 200, 10)):
            s.send(_heartbeat(0.2, misses))
            s.send(_start(_request(rid, prompt, n)))

        async def beat():
            while True:
                await asyncio.sleep(0.1)
                kept.send(_heartbeat(0.2, 10))

        beating = asyncio.ensure_future(beat())
        # The hung caller's stream ends on its own: read_until returns at the stream's end.
        hung_events = await asyncio.wait_for(hung.read_until(lambda by: False), 60)
        kept_events = await kept.read_until(lambda by: _ended(by.get("k", [])))
        beating.cancel()
        await hung.close()
        await kept.close()
        return hung_events, kept_events

    hung_events, kept_events = asyncio.run(run())
    assert hung_events.get("h")  # it had started decoding
    assert not any(ev.chunk.finish_reason or ev.HasField("error") for ev in hung_events["h"])
    # 200 tokens: many intervals long
    assert _tokens(kept_events["k"]) == want.token_ids, \
        explain_greedy_mismatch(reference, prompts[1], _tokens(kept_events["k"]), want.token_ids)
    wait_all_blocks_free([_decode_address(cluster)])


# --- the router's end ---------------------------------------------------------------------
def test_router_mux_streams_cancels_and_times_out(cluster, reference):
    prompts = decisive_prompts(reference, 3, seed=76, max_tokens=15, lo=20, hi=50)
    want = reference.generate(prompts, SamplingParams(max_tokens=15, **GREEDY))

    async def run():
        channel = grpc.aio.insecure_channel(_decode_address(cluster))
        mux = DecodeMux(worker_pb2_grpc.DecodeWorkerStub(channel), "decode-under-test")

        async def collect(i: int) -> list[int]:
            return [t async for c in mux.decode(_request(f"m{i}", prompts[i], 15), 60.0)
                    for t in c.token_ids]

        got = await asyncio.gather(*(collect(i) for i in range(3)))
        # Leaving after the first chunk cancels the request on the worker.
        chunks = mux.decode(_request("left", prompts[0], 900), 60.0)
        first = await anext(chunks)
        await chunks.aclose()
        # The deadline ends a request that runs longer with DEADLINE_EXCEEDED.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in mux.decode(_request("late", list(range(10, 400)), 300), 0.3):
                pass
        # A worker-side failure arrives as the status a Decode call would end with.
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            async for _ in mux.decode(_request("bad", [1, 99999999], 4), 60.0):
                pass
        n_open = mux.num_requests
        await mux.close()
        await channel.close()
        return got, first, err.value, bad.value, n_open

    got, first, err, bad, n_open = asyncio.run(run())
    assert got == [w.token_ids for w in want]
    assert list(first.token_ids) == want[0].token_ids[:1]
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "outside the vocabulary" in bad.details()
    assert n_open == 0
    wait_all_blocks_free([_decode_address(cluster)])


@contextlib.asynccontextmanager
async def _played_worker(servicer, name: str):
    """A plain gRPC server running ``servicer`` as a decode worker, and the router's mux to it:
    yields ``one(request_id)``, the error that request's decode ends with."""
    server = grpc.aio.server()
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    mux = DecodeMux(worker_pb2_grpc.DecodeWorkerStub(channel), name)

    async def one(rid: str) -> grpc.aio.AioRpcError:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in mux.decode(_request(rid, [1, 2, 3], 4), 30.0):
                pass
        return e.value

    try:
        yield one
    finally:
        await mux.close()
        await channel.close()
        await server.stop(0)


def test_router_mux_fails_open_requests_with_unavailable_when_the_stream_breaks(cluster):
    """A decode worker that goes away under the stream: every request on it gets UNAVAILABLE
    (which migrates them), and the next request opens a new stream. Stopping the worker would
    take the module's cluster down, so a plain gRPC server that accepts the stream and dies
    plays the worker."""

    class Dying(worker_pb2_grpc.DecodeWorkerServicer):
        async def DecodeMany(self, request_iterator, context):
            async for _ in request_iterator:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "going away")

    async def run():
        async with _played_worker(Dying(), "dying") as one:
            first = await asyncio.gather(*(one(f"x{i}") for i in range(3)))
            again = await one("x9")  # a new stream after the broken one
        return first + [again]

    errors = asyncio.run(run())
    assert [e.code() for e in errors] == [grpc.StatusCode.UNAVAILABLE] * 4
    assert all("decode worker dying" in e.details() for e in errors)


def test_a_backlog_leaves_in_batches_of_bounded_size(monkeypatch):
    """Events that piled up while the caller did not read go out in several messages, in
    order, none over the cap (gRPC refuses messages over its size limit)."""
    from decode_svc import mux

    monkeypatch.setattr(mux, "MAX_EVENTS_PER_BATCH", 2)

    async def run():
        m = mux._DecodeMux(servicer=None)
        for i in range(5):
            m._fail(f"r{i}", ValueError(f"bad {i}"))
        m.reading = False  # the caller half-closed and nothing runs: the stream then ends
        return [[ev.request_id for ev in b.events] async for b in m.batches()]

    assert asyncio.run(run()) == [["r0", "r1"], ["r2", "r3"], ["r4"]]


def test_a_backlog_batch_of_many_events_is_split_to_the_message_limit(monkeypatch):
    """A backlog's first MAX_EVENTS_PER_BATCH events can be over gRPC's message limit by
    themselves (first chunks with prompt logprobs): they are split by bytes as well, or the
    message failed the stream of every request on it."""
    from decode_svc import mux

    monkeypatch.setattr(mux, "MAX_EVENTS_PER_BATCH", 4)
    monkeypatch.setattr(mux, "_message_limit", lambda: 3000)

    async def run():
        m = mux._DecodeMux(servicer=None)
        for i in range(6):
            m._fail(f"r{i}", ValueError("x" * 1000))  # each event ~1 KB
        m.reading = False
        return [b async for b in m.batches()]

    batches = asyncio.run(run())
    assert all(b.ByteSize() <= 3000 for b in batches)
    assert [ev.request_id for b in batches for ev in b.events] == [f"r{i}" for i in range(6)]


def test_a_request_cancelled_right_after_its_start_does_not_hold_the_stream_open():
    """A cancel read in the same tick as its start cancels a task that never ran: it must not
    stay listed, or the stream would not end when its caller half-closes it."""
    from decode_svc import mux

    async def controls():  # no await between them: one tick of the reader
        yield _start(_request("r1", [5, 6, 7], 4))
        yield worker_pb2.DecodeControl(cancel="r1")

    async def run():
        m = mux._DecodeMux(servicer=None)  # never reached: the request never runs
        await m.read(controls())
        async with asyncio.timeout(10):
            batches = [b async for b in m.batches()]
        return m, batches

    m, batches = asyncio.run(run())
    assert m.tasks == {} and batches == []


def test_a_worker_whose_own_loop_stalled_hears_the_caller_out_before_judging_it():
    """A stall of the worker's loop (a starved process) past the caller's heartbeat limit must
    not take a caller whose heartbeats are waiting behind it as hung: the watch wakes first,
    the heartbeat is read a loop turn or two later (as gRPC delivers it). A caller that is
    silent for good is still taken as hung, one interval later."""
    import time

    from decode_svc import mux

    async def run():
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue = asyncio.Queue()

        async def controls():
            while (ctl := await inbox.get()) is not None:
                yield ctl

        m = mux._DecodeMux(servicer=None)
        reader = asyncio.ensure_future(m.read(controls()))
        inbox.put_nowait(_heartbeat(0.05, misses=2))  # silent past 0.1 s: hung
        await asyncio.sleep(0.01)
        watch = asyncio.ensure_future(m.watch_caller())
        await asyncio.sleep(0.01)

        sent = []  # when the caller's heartbeat behind the stall reached the worker

        def deliver() -> None:
            sent.append(loop.time())
            inbox.put_nowait(_heartbeat(0.05, misses=2))

        def stall():
            time.sleep(0.3)  # the worker's loop: blocked past the caller's limit
            # The caller's heartbeat, sent meanwhile, is read a turn after the watch wakes.
            loop.call_soon(loop.call_soon, deliver)

        judged = []  # when the worker last heard the caller, as of its judgment
        abort_all = m.cancel_all

        def judge() -> None:  # the watch aborts the stream's requests as it judges
            judged.append(m.heard)
            abort_all()

        m.cancel_all = judge
        loop.call_soon(stall)
        await asyncio.wait_for(watch, 10)  # the caller is silent for good after that beat
        inbox.put_nowait(None)
        await reader
        return sent, judged, m.reading

    sent, judged, reading = asyncio.run(run())
    assert not reading  # taken as hung in the end
    assert judged[0] >= sent[0]  # but only once it had heard the beat behind the stall


def test_a_caller_beating_on_time_is_never_judged_hung_even_allowed_one_miss():
    """A caller beats every interval, so it is silent for up to one interval at any time:
    with misses 1 the worker allowed exactly that, each beat raced the check, and a live
    router's stream (every request on it) was cut within an interval or two."""
    from decode_svc import mux

    async def run():
        inbox: asyncio.Queue = asyncio.Queue()

        async def controls():
            while (ctl := await inbox.get()) is not None:
                yield ctl

        m = mux._DecodeMux(servicer=None)
        judged = []
        m.cancel_all = lambda: judged.append(True)
        reader = asyncio.ensure_future(m.read(controls()))
        watch = asyncio.ensure_future(m.watch_caller())
        for _ in range(6):  # a router's beats, each a quarter interval late (a busy loop)
            inbox.put_nowait(_heartbeat(0.4, misses=1))
            await asyncio.sleep(0.5)
        alive = not judged and not watch.done()
        inbox.put_nowait(None)
        await reader
        await asyncio.wait_for(watch, 10)
        return alive

    assert asyncio.run(run())


def test_refusing_an_id_near_the_message_limit_never_makes_an_event_over_it(monkeypatch):
    """The refusal echoes the id with its message: for an id near gRPC's message limit, the
    event was over it, and gRPC failed the whole stream (every request on it)."""
    from decode_svc import mux

    monkeypatch.setattr(mux, "_message_limit", lambda: 4096)

    async def refused() -> list:
        m = mux._DecodeMux(servicer=None)
        for n in (2000, 4060, 4080, 5000):
            start = worker_pb2.DecodeStart(request=worker_pb2.DecodeRequest(request_id="x" * n))
            if start.ByteSize() + 8 > 4096:
                continue  # no caller could send it
            m._start(start)
        return list(m.pending.events)

    events = asyncio.run(refused())
    assert events and all(ev.ByteSize() + mux._EVENT_FRAMING_BYTES <= 4096 for ev in events)
    assert [len(ev.request_id) for ev in events][0] == 2000
    assert "at most" in events[0].error.message  # a short id's refusal keeps its message


# --- the router's --stream-interval ---------------------------------------------------------
def _chunk(tokens, text="", finish=""):
    c = router_pb2.GenerateChunk(token_ids=tokens, text_delta=text, finish_reason=finish)
    if finish:
        c.usage.completion_tokens = 99
    return c


def test_every_n_tokens_sends_the_first_at_once_then_groups_with_the_final_merged():
    from protos.stream_interval import every_n_tokens

    async def source(chunks, fail=False):
        for c in chunks:
            yield c
        if fail:
            raise RuntimeError("worker gone")

    async def collect(chunks, n, fail=False):
        out = []
        with contextlib.suppress(RuntimeError):
            async for c in every_n_tokens(source(chunks, fail), n):
                out.append(c)
        return out

    chunks = [_chunk([i], str(i)) for i in range(7)] + [_chunk([7], "7", "length")]
    out = asyncio.run(collect(chunks, 3))
    assert [list(c.token_ids) for c in out] == [[0], [1, 2, 3], [4, 5, 6], [7]]
    assert [c.text_delta for c in out] == ["0", "123", "456", "7"]
    assert out[-1].finish_reason == "length" and out[-1].usage.completion_tokens == 99
    out = asyncio.run(collect([_chunk([i]) for i in range(5)] + [_chunk([5], "", "stop")], 4))
    assert [list(c.token_ids) for c in out] == [[0], [1, 2, 3, 4], [5]]
    # Held tokens go out before the error, so a client failing over resumes from all of them.
    out = asyncio.run(collect([_chunk([i]) for i in range(3)], 4, fail=True))
    assert [list(c.token_ids) for c in out] == [[0], [1, 2]]


def test_a_router_with_a_stream_interval_sends_the_same_tokens_in_fewer_chunks(cluster,
                                                                                 reference):
    port = free_port()
    router = cluster.start_router(extra=["--stream-interval", "4", "--metrics-port", str(port)])
    prompts = decisive_prompts(reference, 3, seed=77, max_tokens=14, lo=20, hi=40)
    want = reference.generate(prompts, SamplingParams(max_tokens=14, **GREEDY))
    try:
        with Client(router.address, timeout=60) as c:
            for p, w in zip(prompts, want):
                chunks = list(c.generate(p, max_tokens=14, **GREEDY))
                assert [len(ch.token_ids) for ch in chunks] == [1, 4, 4, 4, 1]
                got = [t for ch in chunks for t in ch.token_ids]
                assert got == w.token_ids, \
                    explain_greedy_mismatch(reference, p, got, w.token_ids)
                assert "".join(ch.text for ch in chunks) == w.text
                assert chunks[-1].usage.completion_tokens == 14
        # The router passed the interval down: the decode worker sent 5 messages a request,
        # not 14.
        metrics = parse_metrics(scrape(port)[2])
        assert metrics[("pdserve_router_decode_chunks_received_total", frozenset())] == 3 * 5
        assert metrics[("pdserve_router_generation_tokens_total", frozenset())] == 3 * 14
    finally:
        assert cluster.stop_proc(router) == 0


def test_a_decode_worker_groups_its_chunks_by_the_requests_stream_interval(cluster, reference):
    # The router passes its --stream-interval down, so the worker -> router hop shrinks too:
    # on DecodeMany and on a Decode call of its own alike.
    prompts = decisive_prompts(reference, 2, seed=79, max_tokens=14, lo=20, hi=40)
    want = reference.generate(prompts, SamplingParams(max_tokens=14, **GREEDY))

    async def many():
        s = _Stream(_decode_address(cluster))
        s.send(_start(_request("grouped", prompts[0], 14, stream_interval=4)))
        s.close_sending()
        events = (await s.read_until(lambda _: False))["grouped"]
        await s.close()
        return [ev.chunk for ev in events]

    async def single():
        async with grpc.aio.insecure_channel(_decode_address(cluster)) as ch:
            call = worker_pb2_grpc.DecodeWorkerStub(ch).Decode(
                _request("grouped-1", prompts[1], 14, stream_interval=4), timeout=60)
            return [c async for c in call]

    for chunks, w, p in ((asyncio.run(many()), want[0], prompts[0]),
                         (asyncio.run(single()), want[1], prompts[1])):
        assert [len(c.token_ids) for c in chunks] == [1, 4, 4, 4, 1]
        got = [t for c in chunks for t in c.token_ids]
        assert got == w.token_ids, explain_greedy_mismatch(reference, p, got, w.token_ids)
        assert "".join(c.text_delta for c in chunks) == w.text
        assert [len(c.logprobs) for c in chunks] == [0] * 5  # none asked, none merged in
        assert chunks[0].HasField("timings") and chunks[-1].finish_reason == "length"
    wait_all_blocks_free([_decode_address(cluster)])


def test_a_cancelled_stream_with_held_tokens_stays_cancelled():
    """A client cancel or deadline (CancelledError) while tokens are held must end the stream:
    flushing them then would swallow the cancel."""
    from protos.stream_interval import every_n_tokens

    async def source():
        for i in range(3):
            yield _chunk([i])
        await asyncio.Event().wait()  # the worker is slow: the next token never comes

    async def run():
        out = every_n_tokens(source(), 4)
        assert list((await anext(out)).token_ids) == [0]
        pending = asyncio.ensure_future(anext(out))  # holds [1, 2], waits for more
        await asyncio.sleep(0.05)
        pending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending

    asyncio.run(run())


def test_a_draining_worker_ends_its_open_streams_cleanly(cluster, reference, capfd):
    # The router keeps a DecodeMany stream open on every decode worker, idle or not. A worker
    # stopping must end it (OK) once its requests are done, not leave it for the server's stop
    # to cut (the caller saw CANCELLED, and the worker logged a traceback for every stream).
    prompt = decisive_prompts(reference, 1, seed=74, max_tokens=8, lo=20, hi=40)[0]
    want = reference.generate([prompt], SamplingParams(max_tokens=8, **GREEDY))[0]
    worker = cluster.add_worker("decode")

    async def run():
        s = _Stream(worker.address)
        s.send(_start(_request("before-stop", prompt, 8)))
        by_rid = await s.read_until(lambda got: _ended(got.get("before-stop", [])))
        assert _tokens(by_rid["before-stop"]) == want.token_ids
        # The stream stays open, as the router's does; now the worker is told to stop.
        stop = asyncio.get_running_loop().run_in_executor(None, cluster.stop_proc, worker)
        await asyncio.wait_for(s.read_until(lambda _: False), timeout=60)
        code = await s.call.code()
        await s.close()
        return code, await stop, s.batches[-1]

    code, exit_code, last = asyncio.run(run())
    assert code == grpc.StatusCode.OK
    assert exit_code == 0
    # Its last message says that a start sent from now on will not be read.
    assert last.closing and not last.events
    err = capfd.readouterr().err
    assert "stopping: draining" in err  # the worker's own log reached this capture
    assert "Exception not handled" not in err and "Traceback" not in err


def test_starts_a_draining_worker_refuses_are_flagged_as_refusals(cluster, reference):
    """A start that reaches a worker already draining is refused before any work, and says so
    (DecodeError.refused): the router then sends it elsewhere without spending a migration.
    A request that fails (here a bad one) is not flagged."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    prompt = random_prompts(1, seed=75, lo=20, hi=20)[0]
    worker = cluster.add_worker("decode")

    async def serving(channel) -> bool:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10)
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def run():
        s = _Stream(worker.address)
        # A long request keeps the drain (and so the stream) open while the late one arrives.
        s.send(_start(_request("holder", prompt, 900)))
        s.send(_start(_request("bad-vocab", [1, 99999999], 4)))
        await s.read_until(lambda got: len(got.get("holder", [])) >= 2 and "bad-vocab" in got)
        stop = asyncio.get_running_loop().run_in_executor(None, cluster.stop_proc, worker)
        async with grpc.aio.insecure_channel(worker.address) as ch:
            while await serving(ch):
                await asyncio.sleep(0.01)
        s.send(_start(_request("late", prompt, 4)))
        by_rid = await s.read_until(lambda got: _ended(got.get("late", [])))
        await s.close()
        return by_rid, await stop

    by_rid, exit_code = asyncio.run(run())
    (late,) = by_rid["late"]
    assert late.error.code == grpc.StatusCode.UNAVAILABLE.value[0]
    assert "is draining" in late.error.message and late.error.refused
    (bad,) = by_rid["bad-vocab"]
    assert bad.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and not bad.error.refused
    assert exit_code == 0


def test_router_mux_hands_a_workers_failure_marks_on():
    """The router's end turns a flagged DecodeError into an error that carries its flag (and
    an unflagged one into an error with none). A plain gRPC server plays the worker."""
    from engine.call_abort import kv_source_failed, was_refused

    class Refusing(worker_pb2_grpc.DecodeWorkerServicer):
        async def DecodeMany(self, request_iterator, context):
            async for ctl in request_iterator:
                rid = ctl.start.request.request_id
                if rid:
                    ev = worker_pb2.DecodeEvent(request_id=rid, error=worker_pb2.DecodeError(
                        code=grpc.StatusCode.UNAVAILABLE.value[0], message=f"{rid} failed",
                        refused=rid == "refused", kv_source_failed=rid == "source"))
                    yield worker_pb2.DecodeBatch(events=[ev])

    async def run():
        async with _played_worker(Refusing(), "refusing") as one:
            return [await one("refused"), await one("source"), await one("failed")]

    refused, source, failed = asyncio.run(run())
    assert refused.code() == source.code() == failed.code() == grpc.StatusCode.UNAVAILABLE
    assert was_refused(refused) and not kv_source_failed(refused)
    assert kv_source_failed(source) and not was_refused(source)
    assert not was_refused(failed) and not kv_source_failed(failed)


def test_router_mux_takes_requests_a_closing_stream_never_read_as_refused():
    """A draining worker ends its stream with a closing message once its requests are done: a
    start it had not read by then (one on the wire) gets a refusal, which the router moves at
    no migration's cost. It ended in whatever status the race gave (INTERNAL once), unmarked."""
    from engine.call_abort import was_refused

    class Closing(worker_pb2_grpc.DecodeWorkerServicer):
        async def DecodeMany(self, request_iterator, context):
            async for _ in request_iterator:
                yield worker_pb2.DecodeBatch(closing=True)
                return

    async def run():
        async with _played_worker(Closing(), "closing") as one:
            return await one("unread")

    err = asyncio.run(run())
    assert err.code() == grpc.StatusCode.UNAVAILABLE and was_refused(err)
    assert "before reading the request" in err.details()


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _bytes_in_use() -> int:
    """malloc's bytes in use (protobuf's messages live there, outside Python's allocator)."""
    gc.collect()
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def test_an_unread_request_holds_its_own_output_not_its_neighbours(cluster):
    """The router's mux with a request nobody reads: its client stopped reading, so the
    router's handler waits in a write and its events queue up. One request left unread after
    its first chunk while eight others, with 20 logprobs a token, decode beside it in the same
    engine steps. Each event it queued shared its message's memory with the others' events,
    and kept all of it: the router held every request's output (6 MB for 5 KB of its own,
    measured) for as long as that client did not read. The mux runs in this process, where
    its memory is measured: glibc's count of the bytes in use."""
    try:
        ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        pytest.skip("needs glibc's mallinfo2 to measure memory")
    decode_address = _decode_address(cluster)
    num_others, max_tokens = 8, 300
    prompts = random_prompts(num_others + 2, seed=83, lo=20, hi=40)

    async def run():
        channel = grpc.aio.insecure_channel(decode_address)
        mux = DecodeMux(worker_pb2_grpc.DecodeWorkerStub(channel), "decode-under-test")

        async def read_all(rid: str, prompt: list[int], n: int, logprobs: int = 0) -> int:
            req = _request(rid, prompt, n)
            req.sampling.logprobs = logprobs
            return sum([c.ByteSize() async for c in mux.decode(req, 120.0)])

        unread = mux.decode(_request("unread", prompts[0], max_tokens), 120.0)
        await anext(unread)
        others = await asyncio.gather(*(read_all(f"o{i}", prompts[i + 1], max_tokens, 20)
                                        for i in range(num_others)))
        # Once the worker is idle the unread request is done there; a request after it on the
        # stream comes back after its last event.
        await asyncio.to_thread(wait_all_blocks_free, [decode_address])
        await read_all("after", prompts[-1], 2)
        held = _bytes_in_use()
        own = sum([c.ByteSize() async for c in unread])
        released = held - _bytes_in_use()
        await mux.close()
        await channel.close()
        return sum(others), own, released

    others, own, released = asyncio.run(run())
    assert own < others / 50  # its own output is small beside theirs
    assert released < others / 2, \
        f"reading the unread request freed {released} bytes: its own output is {own}"
