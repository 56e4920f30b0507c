"""bench/interceptor_cost.py on real servers, a few calls: both sides measured, and the
intercepted side refuses malformed bytes while the other does not (so the two differ in what
they are said to differ in)."""
from __future__ import annotations

import asyncio

import grpc

from bench import interceptor_cost
from tests.malformed_wire import GARBAGE, send_raw


def test_compare_measures_both_servers():
    costs = asyncio.run(interceptor_cost.compare(calls=5, messages=20, rounds=1))
    assert set(costs) == {"with", "without"}
    assert all(c.unary_us > 0 and c.stream_us > 0 for c in costs.values())


def test_only_the_intercepted_server_refuses_malformed_bytes():
    async def code(intercepted: bool):
        server = interceptor_cost._server(intercepted, 1)
        await server.start()
        try:
            err = await asyncio.to_thread(_send, server.address)
        finally:
            await server.server.stop(0)
        return err.code()

    assert asyncio.run(code(True)) == grpc.StatusCode.INVALID_ARGUMENT
    assert asyncio.run(code(False)) == grpc.StatusCode.UNKNOWN


def _send(address: str):
    with grpc.insecure_channel(address) as channel:
        return send_raw(channel, "/bench.Stream/Run", False, True, GARBAGE)


def test_main_prints_the_ratio(capsys):
    interceptor_cost.main(["--unary", "3", "--stream-messages", "5", "--rounds", "1"])
    out = capsys.readouterr().out
    assert "with / without: unary " in out and out.count("us a unary call") == 2
