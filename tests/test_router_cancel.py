"""RouterAdmin.CancelRequest ends a request even when the cancel of its handler's task is
lost (Python 3.11's asyncio.wait_for inside redis-py swallows one landing as a Redis reply
arrives: client/tasks.py). The router's request path in process, its workers replaced by a
stream of chunks."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from protos import common_pb2, router_pb2
from router.config import RouterConfig
from router.errors import RouterRejectError
from router.prompts import load_served_model
from router.service import RouterServicer
from router.stats import RouterStats


def test_an_operator_cancel_whose_task_cancel_was_lost_still_ends_the_request():
    model = load_served_model("tiny-llama", "auto", None)
    servicer = RouterServicer(RouterConfig(model="tiny-llama", redis_url="redis://unused"),
                              None, model, RouterStats(8))

    async def sequence(run, request, context):  # what the workers would stream
        for i in range(100):
            await asyncio.sleep(0.005)
            yield router_pb2.GenerateChunk(request_id=run.request_id, token_ids=[100 + i])

    servicer._sequence = sequence
    request = router_pb2.GenerateRequest(
        request_id="r1", token_ids=router_pb2.TokenIds(ids=[11, 12, 13]),
        sampling=common_pb2.SamplingParams(max_tokens=100, temperature=0.0))
    got = []

    async def body():
        async for chunk in servicer._generate(request, None, time.monotonic()):
            got.append(chunk)
            if len(got) == 3:
                # What CancelRequest does, but with the task's cancel lost.
                servicer.inflight._by_id["r1"].cancelled = True

    with pytest.raises(RouterRejectError) as err:
        asyncio.run(body())
    assert err.value.code == grpc.StatusCode.CANCELLED
    assert "operator" in str(err.value)
    assert len(got) == 3 and len(servicer.inflight) == 0
