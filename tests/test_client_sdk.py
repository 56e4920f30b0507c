"""The SDK against routers of the test's own (real gRPC servers on loopback): what it sends,
the ids and deadlines the caller sees, and its life after close or without one."""
from __future__ import annotations

import asyncio
import gc
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from client import AsyncClient, Client, FailoverPolicy
from client.types import build_request
from protos import router_pb2, router_pb2_grpc

NO_CHECKS = FailoverPolicy(health_check_interval_s=0, backoff_s=0.0)


class _Router(router_pb2_grpc.RouterServicer):
    """Streams two tokens, or fails with UNAVAILABLE after ``fail_after`` chunks (None: never),
    taking ``delay_s`` before answering; a unary Complete echoes the request's id."""

    def __init__(self, fail_after: int | None = None, delay_s: float = 0.0) -> None:
        self.fail_after, self.delay_s = fail_after, delay_s
        self.requests: list[router_pb2.GenerateRequest] = []

    def Generate(self, request, context):
        self.requests.append(request)
        time.sleep(self.delay_s)
        rid = request.request_id or f"assigned-{len(self.requests)}"
        start = len(request.resume_token_ids)
        for i in range(start, 2):
            if self.fail_after is not None and i - start >= self.fail_after:
                context.abort(grpc.StatusCode.UNAVAILABLE, "router lost")
            chunk = router_pb2.GenerateChunk(request_id=rid, token_ids=[10 + i])
            if i == 1:
                chunk.finish_reason = "length"
                chunk.usage.completion_tokens = 2
            yield chunk

    def Complete(self, request, context):
        self.requests.append(request)
        time.sleep(self.delay_s)
        if self.fail_after is not None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "router lost")
        return router_pb2.CompleteResponse(request_id=request.request_id, token_ids=[10, 11],
                                           finish_reason="length")

    def GetModelInfo(self, request, context):
        return router_pb2.ModelInfo(model="m", vocab_size=100, max_model_len=64)


@pytest.fixture
def routers():
    """Starts the routers a test asks for; each an address and its servicer."""
    servers = []

    def start(*servicers: _Router) -> list[str]:
        addresses = []
        for servicer in servicers:
            servers.append(grpc.server(ThreadPoolExecutor(8)))
            router_pb2_grpc.add_RouterServicer_to_server(servicer, servers[-1])
            addresses.append(f"127.0.0.1:{servers[-1].add_insecure_port('127.0.0.1:0')}")
            servers[-1].start()
        return addresses

    yield start
    for server in servers:
        server.stop(None)


def test_a_lone_string_is_one_entry_and_a_bad_request_id_is_named():
    req = build_request("Hi", None, {"bad_words": "hello", "stop": "world"})
    assert list(req.sampling.bad_words) == ["hello"]  # not h, e, l, l, o
    assert list(req.sampling.stop) == ["world"]
    assert list(build_request("Hi", None, {"bad_words": ["a b", "c"]}).sampling.bad_words) \
        == ["a b", "c"]
    with pytest.raises(TypeError, match="request_id must be a str, got int"):
        build_request("Hi", 123, {})
    with pytest.raises(ValueError, match="request_id cannot be sent"):
        build_request("Hi", "r\ud800", {})
    # A number too large for a double: protobuf's OverflowError escaped unnamed.
    with pytest.raises(ValueError, match="sampling argument temperature=.* cannot be sent"):
        build_request("Hi", None, {"temperature": 2**1030})
    with pytest.raises(ValueError, match="sampling argument logit_bias=.* cannot be sent"):
        build_request("Hi", None, {"logit_bias": {5: 2**1100}})


@pytest.mark.parametrize("prompt, error, match", [
    ("caf\udce9", ValueError, r"the prompt cannot be sent: it is not valid Unicode text "
                               r"\(byte 0xe9 at character 3: not UTF-8"),
    ("a\ud800", ValueError, r"\(surrogates not allowed: '\\ud800' at character 1\)"),
    ([{"role": "user", "content": "a\ud800"}], ValueError,
     "chat message 0's content cannot be sent"),
    ([1, 1 << 63], ValueError, f"prompt token id {1 << 63} cannot be sent"),
    # Keys the router would not render, dropped unsaid (the engine refuses them).
    ([{"role": "user", "content": "hi", "images": []}], TypeError,
     r"chat message 0 may have only the keys 'role', 'content', 'name', 'tool_call_id', "
     r"'tool_calls', got \['content', 'images', 'role'"),
    ([{"role": "tool", "content": "hi", "tool_call_id": "c\ud800"}], ValueError,
     "chat message 0's tool_call_id cannot be sent"),
    ([{"role": "user", "content": "hi", "name": "b\ud800"}], ValueError,
     "chat message 0's name cannot be sent"),
    ([1, True], TypeError, r"a list of token ids \(int, not bool\)"),
])
def test_a_prompt_protobuf_cannot_carry_is_refused_by_name(prompt, error, match):
    """Protobuf's own errors name neither the field nor the value (a raw UnicodeEncodeError,
    'Value out of range'), and took True for token id 1."""
    with pytest.raises(error, match=match):
        build_request(prompt, None, {})
    assert list(build_request([0, (1 << 63) - 1], None, {}).token_ids.ids) == [0, (1 << 63) - 1]


