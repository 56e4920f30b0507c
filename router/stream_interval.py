"""``--stream-interval N``: the router sends a client one chunk per N output tokens.

Each chunk a client stream carries costs the router a gRPC message (and the client one more
to read): at GPU decode rates, a message per token per request is most of the router's CPU.
With N > 1 the first chunk still leaves at once (TTFT is unchanged), then the tokens, text
and logprobs of N tokens travel together, and the final chunk carries whatever is left with
the finish reason and usage. Tokens already held when the request fails are sent before the
error, so a client that fails over resumes from everything the router had.
"""
from __future__ import annotations

from collections.abc import AsyncIterator

from protos import router_pb2


async def every_n_tokens(chunks: AsyncIterator[router_pb2.GenerateChunk],
                         n: int) -> AsyncIterator[router_pb2.GenerateChunk]:
    held: router_pb2.GenerateChunk | None = None
    first = True
    try:
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


def merge_chunk(into: router_pb2.GenerateChunk, c: router_pb2.GenerateChunk) -> None:
    """Appends chunk c (of the same sequence) to ``into``."""
    into.token_ids.extend(c.token_ids)
    into.text_delta += c.text_delta
    into.logprobs.extend(c.logprobs)
    into.prompt_logprobs.extend(c.prompt_logprobs)
    if c.finish_reason:
        into.finish_reason = c.finish_reason
        if c.HasField("stop_reason"):
            into.stop_reason.CopyFrom(c.stop_reason)
        into.usage.CopyFrom(c.usage)
