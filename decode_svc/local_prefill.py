"""Conditional disaggregation on the decode worker: a ``DecodeRequest`` with ``local_prefill``
carries only the prompt, and this worker runs it as an ordinary request of its own engine.

The engine in its decode role schedules such a request like any other: its prompt is prefilled
in chunks inside the same token budget as the running decodes, reusing this worker's own prefix
cache, and every sampled token, the first included, streams back. Leaving the stream early
(client cancel, deadline, failure) aborts the request and frees its blocks, as the remote path
does.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable

from engine.engine_front import EngineFront
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from protos import convert, worker_pb2


def check_local_prefill_request(request: worker_pb2.DecodeRequest) -> None:
    """ValueError (INVALID_ARGUMENT) when the request mixes local prefill with a remote one's
    fields: either would mean a prefill worker already ran the prompt."""
    if request.HasField("kv_handle"):
        raise ValueError("local_prefill requests must not carry a kv_handle (the decode worker "
                         "computes the prompt's KV itself)")
    if request.first_token_id != 0:
        raise ValueError("local_prefill requests must not carry a first_token_id (the decode "
                         f"worker samples the first token itself), got {request.first_token_id}")


async def stream_local_prefill(engine: EngineFront, request_id: str, prompt_token_ids: list[int],
                               params: SamplingParams,
                               to_chunk: Callable[[RequestOutput], worker_pb2.DecodeChunk],
                               resume_token_ids: list[int] = (), stream_interval: int = 1,
                               ) -> AsyncIterator[worker_pb2.DecodeChunk]:
    """Runs the prompt here and streams its outputs (one per ``stream_interval`` tokens after
    the first); the first chunk carries the first token, the prompt tokens this worker's prefix
    cache served, and the timings."""
    arrival = time.monotonic()
    outs = engine.generate(request_id, prompt_token_ids, params, resume_token_ids,
                           stream_interval)
    async with contextlib.aclosing(outs) as outs:
        first = True
        async for out in outs:
            chunk = to_chunk(out)
            if first:
                first = False
                chunk.timings.CopyFrom(_timings(out, arrival))
                chunk.num_cached_tokens = out.num_cached_tokens
                chunk.prompt_logprobs.extend(convert.prompt_logprobs_to_proto(
                    out.prompt_logprobs))
            yield chunk


def _timings(out: RequestOutput, arrival: float) -> worker_pb2.DecodeTimings:
    # No KV moved. queue_s: waiting for the first prefill chunk; first_step_s: from that chunk
    # to the first token, i.e. the whole (possibly chunked) prefill.
    now = time.monotonic()
    sched = out.first_scheduled_time or now
    return worker_pb2.DecodeTimings(kv_transfer_s=0.0, queue_s=max(sched - arrival, 0.0),
                                    first_step_s=max(now - sched, 0.0))