def test_tokenize_and_detokenize_refuse_unsendable_input_by_name():
    from client.types import detokenize_request, tokenize_request
    with pytest.raises(ValueError, match="the text cannot be sent"):
        tokenize_request("\ud800")
    with pytest.raises(ValueError, match="detokenize token id -9223372036854775809"):
        detokenize_request([-(1 << 63) - 1], True)


def test_a_failed_over_request_keeps_the_callers_id(routers):
    lost, other = _Router(fail_after=1), _Router()
    addresses = routers(lost, other)
    with Client(addresses, timeout=30, failover=NO_CHECKS) as c:
        chunks = list(c.generate([5, 6], request_id="my-req", max_tokens=2))
        # Without an id of the caller's, the first router's choice holds throughout.
        unnamed = list(c.generate([5, 6], max_tokens=2))
        assert [ch.token_ids for ch in chunks] == [[10], [11]]
        assert other.requests[0].request_id == "my-req~r1"  # on the wire only
        assert [ch.request_id for ch in chunks] == ["my-req", "my-req"]
        assert chunks[-1].usage.migrations == 1
        assert {ch.request_id for ch in unnamed} == {"assigned-2"}  # the lost router's 2nd

        done = c.complete([5, 6], request_id="my-req", max_tokens=2)
        assert (done.request_id, done.usage.migrations) == ("my-req", 1)

    async def unary():
        async with AsyncClient(addresses, timeout=30, failover=NO_CHECKS) as ac:
            return await ac.complete([5, 6], request_id="async-req", max_tokens=2)

    done = asyncio.run(unary())
    assert (done.request_id, done.usage.migrations) == ("async-req", 1)


def test_a_blocking_streams_deadline_starts_when_it_is_read(routers):
    # Each call takes 0.3 s of a 1 s deadline: streams made ahead and read one after another
    # all fit, as they do with AsyncClient, if each deadline starts with its own call.
    addresses = routers(_Router(delay_s=0.3))
    with Client(addresses, timeout=1.0, failover=NO_CHECKS) as c:
        streams = [c.generate([5], max_tokens=2) for _ in range(4)]
        assert [[t for ch in s for t in ch.token_ids] for s in streams] == [[10, 11]] * 4
        with pytest.raises(ValueError, match="timeout"):
            c.generate([5], timeout=-1)  # still checked when the iterator is made


def test_wait_ready_without_a_limit_waits_until_the_router_answers(routers):
    addresses = routers(_Router())
    with Client(addresses, failover=NO_CHECKS) as c:
        c.wait_ready(None)  # raised TypeError (None + a float)
        assert c.model_info().model == "m"

    async def run():
        async with AsyncClient(addresses, failover=NO_CHECKS) as ac:
            await ac.wait_ready(None)
            return (await ac.model_info()).model

    assert asyncio.run(run()) == "m"


def test_an_address_that_is_no_router_says_so():
    """A worker's port (any server without the Router service) answered "Method not found!"
    alone, as a bare PdserveError."""
    from client import UnimplementedError

    server = grpc.server(ThreadPoolExecutor(2))  # no services at all
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with Client(f"127.0.0.1:{port}", failover=NO_CHECKS, timeout=10) as c:
            for call in (lambda: c.complete([5], max_tokens=2), lambda: list(c.generate([5]))):
                with pytest.raises(UnimplementedError,
                                   match=r"is the address a pdserve router's \(not a worker's\)"):
                    call()
    finally:
        server.stop(None)


def test_a_closed_client_says_so(routers):
    addresses = routers(_Router())
    c = Client(addresses, failover=NO_CHECKS)
    assert c.complete([5], max_tokens=2).token_ids == [10, 11]
    c.close()
    for call in (lambda: c.complete([5]), lambda: list(c.generate([5])), c.model_info):
        with pytest.raises(RuntimeError, match="this Client is closed"):
            call()

    async def run():
        ac = AsyncClient(addresses)
        assert (await ac.model_info()).model == "m"
        await ac.close()
        with pytest.raises(RuntimeError, match="this AsyncClient is closed"):
            await ac.model_info()
        with pytest.raises(RuntimeError, match="this AsyncClient is closed"):
            async for _ in ac.generate([5]):
                pass
        return _health_checks()

    assert asyncio.run(run()) == []  # nothing started again after the close


def _health_checks() -> list[asyncio.Task]:
    # By qualname: a check in flight runs as its own task (check_loop.<locals>.check).
    return [t for t in asyncio.all_tasks() if not t.done()
            and getattr(t.get_coro(), "__qualname__", "") == "check_loop"]


def test_an_async_client_dropped_without_close_stops_its_health_checks(routers):
    addresses = routers(_Router())

    async def run():
        clients = [AsyncClient(addresses) for _ in range(3)]
        for ac in clients:
            assert (await ac.model_info()).model == "m"  # its health checks start
        checks = _health_checks()  # the tasks hold the routers, not the clients
        assert len(checks) == 3
        refs = [weakref.ref(ac) for ac in clients]
        del clients, ac
        gc.collect()
        # A check in flight ends its grpc call before its loop's task can end.
        await asyncio.wait(checks, timeout=10)
        return [r() for r in refs], [t for t in checks if not t.cancelled()]

    clients, left = asyncio.run(run())
    assert clients == [None, None, None] and left == []
