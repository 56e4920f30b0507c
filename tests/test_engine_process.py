"""`--engine-process`: the engine steps in a process of its own behind the face AsyncEngine
has (engine/engine_client.py, engine/engine_proc.py). A real child process each time."""
from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.engine_client import EngineProcess
from engine.engine_front import EngineDeadError
from engine.engine_pipe import EngineProcSpec
from tests.proc_signals import alive

MODEL = "micro-llama"


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _prompts() -> list[list[int]]:
    return [[(7 * i + 3 * j) % 7000 + 5 for j in range(5 + 9 * i)] for i in range(6)]


@pytest.fixture(scope="module")
def expected():
    with LLM(MODEL, num_gpu_blocks=64) as llm:
        outs = llm.generate(_prompts(), [_greedy(12 + i) for i in range(6)])
    want = [o.token_ids for o in outs]
    assert len({tuple(w) for w in want}) == len(want)  # varied, so equality means something
    return want


async def _start(**config) -> EngineProcess:
    return await EngineProcess.start(EngineProcSpec(EngineConfig(MODEL, num_gpu_blocks=64,
                                                                 **config)))


async def _collect(proc: EngineProcess, rid: str, prompt: list[int], n: int) -> list[int]:
    tokens: list[int] = []
    async for out in proc.generate(rid, prompt, _greedy(n)):
        tokens.extend(out.new_token_ids)
    return tokens


def test_concurrent_streams_equal_the_in_process_engine_and_free_every_block(expected):
    async def run():
        proc = await _start()
        try:
            assert proc.info.pid != os.getpid() and proc.llm.max_model_len > 0
            got = await asyncio.gather(*[_collect(proc, f"r{i}", p, 12 + i)
                                         for i, p in enumerate(_prompts())])
            stats = await proc.fresh_stats(wait_s=5)
        finally:
            proc.shutdown()
        return got, stats, proc.proc.returncode

    got, stats, code = asyncio.run(run())
    assert got == expected and code == 0
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0


def test_leaving_a_stream_early_aborts_it_and_bad_requests_raise_in_the_caller():
    async def run():
        proc = await _start()
        try:
            stream = proc.generate("long", _prompts()[3], _greedy(500))
            async for _ in stream:
                break
            await stream.aclose()  # the caller went away: the engine drops the request
            with pytest.raises(ValueError, match="token id"):
                await _collect(proc, "bad", [5, 10**9], 4)
            with pytest.raises(ValueError, match="already"):  # a running id, refused
                running = proc.generate("dup", _prompts()[1], _greedy(500))
                await anext(running)
                await _collect(proc, "dup", _prompts()[1], 4)
            await running.aclose()
            for _ in range(50):  # aborts apply at the next step
                stats = await proc.fresh_stats(wait_s=5)
                if stats.num_running == 0:
                    break
                await asyncio.sleep(0.05)
            still_serves = await _collect(proc, "after", _prompts()[0], 3)
            return stats, still_serves, proc.num_streams
        finally:
            proc.shutdown()

    stats, still_serves, streams = asyncio.run(run())
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_total_blocks
    assert len(still_serves) == 3 and streams == 0


def test_a_request_cancelled_while_the_engine_adds_it_is_aborted_once_added():
    async def run():
        proc = await _start()
        try:
            before = (await proc.fresh_stats(wait_s=5)).num_steps
            caller = asyncio.ensure_future(_collect(proc, "cancelled", _prompts()[4], 1900))
            await asyncio.sleep(0)  # its add_request is on the way to the engine
            caller.cancel()
            while (stats := await proc.fresh_stats(wait_s=5)).num_running or stats.num_waiting:
                await asyncio.sleep(0.01)
            return stats, before
        finally:
            proc.shutdown()

    stats, before = asyncio.run(run())
    # Aborted within a few steps, not decoded to its 1900 tokens for nobody.
    assert stats.num_steps - before < 100
    assert stats.num_free_blocks == stats.num_total_blocks


