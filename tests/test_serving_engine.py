"""AsyncEngine, the engine behind each worker's event loop: a caller cancelled while its
decode-role call waits for the engine leaves nothing behind."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine.async_engine import AsyncEngine


class _Engine:
    """An LLMEngine whose decode-role calls block until ``gate`` opens (a long step)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.done: list[str] = []
        self.aborted: list[str] = []
        self.broken: BaseException | None = None  # what check_health raises, once set

    def get_stats(self):
        return None

    def has_unfinished_requests(self) -> bool:
        return False

    def check_health(self) -> None:
        if self.broken is not None:
            raise self.broken

    def step(self) -> list:
        return []

    def add_prefilled_request(self, request_id, *_):
        self.gate.wait(10)
        self.done.append(request_id)
        return f"alloc-{request_id}"

    def commit_prefilled(self, request_id) -> None:
        self.gate.wait(10)
        self.done.append(request_id)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def shutdown(self) -> None:
        pass


def _serve(engine, body, within_s: float | None = None, **kw):
    """``await body(ae)`` in a new event loop, ``ae`` an AsyncEngine over ``engine`` (``kw``:
    its options), shut down after; a gated test engine's gate opens first, so that no call
    still waits on it. ``within_s``: the whole run's bound."""
    async def run():
        ae = AsyncEngine(engine, **kw)
        try:
            return await body(ae)
        finally:
            if isinstance(engine, _Engine):
                engine.gate.set()
            ae.shutdown()

    return asyncio.run(run() if within_s is None else asyncio.wait_for(run(), within_s))


def _cancel_while_blocked(make_call) -> _Engine:
    engine = _Engine()

    async def body(ae):
        task = asyncio.ensure_future(make_call(ae))
        await asyncio.sleep(0.05)  # the call is in the pool, waiting on the engine
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert engine.aborted == []  # nothing to abort yet: the call has not landed
        engine.gate.set()
        deadline = time.monotonic() + 5
        while not engine.aborted and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    _serve(engine, body)
    return engine


def test_an_allocation_that_lands_after_its_caller_left_is_aborted():
    engine = _cancel_while_blocked(lambda ae: ae.allocate_prefilled("r1", [1, 2, 3], 4, None))
    assert engine.done == ["r1"] and engine.aborted == ["r1"]


def test_a_commit_that_lands_after_its_caller_left_is_aborted():
    async def first_output(ae):
        async for out in ae.commit_prefilled("r2"):
            return out

    engine = _cancel_while_blocked(first_output)
    assert engine.done == ["r2"] and engine.aborted == ["r2"]


def test_an_idle_engine_that_cannot_step_any_more_dies_and_says_so():
    """A TP rank that died while no request ran shows only in check_health: the engine thread
    stops, a waiting stream gets EngineDeadError, and on_dead hears of it once (the worker
    then leaves the cluster and exits non-zero: engine/worker_server.py)."""
    from engine.async_engine import EngineDeadError
    from engine.executor_error import ExecutorError

    engine = _Engine()
    engine.gate.set()
    deaths = []

    async def body(ae):
        stream = ae.commit_prefilled("r3")
        waiting = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.05)
        assert not waiting.done() and ae.alive
        engine.broken = ExecutorError("tensor-parallel rank 1 died")
        with pytest.raises(EngineDeadError, match="rank 1 died"):
            await asyncio.wait_for(waiting, 5)
        await asyncio.sleep(0.05)
        return ae.alive

    alive = _serve(engine, body, on_dead=deaths.append)
    assert [str(e) for e in deaths] == ["tensor-parallel rank 1 died"] and not alive


def test_a_stream_open_at_shutdown_fails_with_the_engine_shut_down():
    """Its consumer (a handler the gRPC server's stop has not yet cut) would otherwise wait
    for an output no step makes any more."""
    from engine.async_engine import EngineDeadError

    async def run():
        engine = _Engine()
        engine.gate.set()
        ae = AsyncEngine(engine)
        stream = ae.commit_prefilled("r4")
        waiting = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        ae.shutdown()
        with pytest.raises(EngineDeadError, match="shut down"):
            await asyncio.wait_for(waiting, 5)

    asyncio.run(run())


