"""Requests cut short at random moments, all at once, through real processes (Redis, router,
a prefill and a decode worker): client cancels, client deadlines and operator cancels
(RouterAdmin.CancelRequest) among requests that run to their end, single and parallel (n=2),
with remote prefill and with local prefill. Every call ends with the status its cut implies
(none hangs: the whole burst is bounded), and afterwards the router has nothing in flight and
every worker has every block free, sooner than a lease would expire. The races behind it (both
pinned down in tests/test_router_cancel.py): an operator cancel landing while gRPC wrote a
chunk ended the call with no status, and a request cut while its Prefill answer was on the
wire left the prompt's KV leased until the lease expired (about 1 burst in 10 here)."""
from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import grpc
import pytest

from client import AsyncClient, CancelledError, DeadlineExceededError
from protos import router_pb2, router_pb2_grpc
from router.launcher import Cluster, ClusterSpec
from tests.serving_helpers import SERVING_MODEL, WORKER_ARGS, random_prompts, wait_all_blocks_free

MODEL = SERVING_MODEL

FATES = ("finish", "client_cancel", "deadline", "operator_cancel")
LEASE_S = float(WORKER_ARGS[WORKER_ARGS.index("--kv-lease-timeout-s") + 1])
# Long enough that no cut request can finish before its cut (at most 0.6 s) on any machine.
LONG = 800


@pytest.fixture(scope="module")
def cluster():
    with Cluster(ClusterSpec(model=MODEL, worker_args=WORKER_ARGS,
                             router_args=["--max-local-prefill-length", "0"])) as c:
        yield c


@dataclass
class Plan:
    request_id: str
    prompt: list[int]
    fate: str
    n: int
    max_tokens: int
    cut_s: float  # when the cut comes (the deadline, for "deadline")


def _plans(seed: int, count: int) -> list[Plan]:
    rng = random.Random(seed)
    plans = []
    for i, prompt in enumerate(random_prompts(count, seed=seed, lo=5, hi=120)):
        fate = FATES[i % len(FATES)]
        plans.append(Plan(f"cut-{seed}-{i}", prompt, fate, n=rng.choice([1, 1, 2]),
                          max_tokens=rng.randint(4, 24) if fate == "finish" else LONG,
                          cut_s=rng.uniform(0.0, 0.6)))
    return plans


async def _consume(client: AsyncClient, plan: Plan) -> list[router_pb2.GenerateChunk]:
    timeout = max(plan.cut_s, 0.05) if plan.fate == "deadline" else 120
    chunks = []
    async for chunk in client.generate(plan.prompt, request_id=plan.request_id, n=plan.n,
                                       max_tokens=plan.max_tokens, temperature=0.0,
                                       ignore_eos=True, timeout=timeout):
        chunks.append(chunk)
    return chunks


async def _operator_cancel(admin, plan: Plan, task: asyncio.Task) -> None:
    """CancelRequest once the router has the request (NOT_FOUND until it arrives)."""
    await asyncio.sleep(plan.cut_s)
    while not task.done():
        try:
            await admin.CancelRequest(router_pb2.CancelRequestRequest(
                request_id=plan.request_id), timeout=10)
            return
        except grpc.aio.AioRpcError as e:
            assert e.code() == grpc.StatusCode.NOT_FOUND, e
            await asyncio.sleep(0.01)


async def _run(client: AsyncClient, admin, plan: Plan):
    """What the call ended with: its chunks, or the exception."""
    task = asyncio.ensure_future(_consume(client, plan))
    if plan.fate == "client_cancel":
        await asyncio.sleep(plan.cut_s)
        task.cancel()
    elif plan.fate == "operator_cancel":
        await _operator_cancel(admin, plan, task)
    try:
        return await task
    except BaseException as e:  # noqa: BLE001 - the outcome under test
        return e


def _check(plan: Plan, outcome) -> None:
    if plan.fate == "finish":
        assert isinstance(outcome, list), (plan, outcome)
        per_seq = {}
        for chunk in outcome:
            per_seq.setdefault(chunk.index, []).extend(chunk.token_ids)
        assert sorted(per_seq) == list(range(plan.n))
        assert all(len(toks) == plan.max_tokens for toks in per_seq.values()), plan
    elif plan.fate == "client_cancel":
        assert isinstance(outcome, asyncio.CancelledError), (plan, outcome)
    elif plan.fate == "deadline":
        assert isinstance(outcome, DeadlineExceededError), (plan, outcome)
    else:
        assert isinstance(outcome, CancelledError), (plan, outcome)
        assert "operator" in str(outcome), (plan, outcome)


def _burst(router_address: str, plans: list[Plan]) -> list:
    async def body():
        async with AsyncClient(router_address, timeout=120) as client, \
                grpc.aio.insecure_channel(router_address) as channel:
            admin = router_pb2_grpc.RouterAdminStub(channel)
            async with asyncio.timeout(150):  # a call that never ends fails here
                return await asyncio.gather(*(_run(client, admin, p) for p in plans))

    return asyncio.run(body())


def _nothing_left(cluster, router_address: str) -> None:
    # Sooner than a lease expires (20 s, WORKER_ARGS): a lease nobody released fails this.
    wait_all_blocks_free([p.address for p in cluster.procs if p.name != "router"],
                         timeout_s=LEASE_S / 2)
    with grpc.insecure_channel(router_address) as ch:
        listed = router_pb2_grpc.RouterAdminStub(ch).ListRequests(
            router_pb2.ListRequestsRequest(), timeout=10)
    assert list(listed.requests) == []


@pytest.mark.parametrize("local_prefill", [False, True], ids=["remote", "local"])
def test_requests_cut_at_random_moments_end_cleanly(cluster, local_prefill):
    address = cluster.router_address
    router = None
    if local_prefill:  # short prompts prefilled on the decode worker, whatever the load
        router = cluster.start_router(extra=["--max-local-prefill-length", "512",
                                             "--local-prefill-queue-threshold", "0"])
        cluster.router_address = address
    target = router.address if router else address
    try:
        plans = _plans(seed=7 + local_prefill, count=32)
        outcomes = _burst(target, plans)
        for plan, outcome in zip(plans, outcomes):
            _check(plan, outcome)
        finals = [outcome[-1].usage for plan, outcome in zip(plans, outcomes)
                  if plan.fate == "finish"]
        assert {u.local_prefill for u in finals} == {local_prefill}  # the path under test
        _nothing_left(cluster, target)
    finally:
        if router is not None:
            cluster.stop_proc(router)
