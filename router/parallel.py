"""Parallel sampling (``SamplingParams.n``): n sequences from one prompt in one request.

The router runs them as n requests to the workers, each with its own migration, and streams
their chunks interleaved, tagged with their ``index``. Sequence 0 goes first; the others start
once its first token is back, by when its prefill worker holds the prompt's blocks in its
prefix cache and Redis says so, so theirs find the prompt there and compute only the partial
last block, instead of n prefills of the same prompt racing each other. With a seed, sequence
i samples with seed + i (vLLM's rule), so that seeded sequences differ and are reproducible.
A sequence that fails fails the request (the others are cancelled): the client sees one status.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from protos import common_pb2, router_pb2

MAX_N = 64


def check_n(sampling: common_pb2.SamplingParams, resumed: bool) -> int:
    n = sampling.n if sampling.HasField("n") else 1
    if not 1 <= n <= MAX_N:
        raise ValueError(f"n must be in [1, {MAX_N}], got {n}")
    if n > 1 and resumed:
        raise ValueError("resume_token_ids continue one sequence; they cannot be used with n > 1")
    return n


def sequence_request(request: router_pb2.GenerateRequest,
                     index: int) -> router_pb2.GenerateRequest:
    """Sequence ``index``'s request: the same, but for its seed, and the prompt logprobs,
    which sequence 0 alone computes and returns (the others may then hit the prefix cache)."""
    seq = router_pb2.GenerateRequest()
    seq.CopyFrom(request)
    seq.sampling.ClearField("n")
    if index > 0:
        seq.sampling.ClearField("prompt_logprobs")
    if seq.sampling.HasField("seed"):
        seq.sampling.seed = _wrap_int64(request.sampling.seed + index)
    return seq


def _wrap_int64(v: int) -> int:
    # Every int64 is a valid seed: one near the top wraps around rather than making an n > 1
    # request fail where the same seed alone is served.
    return (v + 2**63) % 2**64 - 2**63


@dataclass
class _End:
    index: int
    error: BaseException | None = None


Stream = Callable[[], AsyncIterator[router_pb2.GenerateChunk]]


async def fan_out(request_id: str,
                  streams: list[Stream]) -> AsyncIterator[router_pb2.GenerateChunk]:
    """Every stream's chunks as they come, tagged with the stream's index and ``request_id``;
    stream 0 first, the rest once it has yielded a chunk or ended."""
    queue: asyncio.Queue = asyncio.Queue()
    tasks: list[asyncio.Task] = []

    async def pump(i: int) -> None:
        try:
            async with contextlib.aclosing(streams[i]()) as chunks:
                async for chunk in chunks:
                    chunk.index = i
                    chunk.request_id = request_id
                    queue.put_nowait(chunk)
            queue.put_nowait(_End(i))
        except asyncio.CancelledError as e:
            if asyncio.current_task().cancelling():  # the reader closed: nobody waits
                raise
            # A cancel nobody sent this pump (an awaited call something else cancelled):
            # the reader, waiting for this sequence, would wait until the deadline.
            queue.put_nowait(_End(i, e))
        except BaseException as e:  # noqa: BLE001 - handed to the reader, which raises it
            queue.put_nowait(_End(i, e))

    def start_rest() -> None:
        if len(tasks) == 1:
            tasks.extend(asyncio.create_task(pump(i)) for i in range(1, len(streams)))

    tasks.append(asyncio.create_task(pump(0)))
    ended = 0
    try:
        while ended < len(streams):
            item = await queue.get()
            if isinstance(item, _End):
                if item.error is not None:
                    raise item.error
                ended += 1
            else:
                yield item
            if item.index == 0:
                start_rest()
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def request_usage(usages: list[router_pb2.Usage]) -> router_pb2.Usage:
    """A request's usage over its n sequences, as OpenAI and vLLM report it: the prompt once
    and completion tokens summed; cache hits, workers and timings are sequence 0's (it ran the
    prompt), but for the end, which is the last sequence's, and migrations are summed."""
    total = router_pb2.Usage()
    total.CopyFrom(usages[0])
    total.completion_tokens = sum(u.completion_tokens for u in usages)
    total.migrations = sum(u.migrations for u in usages)
    total.timings.e2e_s = max(u.timings.e2e_s for u in usages)
    return total