def test_a_killed_engine_process_fails_its_streams_and_says_so_once():
    async def run():
        deaths: list[BaseException] = []
        proc = await _start()
        proc.on_dead = deaths.append
        try:
            stream = proc.generate("r", _prompts()[2], _greedy(1000))
            await anext(stream)
            os.kill(proc.info.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match="exit code -9"):
                async for _ in stream:
                    pass
            with pytest.raises(EngineDeadError):
                await _collect(proc, "later", _prompts()[0], 2)
            with pytest.raises(EngineDeadError):
                await asyncio.to_thread(proc.llm.cached_block_hashes)
            return deaths, proc.alive
        finally:
            proc.shutdown()

    deaths, alive = asyncio.run(run())
    assert len(deaths) == 1 and isinstance(deaths[0], EngineDeadError) and not alive


def test_a_stream_open_at_shutdown_fails_with_the_engine_shut_down():
    async def drain(stream):
        async for _ in stream:
            pass

    async def run():
        proc = await _start()
        stream = proc.generate("r", _prompts()[2], _greedy(100000))
        await anext(stream)
        proc.shutdown()
        with pytest.raises(EngineDeadError, match="shut down"):
            await asyncio.wait_for(drain(stream), 30)

    asyncio.run(run())


def test_an_engine_that_cannot_be_built_fails_the_start_with_its_error():
    async def run():
        await _start(max_model_len=10**9)

    with pytest.raises(ValueError, match="max_model_len"):
        asyncio.run(run())


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return kids


def _engine_child(pid: int) -> int:
    kids = [k for k in _children(pid)
            if b"engine.engine_proc" in Path(f"/proc/{k}/cmdline").read_bytes()]
    assert len(kids) == 1, kids
    return kids[0]


