"""Load generators for ``pdserve bench serve``: the same request lists driven through the router
(asyncio, the SDK's AsyncClient) and through an in-process ``LLMEngine``.

Every request is greedy with ``ignore_eos`` so it produces exactly its requested tokens, and
both systems see identical prompts and output lengths.
"""
from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections import deque
from dataclasses import dataclass

from bench.cpu_usage import CPUShare
from bench.serve_metrics import BREAKDOWN_FIELDS, RequestRecord
from client import AsyncClient, PdserveError


@dataclass
class LoadRequests:
    prompts: list[list[int]]
    output_lens: list[int]

    def __post_init__(self) -> None:
        if len(self.prompts) != len(self.output_lens):
            raise ValueError("one output length per prompt")

    def __len__(self) -> int:
        return len(self.prompts)


@dataclass
class LoadRun:
    records: list[RequestRecord]
    duration_s: float
    # What the cores did meanwhile (bench.cpu_usage), where the runner measured it.
    cpu: CPUShare | None = None


# --- through the router -------------------------------------------------------------------
async def one_request(client: AsyncClient, prompt: list[int], max_tokens: int) -> RequestRecord:
    rec = RequestRecord(time.perf_counter(), len(prompt))
    try:
        async for chunk in client.generate(prompt, max_tokens=max_tokens, temperature=0.0,
                                           ignore_eos=True):
            now = time.perf_counter()
            rec.add_chunk(now, len(chunk.token_ids))
            if chunk.finish_reason:
                # The answer is complete here (vLLM's E2EL ends at its last chunk): the
                # router's clean-up and the call's closing status after it are no latency
                # of the request, and the in-process baseline has neither.
                rec.finish_reason, rec.end = chunk.finish_reason, now
            if chunk.usage is not None:
                t = chunk.usage.timings
                rec.breakdown = {f: getattr(t, f) for f in BREAKDOWN_FIELDS}
                rec.cached_tokens = chunk.usage.cached_tokens
    except PdserveError as e:
        # A failed request counts as failed, not as a crash of the whole benchmark.
        rec.error = f"{e.code.name}: {e.details}"
    return rec


async def closed_loop(client: AsyncClient, reqs: LoadRequests, concurrency: int) -> LoadRun:
    """``concurrency`` users, each sending its next request as soon as the last one ends."""
    records: list[RequestRecord | None] = [None] * len(reqs)
    todo = iter(range(len(reqs)))  # shared: each user takes the next index

    async def user() -> None:
        for i in todo:
            records[i] = await one_request(client, reqs.prompts[i], reqs.output_lens[i])

    t0 = time.perf_counter()
    await asyncio.gather(*(user() for _ in range(concurrency)))
    return LoadRun(records, time.perf_counter() - t0)  # type: ignore[arg-type]


async def poisson(client: AsyncClient, reqs: LoadRequests, rate: float, seed: int) -> LoadRun:
    """Open loop: requests start at Poisson arrivals of ``rate`` per second, whatever is in
    flight."""
    tasks = []
    t0 = time.perf_counter()
    # Sent at times fixed ahead: a client slow to wake does not slow the arrivals down, and
    # nothing waits after the last one.
    for due, prompt, n in zip(arrival_times(len(reqs), rate, seed), reqs.prompts,
                              reqs.output_lens):
        await asyncio.sleep(max(0.0, t0 + due - time.perf_counter()))
        tasks.append(asyncio.ensure_future(one_request(client, prompt, n)))
    records = await asyncio.gather(*tasks)
    return LoadRun(list(records), time.perf_counter() - t0)


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each of ``n`` requests arrives: a Poisson process of
    ``rate`` per second (exponential gaps), the first at once."""
    rng = random.Random(seed)
    times = [0.0]
    for _ in range(n - 1):
        times.append(times[-1] + rng.expovariate(rate))
    return times[:n]


async def sequential(client: AsyncClient, reqs: LoadRequests) -> list[RequestRecord]:
    return [await one_request(client, p, n) for p, n in zip(reqs.prompts, reqs.output_lens)]


# --- in process ---------------------------------------------------------------------------
_ids = itertools.count()


def inprocess_closed_loop(engine, reqs: LoadRequests, concurrency: int,
                          stream_interval: int = 1) -> LoadRun:
    """The same closed loop on an ``LLMEngine``: a finished request's slot is refilled
    before the next step, as a client would do at once. Tokens count as arriving when the
    step that made them returns; ``stream_interval``: the cluster's, so that the engine
    hands out outputs as the cluster's decode engine does."""
    from engine import SamplingParams

    records: dict[str, RequestRecord] = {}
    order: list[str] = []
    todo = deque(range(len(reqs)))
    active: set[str] = set()

    def admit() -> None:
        while todo and len(active) < concurrency:
            i = todo.popleft()
            rid = f"bench-{next(_ids)}"
            records[rid] = RequestRecord(time.perf_counter(), len(reqs.prompts[i]))
            order.append(rid)
            active.add(rid)
            engine.add_request(rid, reqs.prompts[i], SamplingParams(
                max_tokens=reqs.output_lens[i], temperature=0.0, ignore_eos=True),
                stream_interval=stream_interval)

    t0 = time.perf_counter()
    admit()
    while active:
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            rec = records.get(out.request_id)
            if rec is None:
                continue
            rec.add_chunk(now, len(out.new_token_ids))
            rec.cached_tokens = out.num_cached_tokens
            if out.finished:
                rec.end = now
                rec.finish_reason = out.finish_reason
                active.discard(out.request_id)
        admit()
    return LoadRun([records[r] for r in order], time.perf_counter() - t0)
