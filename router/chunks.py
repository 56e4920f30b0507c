"""The router's side of chunks: the first decode chunk's timings, a final chunk's usage, the
unary Complete's answer from merged chunks, and a continuation's request."""
from __future__ import annotations

import time

from protos import router_pb2, worker_pb2
from protos.limits import ENV as MAX_MESSAGE_ENV
from protos.stream_interval import merge_chunk
from router.migration import RequestRun
from router.parallel import request_usage


def record_first_decode_chunk(d: worker_pb2.DecodeChunk, local: bool, run: RequestRun) -> None:
    """Timings (and, for local prefill, the first token's time and cache hits) from a decode
    worker's first chunk. The request's first decode leg sets them; a continuation's leaves
    them."""
    timings = run.timings
    if run.decode_timed or (local and run.started):
        return
    run.decode_timed = True
    if not local:
        timings.kv_transfer_s = d.timings.kv_transfer_s
        timings.decode_queue_s = d.timings.queue_s
        timings.first_decode_step_s = d.timings.first_step_s
        return
    # The decode worker's queue and prefill are this request's prefill phases. No KV moved
    # and no step decoded on its own before the first token, so kv_transfer_s, decode_queue_s
    # and first_decode_step_s stay 0; cached_tokens is the decode worker's own prefix hits.
    timings.prefill_queue_s = d.timings.queue_s
    timings.prefill_compute_s = d.timings.first_step_s
    timings.ttft_s = time.monotonic() - run.t0
    run.usage.cached_tokens = prompt_cached_tokens(d.num_cached_tokens, run)


def prompt_cached_tokens(num_cached: int, run: RequestRun) -> int:
    """The prompt tokens of a worker's prefix hits. A continuation's hits (prompt and resumed
    output run together) may reach past the prompt: the usage counts prompt tokens only."""
    return min(num_cached, len(run.prompt_token_ids))


def finish_chunk(chunk: router_pb2.GenerateChunk, src, run: RequestRun) -> None:
    """Marks ``chunk`` final: the worker's finish and stop reasons, then timings and usage."""
    chunk.finish_reason = src.finish_reason
    if src.HasField("stop_reason"):
        chunk.stop_reason.CopyFrom(src.stop_reason)
    run.timings.e2e_s = time.monotonic() - run.t0
    run.usage.migrations = run.migrations
    run.usage.timings.CopyFrom(run.timings)
    chunk.usage.CopyFrom(run.usage)


def without_prompt_logprobs(request: router_pb2.GenerateRequest) -> router_pb2.GenerateRequest:
    out = router_pb2.GenerateRequest()
    out.CopyFrom(request)
    out.sampling.ClearField("prompt_logprobs")
    return out


def complete_response(seqs: list[router_pb2.GenerateChunk]) -> router_pb2.CompleteResponse:
    """Sequence 0 at the top (the only one when n = 1), with the request's usage; every one in
    ``choices`` when n > 1. ``seqs``: each sequence's chunks merged into one, in index order."""
    choices = [router_pb2.Choice(
        index=c.index, token_ids=c.token_ids, text=c.text_delta, logprobs=c.logprobs,
        finish_reason=c.finish_reason, usage=c.usage,
        stop_reason=c.stop_reason if c.HasField("stop_reason") else None) for c in seqs]
    first = choices[0]
    resp = router_pb2.CompleteResponse(
        request_id=seqs[0].request_id, token_ids=first.token_ids, text=first.text,
        logprobs=first.logprobs, finish_reason=first.finish_reason,
        usage=request_usage([c.usage for c in choices]),
        prompt_logprobs=seqs[0].prompt_logprobs)
    if first.HasField("stop_reason"):
        resp.stop_reason.CopyFrom(first.stop_reason)
    if len(choices) > 1:
        resp.choices.extend(choices)
    return resp


class WholeAnswer:
    """Complete's answer: each sequence's chunks merged as they come, then the response,
    made (``close``) before the request counts as finished, so that one over the message
    limit counts as failed, as the client sees it."""

    def __init__(self, model: router_pb2.ModelIdentity, max_message_bytes: int) -> None:
        self.model = model
        self.max_message_bytes = max_message_bytes
        self.merged: dict[int, router_pb2.GenerateChunk] = {}  # per sequence index
        self.response: router_pb2.CompleteResponse | None = None

    def add(self, chunk: router_pb2.GenerateChunk) -> None:
        if chunk.index in self.merged:
            merge_chunk(self.merged[chunk.index], chunk)
        else:
            self.merged[chunk.index] = chunk

    def close(self) -> None:
        resp = complete_response([self.merged[i] for i in sorted(self.merged)])
        resp.model.CopyFrom(self.model)
        size = resp.ByteSize()
        if size > self.max_message_bytes:
            # Every chunk fitted a message, their sum need not (logprobs of every token of
            # every sequence): refused by name, where gRPC's own refusal would read as
            # RESOURCE_EXHAUSTED, "try later".
            raise ValueError(
                f"the whole answer would be {size} bytes, over the {self.max_message_bytes}-"
                f"byte message limit ({MAX_MESSAGE_ENV}): stream it with Generate, or ask for "
                "fewer logprobs, tokens or sequences")
        self.response = resp