def test_failures_map_to_the_status_that_tells_the_caller_what_to_do():
    """A KV pull that timed out is its source worker's failure: UNAVAILABLE, which the router
    migrates; DEADLINE_EXCEEDED is left to the caller's own deadline."""
    import grpc

    from engine.llm_engine import NoFreeBlocksError
    from engine.worker_runtime import RejectError, status_for
    from kvtransfer import PeerGoneError, TransferTimeout

    assert status_for(TransferTimeout("KV pull")) == grpc.StatusCode.UNAVAILABLE
    assert status_for(PeerGoneError("gone")) == grpc.StatusCode.UNAVAILABLE
    assert status_for(asyncio.TimeoutError()) == grpc.StatusCode.DEADLINE_EXCEEDED
    assert status_for(NoFreeBlocksError("full")) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert status_for(ValueError("bad")) == grpc.StatusCode.INVALID_ARGUMENT
    assert status_for(RejectError(grpc.StatusCode.ABORTED, "x")) == grpc.StatusCode.ABORTED
    assert status_for(KeyError("bug")) == grpc.StatusCode.INTERNAL


class _Busy(_Engine):
    """An engine whose stats, after the constructor's, wait for ``gate``: a long step holds
    its lock (bounded, so that a test that fails does not hang)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def get_stats(self):
        self.calls += 1
        if self.calls > 1:
            self.gate.wait(60)
        return self.calls


def test_fresh_stats_answer_with_the_last_steps_while_a_long_step_holds_the_engine():
    """The router's probe asks a worker for its info with a 1 s timeout; a worker in a long
    prefill step must still answer, or a healthy worker is marked down."""
    engine = _Busy()

    async def body(ae):
        during = await asyncio.wait_for(ae.fresh_stats(wait_s=0.05), 2)
        engine.gate.set()
        return during, await ae.fresh_stats(wait_s=5)

    during, after = _serve(engine, body)
    assert during == 1  # the last stats, not a wait for the step
    assert after > 1  # taken now once the engine is free


def test_stats_callers_during_a_long_step_leave_the_thread_pool_free():
    """Each fresh_stats during a long (or wedged) step held a thread of the default pool
    until the step ended: a few GetWorkerInfo callers and the KV pulls, allocations and
    commits that run there waited for the step too."""
    engine = _Busy()

    async def body(ae):
        for _ in range(40):  # more than the default pool's threads
            await ae.fresh_stats(wait_s=0.001)
        # Answered while the step still holds the engine.
        pulled = await asyncio.wait_for(asyncio.to_thread(lambda: "pulled"), 30)
        return pulled, engine.gate.is_set()

    assert _serve(engine, body) == ("pulled", False)


def test_stats_asked_as_the_engine_shuts_down_answer_with_the_last():
    """A take queued behind a step that the shutdown cancels, or one asked after it, must
    not raise a CancelledError in the caller's handler (or the executor's refusal)."""
    async def run():
        engine = _Busy()
        ae = AsyncEngine(engine)
        first = asyncio.ensure_future(ae.fresh_stats(wait_s=30))  # holds the stats thread
        queued = asyncio.ensure_future(ae.fresh_stats(wait_s=30))  # behind it
        await asyncio.sleep(0.1)
        engine.gate.set()  # the step ends as the engine shuts down
        ae.shutdown()
        after = await ae.fresh_stats(wait_s=1)
        return await first, await queued, after

    first, queued, after = asyncio.run(run())
    assert first >= 1 and queued >= 1 and after >= 1


def test_a_step_that_never_ends_kills_the_engine_and_says_where_it_hangs(capfd):
    """A wedged step (a hung device or collective) would leave a worker that answers health
    checks with every request stuck: past the step timeout the engine dies, waiting streams get
    EngineDeadError, on_dead hears of it, and the engine thread's stack goes to stderr."""
    from engine.async_engine import EngineDeadError, EngineStepTimeout

    class _Wedged(_Engine):
        def has_unfinished_requests(self) -> bool:
            return True

        def step(self) -> list:
            self.gate.wait(30)  # the step that never ends
            return []

        def add_request(self, *args) -> None:
            pass

    deaths = []

    async def body(ae):
        stream = ae.generate("r4", [1, 2, 3], None)
        with pytest.raises(EngineDeadError, match="step timeout"):
            await asyncio.wait_for(anext(stream), 10)
        return ae.alive

    alive = _serve(_Wedged(), body, on_dead=deaths.append, step_timeout_s=0.3)
    assert len(deaths) == 1 and isinstance(deaths[0], EngineStepTimeout)
    assert not alive
    assert "in step" in capfd.readouterr().err  # where the engine thread was stuck


