"""Request migration across real processes: workers killed (SIGKILL) under running requests.

The clients' streams go on, on the surviving workers, from the tokens already streamed, and
end token for token where the in-process engine ends (greedy and seeded sampling). Once a
request's --migration-limit is spent, its client gets UNAVAILABLE rather than a hang.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path

import grpc
import pytest

from client import AsyncClient, UnavailableError
from engine import SamplingParams
from protos import common_pb2, router_pb2, router_pb2_grpc
from router.launcher import Cluster, ClusterSpec
from router.proc_family import descendants
from tests.serving_helpers import (SERVING_MODEL, WORKER_ARGS, cluster_stats, decisive_outputs,
                                   live_workers, random_prompts, wait_all_blocks_free,
                                   worker_info, worker_stub)

MODEL = SERVING_MODEL

GREEDY = dict(temperature=0.0, ignore_eos=True)
SEEDED = dict(temperature=1.0, top_p=0.9, seed=23, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster():
    # Local prefill off: every continuation goes through a prefill worker and a KV transfer.
    # A pull cut by its owner's death may leave its blocks quarantined: briefly, here, so the
    # tests can see every block come back. Room for every prompt of a test on one decode
    # worker: a burst of migrated prompts that lands on it at once then never waits for room
    # (router/decode_wait.py), which would only slow these tests down.
    spec = ClusterSpec(model=MODEL, num_prefill=2, num_decode=2,
                       worker_args=[*WORKER_ARGS, "--kv-quarantine-s", "1",
                                    "--num-gpu-blocks", "512"],
                       router_args=["--max-local-prefill-length", "0", "--migration-limit", "1",
                                    "--health-check-interval-s", "1"])
    with Cluster(spec) as c:
        yield c


def _live(cluster, role):
    return sorted((p for p in cluster.procs if p.name.startswith(role)
                   and p.popen.poll() is None), key=lambda p: p.name)


def _kill(proc) -> None:
    proc.popen.kill()
    proc.popen.wait(timeout=10)


async def _stream(client, prompt, params: dict, got: list):
    """Streams one request, appending its token ids to ``got`` as they come; the final chunk,
    with the whole streamed text as ``text``."""
    final, text = None, []
    async for chunk in client.generate(prompt, **params):
        got.extend(chunk.token_ids)
        text.append(chunk.text)
        final = chunk
    final.text = "".join(text)
    return final


@contextlib.asynccontextmanager
async def _polled(addresses: list[str], role: str):
    """Yields ``infos()``: the GetWorkerInfo of each worker at ``addresses``, asked at once over
    channels opened (and connected) up front. Micro-llama's requests can come and go within
    0.2 s: a fresh channel per poll, on a thread, once saw none of them in flight."""
    channels = [grpc.aio.insecure_channel(a) for a in addresses]
    stubs = [worker_stub(ch, role) for ch in channels]

    async def infos() -> list[common_pb2.WorkerInfo]:
        return await asyncio.gather(*(s.GetWorkerInfo(common_pb2.WorkerInfoRequest(), timeout=10)
                                      for s in stubs))
    try:
        await infos()
        yield infos
    finally:
        for ch in channels:
            await ch.close()


def _fault_when_busy(cluster, worker_address: str, prompts, params: dict, fault,
                     undo=None, hold=None):
    """Streams every prompt at once; calls ``fault()`` once the worker at ``worker_address``
    has one of them in flight (polled every 2 ms), and ``undo()`` after every stream ended.
    ``hold()``, when given, runs before the first prompt goes out: something that keeps the
    worker's prompts in flight until the fault, so that no poll can miss them. The streamed
    token ids per prompt, and the final chunks."""
    role = worker_info(worker_address).role

    async def run():
        got = [[] for _ in prompts]
        async with AsyncClient(cluster.router_address, timeout=300) as client, \
                _polled([worker_address], role) as infos:
            if hold is not None:
                hold()
            tasks = [asyncio.ensure_future(_stream(client, p, params, g))
                     for p, g in zip(prompts, got)]
            while not (await infos())[0].num_inflight:
                assert not all(t.done() for t in tasks), "no prompt reached the worker"
                await asyncio.sleep(0.002)
            fault()
            try:
                return got, await asyncio.gather(*tasks)
            finally:
                if undo is not None:
                    undo()

    return asyncio.run(run())


async def _until(pred, timeout_s: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not pred():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


async def _kill_twice(cluster, decode: list, prompt) -> list[int] | None:
    """Streams ``prompt`` and kills the decode worker running it, twice; the token ids that
    arrived before the request failed UNAVAILABLE, or None when it finished before the second
    kill found it running. The kills are not waited for on the loop: a killed worker's exit
    can take seconds (its mappings torn down), in which the stream, unread, ran on."""
    killed: list = []

    def running():
        # None, not StopIteration: raised in asyncio.to_thread, that hangs the await for good.
        return next((p for p in decode if p not in killed and p.popen.poll() is None
                     and worker_info(p.address).num_running), None)

    def kill(proc) -> None:
        proc.popen.kill()
        killed.append(proc)

    got: list[int] = []
    try:
        async with AsyncClient(cluster.router_address, timeout=120) as client:
            task = asyncio.ensure_future(_stream(client, prompt,
                                                 dict(max_tokens=400, **GREEDY), got))
            await _until(lambda: len(got) >= 4)
            kill(await asyncio.to_thread(running))
            n = len(got)
            await _until(lambda: len(got) >= n + 4 or task.done())  # moved and streaming
            victim = await asyncio.to_thread(running)
            if victim is None:
                assert (await task).finish_reason == "length"  # finished: the race was lost
                return None
            kill(victim)
            with pytest.raises(UnavailableError):
                await task
            return got
    finally:
        for proc in killed:
            await asyncio.to_thread(proc.popen.wait, 10)

# Long enough that no stream can finish while the last one still waits for its prefill: on
# the 2-core VM 13 prompts queue for up to ~450 ms, and a 48-token stream that went first
# once finished in ~540 ms, before the kill (CI, session 25); a 96-token one in ~800 ms while
# the last prompts waited ~540 ms for their first token and more for their fourth (CI,
# session 39); a 192-token one in ~1.8 s while each prefill worker's second batch took
# ~1.4 s to its first token (CI, session 43).
KILL_MAX_TOKENS = 320


def test_streams_survive_a_decode_worker_killed_under_them(cluster, reference):
    # Six streams, one seeded (i = 4), and the n = 3 request below: streams on both workers,
    # greedy and seeded ones among those that move. The greedy streams' reference outputs are
    # those the prompts were chosen by; the seeded ones are generated in one batch.
    prompts, greedy = decisive_outputs(reference, 6, seed=31, max_tokens=KILL_MAX_TOKENS,
                                       lo=20, hi=90)
    params = [dict(max_tokens=KILL_MAX_TOKENS, **(SEEDED if i % 5 == 4 else GREEDY))
              for i in range(6)]
    seeded = [i for i, p in enumerate(params) if p["temperature"]]
    # And one request of n = 3 seeded sequences: each migrates on its own.
    par_prompt = random_prompts(1, seed=33, lo=40, hi=40)[0]
    par_params = [dict(max_tokens=KILL_MAX_TOKENS, **{**SEEDED, "seed": SEEDED["seed"] + i})
                  for i in range(3)]
    sampled = reference.generate(
        [prompts[i] for i in seeded] + [par_prompt] * 3,
        [SamplingParams(**params[i]) for i in seeded] + [SamplingParams(**p) for p in par_params])
    want = [sampled[seeded.index(i)] if i in seeded else g for i, g in enumerate(greedy)]
    par_want = sampled[len(seeded):]
    assert len({t for w in want for t in w.token_ids}) > 50  # diverse outputs
    decode = _live(cluster, "decode")
    par_got: list[list[int]] = [[], [], []]
    par_moved = []

    async def par_stream(client):
        async for chunk in client.generate(par_prompt, n=3, max_tokens=KILL_MAX_TOKENS,
                                           **SEEDED):
            par_got[chunk.index].extend(chunk.token_ids)
            if chunk.usage is not None and chunk.usage.migrations:
                par_moved.append(chunk.index)

    async def run():
        got = [[] for _ in prompts]
        async with AsyncClient(cluster.router_address, timeout=120) as client, \
                _polled([p.address for p in decode], "decode") as infos:
            tasks = [asyncio.ensure_future(_stream(client, p, kw, g))
                     for p, kw, g in zip(prompts, params, got)]
            par = asyncio.ensure_future(par_stream(client))
            # Every stream is decoding (past its first tokens) when the worker dies, or done: on
            # a loaded machine (a busy loop beside the suite) a first stream's 320 tokens once
            # ended before the last stream's fourth. A stream done before the kill is checked
            # all the same, unmoved; the streams it moves are asserted below.
            await _until(lambda: all(len(g) >= 4 for g in got + par_got))
            # The worker running more of them dies: on a fast host (micro-llama's 320 tokens
            # take well under a second) every stream of one worker had once ended by now.
            victim = max(zip(decode, await infos()), key=lambda pi: pi[1].num_running)[0]
            _kill(victim)
            await par
            return victim, got, await asyncio.gather(*tasks)

    victim, got, finals = asyncio.run(run())
    survivor = next(p for p in decode if p is not victim)
    assert par_got == [w.token_ids for w in par_want]
    moved = [f for f in finals if f.usage.migrations]
    assert moved, "no stream was on the killed worker"
    for g, f, w in zip(got, finals, want):
        assert g == w.token_ids  # nothing lost, nothing repeated, the same tokens
        assert f.text == w.text  # the text too: a continuation resumes its detokenizer
        assert f.finish_reason == "length" and f.usage.completion_tokens == len(w.token_ids)
        assert f.usage.decode_worker_id in (victim.name, survivor.name)
        assert f.usage.timings.kv_transfer_s > 0  # the first decode leg's, kept
        if f.usage.migrations:
            assert f.usage.migrations == 1 and f.usage.decode_worker_id == survivor.name
    assert cluster_stats(cluster.router_address).requests_migrated == len(moved) + len(par_moved)
    # The dead worker gets no more requests, and the survivors hold nothing.
    prompt = random_prompts(1, seed=32)[0]

    async def after():
        async with AsyncClient(cluster.router_address, timeout=60) as client:
            return await client.complete(prompt, max_tokens=4, **GREEDY)

    assert asyncio.run(after()).usage.decode_worker_id == survivor.name
    wait_all_blocks_free(live_workers(cluster))


def test_streams_survive_a_decode_worker_that_hangs_under_them(cluster, reference):
    """A worker that stops answering but keeps its connections open (SIGSTOP: a hung process;
    a host gone without closing its sockets looks the same) is found by the router's health
    checks (router/liveness.py), and its streams move on instead of waiting for their
    deadlines."""
    hangs = cluster_stats(cluster.router_address).worker_hangs
    # One survivor after the kill test above, two when this test runs alone.
    survivors = {p.name for p in _live(cluster, "decode")}
    hung = cluster.add_worker("decode")
    cluster.wait_routable(2, len(survivors) + 1)
    # Every stream starts on the worker that hangs: left to the router's picks, a loaded
    # machine once had the streams it sent there all ended before the last stream's fourth
    # token, and nothing was left on it to move. The survivors take them back before the hang.
    admin = router_pb2_grpc.RouterAdminStub(grpc.insecure_channel(cluster.router_address))

    def drain_survivors(undrain: bool = False) -> None:
        for name in survivors:
            admin.DrainWorker(router_pb2.DrainWorkerRequest(worker_id=name, undrain=undrain),
                              timeout=10)

    drain_survivors()
    prompts, want = decisive_outputs(reference, 8, seed=35, max_tokens=160, lo=20, hi=60)
    params = dict(max_tokens=160, **GREEDY)

    async def run():
        got = [[] for _ in prompts]
        async with AsyncClient(cluster.router_address, timeout=300) as client:
            tasks = [asyncio.ensure_future(_stream(client, p, params, g))
                     for p, g in zip(prompts, got)]
            await _until(lambda: all(len(g) >= 4 for g in got))
            drain_survivors(undrain=True)
            os.kill(hung.popen.pid, signal.SIGSTOP)
            try:
                return got, await asyncio.gather(*tasks)
            finally:
                os.kill(hung.popen.pid, signal.SIGCONT)

    try:
        got, finals = asyncio.run(run())
    finally:
        drain_survivors(undrain=True)  # the module's next tests route to them
    assert got == [w.token_ids for w in want]
    moved = [f for f in finals if f.usage.migrations]
    assert moved, "no stream was on the hung worker"
    # Each on the survivor, or finished by its continuation's prefill (cut one token short of
    # its end): then no decode worker ran its last attempt.
    assert all(f.usage.decode_worker_id in survivors | {""} for f in moved)
    assert any(f.usage.decode_worker_id in survivors for f in moved)
    assert cluster_stats(cluster.router_address).worker_hangs == hangs + 1
    # Resumed, the hung worker finds its streams cancelled and frees their blocks.
    wait_all_blocks_free(live_workers(cluster))
    assert cluster.stop_proc(hung) == 0


# The slow tier: the health checks that cut a hung worker's calls are the decode hang's above
# (router/liveness.py), and prompts moving off a prefill worker is the kill's below.
@pytest.mark.slow
def test_prompts_survive_a_prefill_worker_that_hangs_under_them(cluster, reference):
    """A prefill worker that hangs with prompts on it: the router's health checks cut its
    Prefill calls, and the prompts are prefilled by the other prefill workers."""
    hangs = cluster_stats(cluster.router_address).worker_hangs
    hung = cluster.add_worker("prefill")
    cluster.wait_routable(3, len(_live(cluster, "decode")))
    # Long prompts: each prefill takes a while, so the worker is caught with some on it.
    prompts = random_prompts(9, seed=39, lo=400, hi=600)
    params = dict(max_tokens=6, **GREEDY)
    want = reference.generate(prompts, SamplingParams(**params))
    got, finals = _fault_when_busy(cluster, hung.address, prompts, params,
                                   lambda: os.kill(hung.popen.pid, signal.SIGSTOP),
                                   lambda: os.kill(hung.popen.pid, signal.SIGCONT))
    assert got == [w.token_ids for w in want]
    moved = [f for f in finals if f.usage.migrations]
    assert moved, "no prompt was on the hung worker"
    assert all(f.usage.prefill_worker_id != hung.name for f in moved)
    assert cluster_stats(cluster.router_address).worker_hangs == hangs + 1
    wait_all_blocks_free(live_workers(cluster))
    assert cluster.stop_proc(hung) == 0


def test_a_worker_whose_engine_dies_leaves_and_exits_nonzero(cluster, reference):
    """A tensor-parallel rank of a prefill worker dies under its requests: the worker's engine
    can never step again, so the worker leaves the registry, its requests move to the other
    prefill workers, and it exits with status 1 for its supervisor (pdserve up, compose, an
    orchestrator) to start it again."""
    tp2 = cluster.add_worker("prefill", extra=["--tensor-parallel-size", "2"])
    decode = len(_live(cluster, "decode"))  # one after the kill test above, two alone
    cluster.wait_routable(3, decode)
    (rank1,) = [pid for pid in descendants(tp2.popen.pid)
                if b"engine.tp_worker" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    # The rank is stopped first, so the worker's prompts wait on it until it dies: on this
    # 2-core host the TP worker once took 6 of 18 prompts and finished them in 0.2 s, and no
    # poll of its info saw one in flight.
    prompts, want = decisive_outputs(reference, 18, seed=37, max_tokens=6, lo=200, hi=400)
    params = dict(max_tokens=6, **GREEDY)
    got, finals = _fault_when_busy(cluster, tp2.address, prompts, params,
                                   lambda: os.kill(rank1, signal.SIGKILL),
                                   hold=lambda: os.kill(rank1, signal.SIGSTOP))
    assert got == [w.token_ids for w in want]
    assert tp2.popen.wait(timeout=60) == 1
    assert any(f.usage.migrations for f in finals)  # what it held moved on
    cluster.wait_routable(2, decode)  # and the router no longer counts it


def test_requests_survive_a_prefill_worker_killed_under_them(cluster, reference):
    # Long prompts queue on both prefill workers; one dies with some of them queued there,
    # in its step, or leased to a decode worker that is pulling their KV.
    prompts, want = decisive_outputs(reference, 12, seed=41, max_tokens=6, lo=300, hi=500)
    params = dict(max_tokens=6, **GREEDY)
    prefill = _live(cluster, "prefill")

    async def run():
        got = [[] for _ in prompts]
        async with AsyncClient(cluster.router_address, timeout=120) as client, \
                _polled([p.address for p in prefill], "prefill") as infos:
            tasks = [asyncio.ensure_future(_stream(client, p, params, g))
                     for p, g in zip(prompts, got)]
            await _until(lambda: any(got))  # the first prompt is through: the rest are queued
            # The worker holding more of them dies: on a fast host either worker may have
            # finished all of its prompts by now, leaving nothing to move.
            victim = max(zip(prefill, await infos()),
                         key=lambda pi: (pi[1].num_inflight, pi[1].num_leased))[0]
            _kill(victim)
            return victim, got, await asyncio.gather(*tasks)

    victim, got, finals = asyncio.run(run())
    survivor = next(p for p in prefill if p is not victim)
    assert got == [w.token_ids for w in want]
    moved = [f for f in finals if f.usage.migrations]
    assert moved and all(f.usage.prefill_worker_id == survivor.name for f in moved)
    assert cluster_stats(cluster.router_address).requests_migrated >= len(moved)
    wait_all_blocks_free(live_workers(cluster))


def test_a_stream_outlasting_its_workers_drain_moves_on(cluster, reference):
    """Scale-down: a decode worker told to stop (SIGTERM) drains, and a stream still running
    when its drain and grace end continues on another worker instead of being cut."""
    survivor = _live(cluster, "decode")[0]
    # Drain and grace of 0.2 s in all against a 990-token stream, which takes micro-llama
    # ~0.55 s in-process here: the stream is still running when they end.
    leaving = cluster.add_worker("decode", extra=["--drain-timeout-s", "0.1",
                                                  "--shutdown-grace-s", "0.1"])
    cluster.wait_routable(1, 2)
    admin = router_pb2_grpc.RouterAdminStub(grpc.insecure_channel(cluster.router_address))
    drain = router_pb2.DrainWorkerRequest(worker_id=survivor.name)
    admin.DrainWorker(drain, timeout=10)  # so the stream starts on the leaving worker
    prompt = random_prompts(1, seed=61, lo=30, hi=30)[0]
    params = dict(max_tokens=990, **GREEDY)  # WORKER_ARGS: a context of 1024

    async def run():
        got = []
        async with AsyncClient(cluster.router_address, timeout=300) as client:
            task = asyncio.ensure_future(_stream(client, prompt, params, got))
            await _until(lambda: len(got) >= 4)
            drain.undrain = True
            admin.DrainWorker(drain, timeout=10)
            stopping = asyncio.get_running_loop().run_in_executor(
                None, cluster.stop_proc, leaving)
            final = await task
            assert await stopping == 0  # it stopped cleanly, not killed
            return got, final

    got, final = asyncio.run(run())
    assert got == reference.generate([prompt], SamplingParams(**params))[0].token_ids
    assert final.usage.migrations == 1 and final.usage.decode_worker_id == survivor.name


# The slow tier: the limit itself (a migration spent per failure, MigrationsSpent, counted in
# migrations_exhausted) is tests/test_router_accounting.py's, its UNAVAILABLE
# tests/test_unhandled_calls.py's; this one kills real workers twice under a real stream.
@pytest.mark.slow
def test_a_request_whose_migrations_are_spent_fails_unavailable(cluster, reference):
    # A third decode worker stays up: only the limit can fail the request. The SDK, retrying
    # UNAVAILABLE by default, started the request over on it (a new request, a new budget).
    # Whether the moved request still runs when the second kill comes is a race (its last 388
    # tokens took 2 s in a CI run, and it had finished): a run in which it finished first is
    # tried again, up to three in all, as the rolling stops are.
    (prompt,), (full,) = decisive_outputs(reference, 1, seed=51, max_tokens=400, lo=30, hi=30)
    for _ in range(3):
        while len(_live(cluster, "decode")) < 3:
            cluster.add_worker("decode")
        decode = _live(cluster, "decode")
        cluster.wait_routable(len(_live(cluster, "prefill")), 3)
        exhausted = cluster_stats(cluster.router_address).migrations_exhausted
        got = asyncio.run(_kill_twice(cluster, decode, prompt))
        if got is not None:
            break
    else:
        pytest.fail("in 3 runs the moved request finished before its second worker was killed")
    assert len(_live(cluster, "decode")) == 1  # one was there to start it over on
    # Greedy: the first len(got) of the 400 tokens (decisive, all 400) are these.
    # What did arrive was right, up to the failure.
    assert len(got) >= 8 and got == full.token_ids[:len(got)]
    assert cluster_stats(cluster.router_address).migrations_exhausted == exhausted + 1
