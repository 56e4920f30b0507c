"""The bounds and backoff of a prefilled request's wait for decode room (router/decode_wait.py);
the wait through a real cluster is in test_serving_decode_wait.py."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from client.liveness import rpc_error
from router.config import RouterConfig
from router.decode_wait import LEASE_MARGIN_S, MAX_DELAY_S, DecodeWait, is_decode_full
from router.directory import NoWorkerError

FULL = rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "no room for 453 tokens (27 free blocks)")


def test_the_wait_ends_before_the_lease_the_deadline_and_the_limit():
    def budget(**kw) -> float:
        w = DecodeWait.after_prefill(**kw)
        return w.until - w.started

    assert budget(wait_timeout_s=30, lease_timeout_s=20,
                  deadline_remaining=None) == pytest.approx(20 - LEASE_MARGIN_S)
    assert budget(wait_timeout_s=30, lease_timeout_s=20, deadline_remaining=3) == 3
    assert budget(wait_timeout_s=5, lease_timeout_s=60, deadline_remaining=None) == 5
    # A lease about to end, a timeout of 0: no wait at all.
    assert budget(wait_timeout_s=30, lease_timeout_s=1, deadline_remaining=None) == 0
    assert budget(wait_timeout_s=0, lease_timeout_s=60, deadline_remaining=None) == 0


def test_only_refusals_for_room_are_waited_out():
    assert is_decode_full(FULL)
    assert is_decode_full(NoWorkerError(grpc.StatusCode.RESOURCE_EXHAUSTED, "no room"))
    assert not is_decode_full(NoWorkerError(grpc.StatusCode.UNAVAILABLE, "none up"))
    assert not is_decode_full(rpc_error(grpc.StatusCode.UNAVAILABLE, "worker died"))
    assert not is_decode_full(ValueError("bad"))

    async def body():
        w = DecodeWait.after_prefill(30, 60, None)
        for other in (rpc_error(grpc.StatusCode.UNAVAILABLE, "gone"), ValueError("bad")):
            with pytest.raises(type(other)):
                await w.backoff(other)
        assert w.retries == 0 and w.waited_s == 0
        delays = []
        for _ in range(8):
            t = time.monotonic()
            await w.backoff(FULL)
            delays.append(time.monotonic() - t)
        assert w.retries == 8 and w.waited_s >= sum(delays)
        # Backs off, up to the cap (jittered down to half of it).
        assert delays[-1] > delays[0] and max(delays) < MAX_DELAY_S + 0.1

    asyncio.run(body())


def test_the_refusal_goes_to_the_client_once_the_time_is_spent():
    async def body():
        w = DecodeWait.after_prefill(0.05, 60, None)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            while True:
                await w.backoff(FULL)
        assert err.value is FULL and w.retries >= 1
        assert time.monotonic() <= w.until + 0.01

    asyncio.run(body())


@pytest.mark.parametrize("value", [-1, float("inf"), float("nan"), True, "5"])
def test_a_bad_decode_wait_timeout_is_refused(value):
    with pytest.raises(ValueError, match="decode_wait_timeout_s"):
        RouterConfig(model="tiny-llama", redis_url="redis://localhost:6379",
                     decode_wait_timeout_s=value)


def test_the_flag_default_is_the_configs():
    import argparse

    from engine.cli_serve import add_router_args

    p = argparse.ArgumentParser()
    add_router_args(p)
    assert p.parse_args(["--redis-url", "redis://x"]).decode_wait_timeout_s == \
        RouterConfig(model="m", redis_url="redis://x").decode_wait_timeout_s