def test_the_step_timeout_flag_reaches_the_worker_config():
    from engine.cli import build_parser
    from engine.cli_serve import _worker_config

    def cfg(*extra):
        args = build_parser().parse_args(["decode", "--model", "tiny-llama", *extra])
        return _worker_config(args, "decode")

    assert cfg().engine_step_timeout_s == 120.0
    assert cfg("--engine-step-timeout-s", "30").engine_step_timeout_s == 30.0
    assert cfg("--engine-step-timeout-s", "0").engine_step_timeout_s is None
    with pytest.raises(ValueError, match="engine_step_timeout_s"):
        cfg("--engine-step-timeout-s", "0.5")


def test_a_second_stream_for_a_running_request_id_is_refused_and_the_first_keeps_streaming():
    """The id check comes before the stream is opened: a duplicate used to replace the running
    request's stream, which then streamed to nobody while its caller waited forever."""
    from engine import LLM, SamplingParams

    async def body(ae):
        params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
        first = ae.generate("same", [5, 6, 7], params)
        tokens = list((await anext(first)).new_token_ids)
        with pytest.raises(ValueError, match="already in the engine"):
            await anext(ae.generate("same", [8, 9], params))
        async for out in first:
            tokens.extend(out.new_token_ids)
        return tokens

    with LLM("micro-llama", num_gpu_blocks=32) as llm:
        assert len(_serve(llm.engine, body, within_s=60)) == 30


def _decode_engine(preset_path):
    from engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(str(preset_path("tiny-llama")), role="decode",
                                  num_gpu_blocks=64, max_model_len=256))


async def _retry_until_taken(make, within_s: float = 10.0):
    """``make()`` once the id it uses is free again (ValueError until then)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return await make()
        except ValueError:
            assert time.monotonic() < deadline, "the id was never free again"
            await asyncio.sleep(0.01)


def test_an_aborted_requests_last_output_never_reaches_a_new_request_under_its_id(preset_path):
    """The engine frees an aborted request's id before the request's last output reaches the
    loop: a new request under that id meanwhile got that output (its stream ended at once
    with 'abort', and it was left decoding for nobody). The id stays taken until then."""
    from engine import SamplingParams

    engine = _decode_engine(preset_path)

    async def body(ae):
        greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        await ae.allocate_prefilled("x", list(range(10, 50)), 7, greedy)
        ae.abort("x")  # the pull failed: what the decode servicer does
        with pytest.raises(ValueError, match="already in the engine"):
            await ae.allocate_prefilled("x", list(range(60, 90)), 7, greedy)

        async def fresh():
            return [o async for o in ae.generate("x", [21, 22, 23], greedy)]

        outs = await _retry_until_taken(fresh)
        assert outs[-1].finish_reason == "length"
        assert sum(len(o.new_token_ids) for o in outs) == 5
        await asyncio.sleep(0.2)
        stats = engine.get_stats()
        assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks

    _serve(engine, body)


def test_an_id_whose_stream_is_still_open_takes_no_blocks(preset_path):
    """A decode-role allocation under the id of a request whose last output is still unread
    is refused before it takes blocks (its commit was refused later, leaving them held)."""
    from engine import SamplingParams

    engine = _decode_engine(preset_path)

    async def body(ae):
        greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        old = ae.generate("x", [11, 12, 13], greedy)
        await old.__anext__()
        await asyncio.sleep(0.3)  # it finished in the engine; its caller reads on later
        with pytest.raises(ValueError, match="already in the engine"):
            await ae.allocate_prefilled("x", list(range(100, 140)), 5, greedy)
        stats = engine.get_stats()
        assert stats.num_free_blocks == stats.num_total_blocks and not engine._awaiting_kv
        async for _ in old:
            pass
        await asyncio.sleep(0.2)
        stats = engine.get_stats()
        assert stats.num_free_blocks == stats.num_total_blocks and not engine._awaiting_kv

    _serve(engine, body)


def test_a_stream_closed_early_lets_go_of_its_request_as_it_closes(preset_path):
    """Closing the caller's iterator closes the engine's own with it: the stream and the abort
    waited for the loop's generator finalizer, the id meanwhile refused to a new request."""
    from engine import SamplingParams

    engine = _decode_engine(preset_path)

    async def body(ae):
        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        gen = ae.generate("x", [5, 6, 7], params)
        await anext(gen)
        await gen.aclose()
        assert ae.num_streams == 0

        async def fresh():
            return [o async for o in ae.generate("x", [8, 9], SamplingParams(max_tokens=2))]

        outs = await _retry_until_taken(fresh)  # once the abort's last output is in
        assert outs[-1].finish_reason == "length"

    _serve(engine, body)