def _wait_gone(pid: int, timeout_s: float) -> bool:
    """Whether ``pid`` ended (its zombie reaped by init counts as ended) within the time."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def test_a_cluster_of_engine_process_workers_streams_what_the_in_process_engine_does(reference):
    """Real processes: router, a prefill and a decode worker each with its engine in a child
    process, KV over NIXL between the children. Greedy tokens equal the in-process engine's,
    every lease and block is freed, a killed engine process takes its worker down (non-zero
    exit, for its supervisor to restart), and a killed worker takes its engine process down."""
    from router.launcher import Cluster, ClusterSpec
    from tests.serving_helpers import (WORKER_ARGS, decisive_prompts, stream_greedy,
                                       wait_all_blocks_free)

    max_tokens = [10 + (i * 7) % 13 for i in range(12)]
    prompts = decisive_prompts(reference, 12, seed=31, max_tokens=max_tokens)
    want = reference.generate(prompts, [_greedy(m) for m in max_tokens])
    spec = ClusterSpec(model=MODEL, worker_args=[*WORKER_ARGS, "--engine-process"],
                       router_args=["--max-local-prefill-length", "0"])
    with Cluster(spec) as cluster:
        workers = [p for p in cluster.procs if p.role != "router"]
        engines = {p.role: _engine_child(p.popen.pid) for p in workers}
        got = stream_greedy(cluster.router_address, prompts, max_tokens)
        # The workers serve without torch (~250 MB each); their engine processes load it.
        torch_in = {pid: _maps_torch(pid) for pid in [p.popen.pid for p in workers]
                    + list(engines.values())}
        wait_all_blocks_free([p.address for p in workers])
        decode = next(p for p in workers if p.role == "decode")
        os.kill(engines["decode"], signal.SIGKILL)
        code = decode.popen.wait(timeout=60)
        # A worker SIGKILLed leaves no engine behind (on a GPU it would hold the memory).
        prefill = next(p for p in workers if p.role == "prefill")
        os.kill(prefill.popen.pid, signal.SIGKILL)
        prefill.popen.wait(timeout=10)
        orphan_gone = _wait_gone(engines["prefill"], timeout_s=60)
    assert len({tuple(w.token_ids) for w in want}) > 5
    for (toks, final), w in zip(got, want):
        assert toks == w.token_ids
        assert final.usage.timings.kv_transfer_s > 0
    assert code != 0 and orphan_gone
    assert [torch_in[p.popen.pid] for p in workers] == [False, False]
    assert all(torch_in[pid] for pid in engines.values())


def _maps_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


def test_messages_arrive_whole_through_a_non_blocking_reader_whatever_their_size():
    """The worker's loop reads whatever the socket has (uvloop makes a watched socket
    non-blocking): a message arriving in pieces is kept until complete, and several that
    arrive together all come out, in order."""
    import select
    import socket
    import threading

    from engine.engine_pipe import FrameReader, FrameWriter, PipeClosed

    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    reader, writer = FrameReader(ours), FrameWriter(theirs)
    sent = [("step", list(range(n)), "x" * n) for n in (0, 3, 5_000_000, 7, 200_000)]
    sender = threading.Thread(target=lambda: [writer.send(m) for m in sent])
    sender.start()
    got, reads = [], 0
    while len(got) < len(sent):
        select.select([ours], [], [], 5)
        got += reader.read_ready()
        reads += 1
    sender.join()
    assert got == sent and reads > len(sent)  # the big one came in pieces
    writer.close()
    select.select([ours], [], [], 5)
    with pytest.raises(PipeClosed):
        reader.read_ready()


def test_an_output_crosses_with_every_field_but_what_came_before():
    """The wire tuple keeps every RequestOutput field except the prompt and earlier tokens
    (and earlier tokens' logprobs): a field added to RequestOutput and not to the tuple fails
    here."""
    import dataclasses

    from engine.engine_pipe import decode_output, encode_output
    from engine.outputs import KVLease, RequestOutput

    out = RequestOutput(
        request_id="r", prompt_token_ids=[1, 2], token_ids=[7, 8, 9], new_token_ids=[8, 9],
        text="all", text_delta="new", finished=True, finish_reason="stop", stop_reason=9,
        logprobs=["lp7", "lp8", "lp9"], prompt_logprobs=[None, "p2"], num_cached_tokens=16,
        kv_lease=KVLease("r", [4], 2, 16, 99.0), arrival_time=1.5, first_scheduled_time=2.5)
    assert {f.name for f in dataclasses.fields(RequestOutput)} == {
        "request_id", "prompt_token_ids", "token_ids", "new_token_ids", "text", "text_delta",
        "finished", "finish_reason", "stop_reason", "logprobs", "prompt_logprobs",
        "num_cached_tokens", "kv_lease", "arrival_time", "first_scheduled_time"}
    got = decode_output(encode_output(out))
    assert got == dataclasses.replace(out, prompt_token_ids=[], token_ids=[],
                                      logprobs=["lp8", "lp9"])


_PARENT = """
import asyncio, sys, time
from engine.config import EngineConfig
from engine.engine_client import EngineProcess
from engine.engine_pipe import EngineProcSpec

async def main():
    proc = await EngineProcess.start(EngineProcSpec(EngineConfig(sys.argv[1], num_gpu_blocks=16)))
    print(proc.proc.pid, flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


def test_an_engine_process_dies_with_its_worker_even_when_stopped():
    """A worker SIGKILLed with its engine process wedged (SIGSTOPped here: it cannot even see
    its pipe end) must not leave that process behind: the kernel kills it with its parent."""
    import subprocess
    import sys
    import time

    parent = subprocess.Popen([sys.executable, "-c", _PARENT, MODEL], stdout=subprocess.PIPE,
                              text=True)
    try:
        child = int(parent.stdout.readline())
        os.kill(child, signal.SIGSTOP)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 20
        while alive(child):
            assert time.monotonic() < deadline, "the engine process outlived its worker"
            time.sleep(0.05)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        parent.stdout.close()


def test_stopping_a_worker_whose_engine_process_stopped_reading_ends_in_bounded_time(
        monkeypatch):
    """A worker's shutdown sends a last message to its engine process; one that stopped
    reading (wedged, and more queued for it than the pipe holds) must not hold the sending
    thread, or the worker's stop, for good: the process is killed after the shutdown timeout,
    and the send blocked on it fails."""
    from engine import engine_client
    from tests.proc_signals import stop_process

    monkeypatch.setattr(engine_client, "SHUTDOWN_TIMEOUT_S", 1.0)

    async def run():
        proc = await _start()
        stop_process(proc.proc)
        prompt = [(j * 7919) % 7000 + 5 for j in range(1000)]
        waiting = [asyncio.ensure_future(_collect(proc, f"q{i}", prompt, 2)) for i in range(300)]
        await asyncio.sleep(0)  # each has queued its add_request
        proc.shutdown()
        failed = await asyncio.gather(*waiting, return_exceptions=True)
        return proc, failed

    proc, failed = asyncio.run(run())
    assert proc.proc.returncode == -signal.SIGKILL and not proc._sender._thread.is_alive()
    assert all(isinstance(e, EngineDeadError) for e in failed)


def test_an_id_is_free_again_once_its_request_ended_however_fast_it_ended():
    """The loop holds an id until the request's last output arrives; one that ends before
    the engine process's reply to its admission (a one-token request) must still let go of
    it, or the id would be refused for good."""
    async def run():
        proc = await _start()
        try:
            for _ in range(12):
                assert len(await _collect(proc, "same", [5, 6, 7], 1)) == 1
        finally:
            proc.shutdown()

    asyncio.run(run())


def test_a_worker_whose_engine_process_died_as_it_started_exits_non_zero(monkeypatch):
    """The engine process's death is told to the worker only once on_dead is set, after the
    model's fingerprint is read: one that died meanwhile told nobody, and the worker
    registered, reported SERVING and refused every request, for good."""
    from engine import worker_runtime, worker_server
    from engine.worker_runtime import WorkerConfig

    started = []
    real_start, real_fingerprint = EngineProcess.start, worker_runtime._fingerprint

    async def start(spec):
        started.append(await real_start(spec))
        return started[-1]

    async def fingerprint_while_it_dies(config):
        proc = started[-1]
        os.kill(proc.proc.pid, signal.SIGKILL)
        for _ in range(600):  # its death reaches the loop: the pipe's end
            if proc.error is not None:
                break
            await asyncio.sleep(0.05)
        return await real_fingerprint(config)

    monkeypatch.setattr(EngineProcess, "start", staticmethod(start))
    monkeypatch.setattr(worker_runtime, "_fingerprint", fingerprint_while_it_dies)
    engine = EngineConfig("micro-llama", num_gpu_blocks=32, role="decode",
                          kv_transfer_backend="torch")
    config = WorkerConfig(engine=engine, engine_process=True)
    async def run():
        async with asyncio.timeout(120):  # without the check it serves for ever
            await worker_server.run_worker(config, "pdserve.v1.DecodeWorker",
                                           lambda rt: None, lambda s, server: None)

    with pytest.raises(SystemExit, match="the engine died as the worker started"):
        asyncio.run(run())
    assert started and started[-1].error is not None


def test_an_engine_process_sends_the_blocks_a_schedule_evicts_before_its_forward(preset_path):
    """tests/test_serving_engine.py's test of the same, in the engine's own process: its
    KV events crossed to the worker only with the step's outputs, after the forward."""
    import socket
    import threading

    from engine.block_hash import hash_request_tokens
    from engine.block_pool import BlockRemoved
    from engine.engine_pipe import FrameWriter
    from engine.engine_proc import _ChildEngine, _Pipe
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(str(preset_path("tiny-llama")), num_gpu_blocks=8,
                                    max_model_len=128))
    engine.enable_kv_events()
    first = list(range(10, 122))  # 7 blocks of 8: the second prompt evicts most of them
    sent: list = []
    # Per forward: the first prompt's blocks evicted by then, and those the worker was sent.
    seen: list[tuple[set, set]] = []
    second_forward = threading.Event()
    forward = engine.executor.execute_model

    def watched_forward(inp):
        gone = set(hash_request_tokens(first, 16)) - set(engine.kv_manager.cached_block_hashes())
        told = {h for m in sent if m[0] == "step" for ev in m[3]
                if isinstance(ev, BlockRemoved) for h in ev.block_hashes}
        seen.append((gone, told))
        if len(seen) == 2:
            second_forward.set()
        return forward(inp)

    engine.executor.execute_model = watched_forward
    ours, theirs = socket.socketpair()
    pipe = _Pipe(FrameWriter(theirs))
    send = pipe.send
    pipe.send = lambda msg: (sent.append(msg), send(msg))

    async def run():
        child = _ChildEngine(engine, pipe, None, None)
        try:
            for rid, start in (("first", 10), ("second", 300)):
                engine.add_request(rid, list(range(start, start + 112)),
                                   SamplingParams(max_tokens=1))
            child.wake()
            assert await asyncio.to_thread(second_forward.wait, 60)
        finally:
            child.shutdown()

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()
        ours.close()
        theirs.close()
    gone, told = seen[1]
    assert len(gone) >= 5 and told == gone
