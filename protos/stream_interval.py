"""``--stream-interval N``: a stream of output chunks sent one chunk per N tokens.

Each chunk costs a gRPC message to send and another to read: at GPU decode rates, a message per
token per request is most of a router's CPU, and on a small host the hops cost what the model
needs. The router groups its chunks to a client here, and passes N on to the decode worker
(``DecodeRequest.stream_interval``), whose engine makes one output per N tokens in the first
place (``LLMEngine.add_request(stream_interval=)``), so its event loop wakes once a chunk, not
once a step. The first chunk still leaves at once (TTFT is unchanged), then the tokens, text
and logprobs of N tokens travel together, and the final chunk carries whatever is left with the
finish reason and usage. Tokens already held when the stream fails are sent before the error,
so a caller that fails over resumes from everything that reached it (tokens a dying decode
engine still held are recomputed where the request resumes). Works on any chunk message with
``token_ids``, ``text_delta`` and ``finish_reason`` (router.GenerateChunk, worker.DecodeChunk).
"""
from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import TypeVar

from google.protobuf.message import Message

Chunk = TypeVar("Chunk", bound=Message)


async def every_n_tokens(chunks: AsyncIterator[Chunk], n: int) -> AsyncIterator[Chunk]:
    held: Chunk | None = None
    first = True
    try:
        # Closed with this generator: leaving early must close the source at once (a decode
        # worker's source aborts its request and frees its blocks when closed).
        async with contextlib.aclosing(chunks):
            async for c in chunks:
                if first:
                    first = False
                    yield c
                    continue
                if held is None:
                    held = c
                else:
                    merge_chunk(held, c)
                if c.finish_reason or len(held.token_ids) >= n:
                    out, held = held, None
                    yield out
    except Exception:  # a failure, not a cancel: the caller is still there to read them
        if held is not None:
            yield held
        raise
    if held is not None:  # the stream ended without a final chunk (never, but do not drop it)
        yield held


def merge_chunk(into: Message, c: Message) -> None:
    """Appends chunk ``c`` (of the same sequence) to ``into``: repeated fields (tokens,
    logprobs) concatenate, the text too, and what only one chunk carries (finish reason, stop
    reason, usage, first-chunk timings) is kept from the chunk that has it."""
    text = into.text_delta + c.text_delta
    into.MergeFrom(c)
    into.text_delta = text