def test_the_blocks_a_schedule_evicts_are_published_before_its_forward(preset_path):
    """A served engine's KV events went out after each step: the blocks its schedule evicted
    stayed in the prefix index for the whole forward (a second of a long prefill on CPUs),
    and routers sent prompts with those prefixes to a worker that no longer held them. With
    2 prefill workers of 40 blocks under eviction, 11 of 60 requests for a hot prefix got
    fewer cached tokens than the index had promised; 0 of 60 once removals went out before
    the forward."""
    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.block_pool import BlockRemoved

    engine = LLMEngine(EngineConfig(str(preset_path("tiny-llama")), num_gpu_blocks=8,
                                    max_model_len=128))
    engine.enable_kv_events()
    published: list = []  # as the worker's hook takes them, in the engine thread
    removed_at_forward: list[set[bytes]] = []
    forward = engine.executor.execute_model

    def watched_forward(inp):
        removed_at_forward.append({h for ev in published if isinstance(ev, BlockRemoved)
                                   for h in ev.block_hashes})
        return forward(inp)

    engine.executor.execute_model = watched_forward

    async def body(ae):
        # 7 blocks each of 8: the second prompt's schedule evicts most of the first's.
        for rid, start in (("first", 10), ("second", 300)):
            outs = [o async for o in ae.generate(rid, list(range(start, start + 112)),
                                                 SamplingParams(max_tokens=1))]
            assert outs[-1].finished

    _serve(engine, body, within_s=60, on_step=lambda e: published.extend(e.take_kv_events()))
    evicted = {h for ev in published if isinstance(ev, BlockRemoved) for h in ev.block_hashes}
    assert len(removed_at_forward) == 2 and len(evicted) >= 5
    assert removed_at_forward[-1] == evicted


def test_a_guided_requests_guide_is_built_off_the_event_loop():
    """Building a guide compiles its pattern, and the engine's first builds the vocabulary's
    trie (a second for a large vocabulary): on a guide thread (engine/guide_threads.py), the
    loop serving other calls meanwhile; the add itself, then quick, stays on the loop."""
    from engine import SamplingParams

    class _Guides:
        def __init__(self) -> None:
            self.built: dict[str, threading.Thread] = {}

        def ready(self, params) -> bool:
            return not params.has_pattern_guide or params.guide in self.built

        def warm(self, params) -> None:
            self.built[params.guide] = threading.current_thread()

    class _Adding(_Engine):
        def __init__(self) -> None:
            super().__init__()
            self.adders: list[threading.Thread] = []
            self.guides = _Guides()

        def add_request(self, *args) -> None:
            self.adders.append(threading.current_thread())

    engine = _Adding()

    async def body(ae):
        for i, params in enumerate([SamplingParams(), SamplingParams(guided_regex="a+"),
                                    SamplingParams(guided_json={"type": "integer"})]):
            first = asyncio.ensure_future(anext(ae.generate(f"r{i}", [1, 2, 3], params)))
            while len(engine.adders) <= i:
                await asyncio.sleep(0.01)
            first.cancel()

    _serve(engine, body, within_s=30)
    main = threading.main_thread()
    assert engine.adders == [main] * 3
    assert sorted(engine.guides.built) == ["guided_json", "guided_regex"]
    assert all(t.name.startswith("pdserve-guide") for t in engine.guides.built.values())
