"""The router's end of DecodeMany (router/decode_mux.py) with a request nobody reads: its
client stopped reading, so the router's handler waits in a write and its events queue up. The
queue holds that request's output, not the other requests' that came in the same messages.

A real decode worker (an aggregated cluster: the requests are local prefills) and the router's
mux in this process, where its memory is measured: glibc's count of the bytes in use."""
from __future__ import annotations

import asyncio
import ctypes
import gc

import grpc
import pytest

from protos import worker_pb2_grpc
from router.decode_mux import DecodeMux
from router.launcher import Cluster, ClusterSpec
from tests.decode_stream import local_request
from tests.serving_helpers import WORKER_ARGS, random_prompts, wait_all_blocks_free


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


@pytest.fixture(scope="module")
def decode_address():
    try:
        ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        pytest.skip("needs glibc's mallinfo2 to measure memory")
    with Cluster(ClusterSpec(num_prefill=0, worker_args=WORKER_ARGS)) as c:
        yield next(p.address for p in c.procs if p.name.startswith("decode"))


def test_an_unread_request_holds_its_own_output_not_its_neighbours(decode_address):
    """One request left unread after its first chunk while eight others, with 20 logprobs a
    token, decode beside it in the same engine steps. Each event it queued shared its message's
    memory with the others' events, and kept all of it: the router held every request's output
    (6 MB for 5 KB of its own, measured) for as long as that client did not read."""
    num_others, max_tokens = 8, 300
    prompts = random_prompts(num_others + 2, seed=83, lo=20, hi=40)

    async def run():
        channel = grpc.aio.insecure_channel(decode_address)
        mux = DecodeMux(worker_pb2_grpc.DecodeWorkerStub(channel), "decode-under-test")

        async def read_all(rid: str, prompt: list[int], n: int, logprobs: int = 0) -> int:
            req = local_request(rid, prompt, n)
            req.sampling.logprobs = logprobs
            return sum([c.ByteSize() async for c in mux.decode(req, 120.0)])

        unread = mux.decode(local_request("unread", prompts[0], max_tokens), 120.0)
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
