"""engine/call_abort.py: a refusal reaches the caller with its status; one that finds the call
already ended, or a write to such a call, ends the handler cancelled, which grpc does not log
as a failure."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc._cython.cygrpc import ExecuteBatchError
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.call_abort import abort_call, was_refused, write_message


class _Refusing(health_pb2_grpc.HealthServicer):
    def __init__(self, abort) -> None:
        self.abort = abort

    async def Check(self, request, context):
        await self.abort(context, grpc.StatusCode.NOT_FOUND, f"no service {request.service!r}")


def _ask(abort) -> grpc.aio.AioRpcError:
    """What a caller gets from a health service that refuses through ``abort``."""
    async def main():
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(_Refusing(abort), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await health_pb2_grpc.HealthStub(ch).Check(
                        health_pb2.HealthCheckRequest(service="x"), timeout=10)
            return refused.value
        finally:
            await server.stop(0)

    return asyncio.run(main())


def test_the_caller_reads_the_status_and_message():
    refused = _ask(abort_call)
    assert refused.code() == grpc.StatusCode.NOT_FOUND
    assert refused.details() == "no service 'x'"


class _EndedCall:
    """A context whose call ended before anything could be sent (grpc fails the batch)."""

    async def abort(self, code, details="", trailing_metadata=()):  # grpc.aio's signature
        raise ExecuteBatchError("Failed \"execute_batch\"")

    async def write(self, message):
        raise ExecuteBatchError("Failed \"execute_batch\"")


def test_a_refusal_after_the_call_ended_ends_the_handler_cancelled():
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(abort_call(_EndedCall(), grpc.StatusCode.DEADLINE_EXCEEDED, "late"))


def test_a_write_after_the_call_ended_ends_the_handler_cancelled():
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(write_message(_EndedCall(), health_pb2.HealthCheckResponse()))


def test_a_grpc_without_the_private_error_still_imports_and_refuses(monkeypatch):
    """The error class is private to grpc (and its pin open-ended): a release that moves it
    must not stop every service from starting, nor a refusal from reaching its caller."""
    import importlib
    import sys
    import types

    import engine.call_abort as call_abort

    # The module's own names put back afterwards, not loaded a third time: a reload makes new
    # classes (CallEnded) that modules which imported the first ones would not recognise.
    original = dict(vars(call_abort))
    # Only while the module is imported again: grpc itself still needs its own.
    monkeypatch.setitem(sys.modules, "grpc._cython.cygrpc", types.ModuleType("cygrpc"))
    try:
        importlib.reload(call_abort)
    finally:
        monkeypatch.undo()
    try:
        assert call_abort.ExecuteBatchError == ()
        refused = _ask(call_abort.abort_call)
        assert (refused.code(), refused.details()) == (grpc.StatusCode.NOT_FOUND,
                                                      "no service 'x'")
    finally:
        vars(call_abort).clear()
        vars(call_abort).update(original)
    assert call_abort.ExecuteBatchError is ExecuteBatchError


@pytest.mark.parametrize("error, refused", [
    ("draining", True),   # admission's RejectError: the worker took none of the request
    ("engine", False),    # its engine died under the request: a failure, not a refusal
])
def test_a_workers_refusal_before_any_work_says_so_to_the_router(error, refused):
    from engine.engine_front import EngineDeadError
    from engine.worker_runtime import RejectError, abort_for

    exc = (RejectError(grpc.StatusCode.UNAVAILABLE, "worker w is draining") if error == "draining"
           else EngineDeadError("the engine died"))

    async def abort(context, code, message):
        await abort_for(context, exc)

    answer = _ask(abort)
    assert answer.code() == grpc.StatusCode.UNAVAILABLE
    assert was_refused(answer) is refused


def test_a_call_that_found_no_worker_to_connect_to_counts_as_refused():
    """A worker that exited (its port closed) since the router last read the registry: the
    call never left the router, so the request may go elsewhere as a refusal would."""
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def main():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                           timeout=10)
        return err.value

    err = asyncio.run(main())
    assert err.code() == grpc.StatusCode.UNAVAILABLE and was_refused(err)
