"""What the router and its admin service answer to odd requests, through a real gRPC server
and a real Redis (the router's services in process, no workers): a client's long text never
makes a status too long for gRPC's header or a line too long for the access log; ids that
cannot name anything are INVALID_ARGUMENT; a large prompt is tokenized off the event loop;
the cluster stats count the workers requests can reach; a stale worker is not drained; and
``pdserve admin``'s output."""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import itertools
import json
import logging
import subprocess
import sys
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.call_abort import MAX_STATUS_CHARS
from engine.grpc_server import GrpcServer, ServerConfig
from protos import common_pb2, router_pb2, router_pb2_grpc
from router.admin import RouterAdminServicer
from router.config import RouterConfig
from router.directory import WorkerDirectory
from router.prompts import INLINE_PROMPT_CHARS, ServedModel, load_served_model
from router.registry import Registry
from router.server import SERVICE_NAMES
from router.service import RouterServicer
from router.stats import RouterStats
from tests.serving_helpers import heartbeat_info

# The operator's template quotes what it refuses: the client's whole message.
ECHOING_TEMPLATE = ("{% for m in messages %}{% if m['content'].startswith('bad') %}"
                    "{{ raise_exception('refused: ' + m['content']) }}{% endif %}"
                    "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
BIG = 200_000
# Sized as a worker's heartbeat says it: the router refuses what these cannot hold.
_info = functools.partial(heartbeat_info, num_total_blocks=100, max_model_len=1024)
_namespaces = itertools.count()


@pytest.fixture(scope="module")
def served():
    model = load_served_model("tiny-llama", "auto", ECHOING_TEMPLATE)
    return _Gated(model.name, model.tokenizer, model.vocab_size,
                  chat_template=model.chat_template)


class _Gated(ServedModel):
    """The served model, whose tokenization of a large text prompt waits for ``release``
    (set by a test) once it has begun: it stands for a prompt that takes seconds."""
    gate = False
    started = threading.Event()
    release = threading.Event()

    def prompt_ids(self, msg):
        if self.gate and msg.WhichOneof("prompt") == "text" and len(msg.text) > BIG // 2:
            self.started.set()
            self.release.wait(20)  # bounded: a loop blocked here would otherwise be for ever
        return super().prompt_ids(msg)

    stray = False

    async def prompt_ids_async(self, msg):
        if self.stray:  # awaits a future something else cancels: a fault in the router
            lost = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().call_soon(lost.cancel)
            await lost
        return await super().prompt_ids_async(msg)


class _Router:
    """The router's services on a loop of their own thread, as `pdserve router` serves them."""

    def __init__(self, redis_url: str, model: ServedModel, ttl_s: float = 5.0,
                 refresh_interval_s: float = 0.5) -> None:
        self.namespace = f"refusals-{next(_namespaces)}"
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.config = RouterConfig(model="tiny-llama", redis_url=redis_url,
                                   namespace=self.namespace)
        self.registry_args = (redis_url, self.namespace, ttl_s)
        self.stats = RouterStats(8)
        self.run(self._start(model, refresh_interval_s))

    async def _start(self, model: ServedModel, refresh_interval_s: float) -> None:
        self.directory = WorkerDirectory(Registry.from_url(*self.registry_args),
                                         self.config.block_size, refresh_interval_s)
        await self.directory.start()
        self.server = GrpcServer(ServerConfig(), SERVICE_NAMES)
        self.router = RouterServicer(self.config, self.directory, model, self.stats)
        router_pb2_grpc.add_RouterServicer_to_server(self.router, self.server.server)
        router_pb2_grpc.add_RouterAdminServicer_to_server(
            RouterAdminServicer(self.directory, self.stats, self.router.inflight),
            self.server.server)
        await self.server.start()
        self.address = self.server.address

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    async def beat(self, *infos: common_pb2.WorkerInfo) -> None:
        """Heartbeats, as the workers send them."""
        registry = Registry.from_url(*self.registry_args)
        try:
            for info in infos:
                await registry.heartbeat(info)
        finally:
            await registry.r.aclose()

    def close(self) -> None:
        async def stop():
            await self.server.server.stop(0)
            await self.directory.stop()

        self.run(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def router(redis_url, served):
    r = _Router(redis_url, served)
    yield r
    r.close()


@contextlib.contextmanager
def _stubs(address: str):
    big = 64 << 20
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", big),
                                                 ("grpc.max_receive_message_length", big)]) as ch:
        yield router_pb2_grpc.RouterStub(ch), router_pb2_grpc.RouterAdminStub(ch), ch


def _refusal(call, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call(request, timeout=30)
    return err.value


def _chat(role: str, content: str) -> router_pb2.ChatPrompt:
    return router_pb2.ChatPrompt(messages=[router_pb2.ChatMessage(role=role, content=content)])


# ---- a client's text in statuses and the access log -------------------------------------


def test_long_client_text_is_cut_in_the_status_and_the_access_log(router, caplog):
    """Past gRPC's 16 KiB header limit a status turned into RESOURCE_EXHAUSTED; a 2 MB role
    wrote a 2 MB access-log line."""
    echoed = "bad" + "x" * BIG
    with _stubs(router.address) as (stub, _, _ch), \
            caplog.at_level(logging.INFO, logger="pdserve.access"):
        for call, request in [
                (stub.Tokenize, router_pb2.TokenizeRequest(chat=_chat("user", echoed))),
                (stub.Complete, router_pb2.GenerateRequest(request_id="echo",
                                                           chat=_chat("user", echoed)))]:
            err = _refusal(call, request)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            full = "the chat template refused the conversation: refused: " + echoed
            kept, more = err.details().rsplit("…(", 1)
            assert full.startswith(kept) and len(err.details()) <= MAX_STATUS_CHARS
            assert more == f"{len(full) - len(kept)} more characters)"
        err = _refusal(stub.Complete, router_pb2.GenerateRequest(
            request_id="role", chat=_chat("R" * 2_000_000, "hi")))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "role is 2000000 characters; at most 256" in err.details()
    lines = [r.getMessage() for r in caplog.records if r.name == "pdserve.access"]
    assert [line.split()[1] for line in lines] == ["echo", "role"]
    assert all(len(line) < 2 * MAX_STATUS_CHARS for line in lines)
    assert "more characters" in lines[0]


def test_admin_refusals_quote_a_clients_string_short(router):
    with _stubs(router.address) as (_, admin, _ch):
        for call, request, code in [
                (admin.ListWorkers, router_pb2.ListWorkersRequest(role="r" * BIG),
                 grpc.StatusCode.INVALID_ARGUMENT),
                (admin.ResetPrefixCache, router_pb2.ResetPrefixCacheRequest(role="r" * BIG),
                 grpc.StatusCode.INVALID_ARGUMENT),
                (admin.DrainWorker, router_pb2.DrainWorkerRequest(worker_id="w" * BIG),
                 grpc.StatusCode.NOT_FOUND),
                (admin.CancelRequest, router_pb2.CancelRequestRequest(request_id="q" * BIG),
                 grpc.StatusCode.NOT_FOUND),
                (admin.ResetPrefixCache, router_pb2.ResetPrefixCacheRequest(worker_id="w" * BIG),
                 grpc.StatusCode.NOT_FOUND)]:
            err = _refusal(call, request)
            assert err.code() == code
            assert len(err.details()) < 200 and f"…({BIG - 64} more characters)" in err.details()
        err = _refusal(admin.ListWorkers, router_pb2.ListWorkersRequest(role="pre\nfill"))
        assert "'pre\\nfill'" in err.details()  # a repr: the newline is quoted, not sent


def test_empty_ids_are_invalid_not_unknown(router):
    with _stubs(router.address) as (_, admin, _ch):
        for call, request in [
                (admin.DrainWorker, router_pb2.DrainWorkerRequest(worker_id="")),
                (admin.DrainWorker, router_pb2.DrainWorkerRequest(worker_id="", undrain=True)),
                (admin.CancelRequest, router_pb2.CancelRequestRequest(request_id=""))]:
            err = _refusal(call, request)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
            assert "is empty" in err.details()


@pytest.mark.parametrize("rid", ["a\u2028status=OK", "evil\u202etxt.exe", "x\u2029y",
                                 "zero\u200bwidth", "x\x85y"])
def test_request_ids_with_format_or_separator_characters_are_refused(router, rid):
    with _stubs(router.address) as (stub, _, _ch):
        err = _refusal(stub.Complete, router_pb2.GenerateRequest(
            request_id=rid, token_ids=router_pb2.TokenIds(ids=[1, 2, 3])))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request_id has control characters (U+" in err.details()


# ---- a large prompt is tokenized off the event loop -------------------------------------


def test_a_large_prompt_being_tokenized_stalls_no_other_call(router, served):
    """While a large prompt's tokenization runs (held at its start, as one taking seconds),
    a health check and a small request are answered: the loop is free."""
    served.started.clear()
    served.release.clear()
    served.gate = True
    try:
        with _stubs(router.address) as (stub, _, ch), \
                concurrent.futures.ThreadPoolExecutor(1) as pool:
            big = pool.submit(stub.Tokenize, router_pb2.TokenizeRequest(text="hello " * BIG),
                              timeout=60)
            assert served.started.wait(60)
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                          timeout=60)
            small = stub.Tokenize(router_pb2.TokenizeRequest(text="hello"), timeout=60)
            assert not big.done()  # answered while the large one was still being tokenized
            served.release.set()
            assert len(big.result().token_ids) > BIG // 2
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert small.token_ids == served.tokenizer.encode("hello")
    finally:
        served.gate = False
        served.release.set()


def test_a_request_cut_at_the_clients_deadline_is_logged_as_deadline_exceeded(router, served,
                                                                             caplog):
    """gRPC cancels the handler at the deadline: the access log said CANCELLED, as if the
    client had left, while the client got DEADLINE_EXCEEDED."""
    served.started.clear()
    served.release.clear()
    served.gate = True
    try:
        with _stubs(router.address) as (stub, _, _ch), \
                caplog.at_level(logging.INFO, logger="pdserve.access"):
            with pytest.raises(grpc.RpcError) as err:  # its tokenization is held past it
                stub.Complete(router_pb2.GenerateRequest(request_id="late", text="y " * BIG),
                              timeout=1.0)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            served.release.set()
            # The line is written as the handler ends, after the client has its status.
            router.run(_logged(caplog, "late"))
    finally:
        served.gate = False
        served.release.set()
    (line,) = [r.getMessage() for r in caplog.records
               if r.name == "pdserve.access" and r.getMessage().startswith("request late ")]
    assert line.startswith('request late status=DEADLINE_EXCEEDED error="deadline exceeded"')


def test_a_cancel_nobody_made_ends_the_request_internal_not_silent(router, served, caplog):
    """A handler cancelled by the router itself, not by its call: the client gets INTERNAL at
    once (grpc.aio alone sends nothing until the deadline: engine/stray_cancels.py), and the
    access log says INTERNAL, not that the client cancelled."""
    served.stray = True
    try:
        with _stubs(router.address) as (stub, _, _ch), \
                caplog.at_level(logging.INFO, logger="pdserve.access"):
            err = _refusal(stub.Complete, router_pb2.GenerateRequest(request_id="stray",
                                                                     text="hi"))
            router.run(_logged(caplog, "stray"))
    finally:
        served.stray = False
    assert err.code() == grpc.StatusCode.INTERNAL, (err.code(), err.details())
    assert "pdserve.v1.Router/Complete" in err.details()
    (line,) = [r.getMessage() for r in caplog.records
               if r.name == "pdserve.access" and r.getMessage().startswith("request stray ")]
    assert line.startswith('request stray status=INTERNAL error="the router cancelled its own')


async def _logged(caplog, request_id: str) -> None:
    for _ in range(600):  # bounded: 30 s
        if any(r.getMessage().startswith(f"request {request_id} ") for r in caplog.records):
            return
        await asyncio.sleep(0.05)


def test_a_large_prompt_gets_the_same_answers_as_a_small_one(router, served):
    long_text = "hello " * INLINE_PROMPT_CHARS
    with _stubs(router.address) as (stub, _, _ch):
        got = stub.Tokenize(router_pb2.TokenizeRequest(text=long_text), timeout=60)
        assert list(got.token_ids) == served.tokenizer.encode(long_text)
        refused = _chat("user", "bad" * INLINE_PROMPT_CHARS)
        outside = router_pb2.TokenIds(ids=[10**6] * 3 * INLINE_PROMPT_CHARS)
        for call, request, what in [
                (stub.Tokenize, router_pb2.TokenizeRequest(chat=refused), "refused: bad"),
                (stub.Complete, router_pb2.GenerateRequest(chat=refused), "refused: bad"),
                (stub.Complete, router_pb2.GenerateRequest(token_ids=outside), "vocabulary")]:
            err = _refusal(call, request)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and what in err.details()


# ---- the admin service's view of the workers --------------------------------------------


def test_cluster_stats_count_the_live_workers_in_the_routing_view(router):
    """Draining, down and other-block-size workers included: a launcher waits on these
    counts while it drains workers (the router's /metrics counts them by state)."""
    draining = _info("prefill-draining", "prefill")
    draining.draining = True
    router.run(router.beat(_info("prefill-ok", "prefill"), draining,
                           _info("prefill-bs32", "prefill", block_size=32),
                           _info("decode-ok", "decode"), _info("decode-down", "decode")))
    with _stubs(router.address) as (_, admin, _ch):
        stats = admin.GetClusterStats(router_pb2.ClusterStatsRequest(), timeout=30)
        assert (stats.num_prefill_workers, stats.num_decode_workers) == (3, 2)

        async def mark_down() -> None:  # as a failed probe does
            router.directory._mark_down(router.directory.workers["decode-down"])

        router.run(mark_down())
        stats = admin.GetClusterStats(router_pb2.ClusterStatsRequest(), timeout=30)
        assert (stats.num_prefill_workers, stats.num_decode_workers) == (3, 2)
        assert len(admin.ListWorkers(router_pb2.ListWorkersRequest(), timeout=30).workers) == 5


def test_a_stale_worker_is_not_drained_behind_a_not_found(redis_url, served):
    """A worker silent past the TTL but not purged yet: the admin is told NOT_FOUND, and the
    worker, beating again, must not come back drained."""
    # No periodic refresh: it would purge the stale worker before the drain comes.
    router = _Router(redis_url, served, ttl_s=0.3, refresh_interval_s=3600)
    try:
        stale = _info("prefill-stale", "prefill")
        router.run(router.beat(stale))
        router.run(asyncio.sleep(0.6))  # silent past the TTL
        with _stubs(router.address) as (_, admin, _ch):
            err = _refusal(admin.DrainWorker, router_pb2.DrainWorkerRequest(
                worker_id="prefill-stale"))
            assert err.code() == grpc.StatusCode.NOT_FOUND

            async def beat_again() -> bool:
                registry = Registry.from_url(*router.registry_args)
                try:
                    return (await registry.heartbeat(stale)).drained
                finally:
                    await registry.r.aclose()

            assert router.run(beat_again()) is False
            # Live again: it is drained and undrained as before.
            drain = router_pb2.DrainWorkerRequest(worker_id="prefill-stale")
            assert admin.DrainWorker(drain, timeout=30).draining
            drain.undrain = True
            assert not admin.DrainWorker(drain, timeout=30).draining
    finally:
        router.close()


# ---- pdserve admin -----------------------------------------------------------------------


def _admin_cli(address: str, *argv: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine.cli", "admin", "--router", address,
                           *argv], capture_output=True, text=True, timeout=120, **kw)


def test_admin_json_keeps_64_bit_counts_numbers(router, capsys):
    from engine.cli import main as cli_main

    router.stats.requests_total = 12
    router.run(router.beat(_info("decode-ok", "decode")))
    assert cli_main(["admin", "--router", router.address, "stats", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["requests_total"] == 12 and stats["worker_hangs"] == 0
    assert cli_main(["admin", "--router", router.address, "workers", "--json"]) == 0
    (worker,) = json.loads(capsys.readouterr().out)
    assert worker["prefix_cache_hits"] == 0 and worker["num_free_blocks"] == 100


def test_admin_reset_with_no_workers_says_so(router):
    proc = _admin_cli(router.address, "reset-prefix-cache")
    assert proc.returncode == 1
    assert "no routable worker" in proc.stderr and "nothing was reset" in proc.stderr


def test_admin_output_to_a_reader_that_left_ends_quietly(router):
    """`pdserve admin stats | head -1`: the pipe's reader is gone before the output is."""
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "admin", "--router",
                             router.address, "stats"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # long before the command's imports are done
    err = proc.stderr.read().decode()
    assert proc.wait(120) == 1
    assert "BrokenPipe" not in err and "Traceback" not in err, err


def test_admin_refuses_a_port_past_65535_rather_than_dial_it_modulo_65536(capsys):
    """gRPC dials HOST:70000 as HOST:4464: a mistyped port reached another one, or told of a
    connection refused on a port nobody typed."""
    from engine.cli import main as cli_main

    assert cli_main(["admin", "--router", "127.0.0.1:70000", "--timeout", "5", "workers"]) == 2
    assert "pdserve: error: router address '127.0.0.1:70000': the port must be in [1, 65535]" \
        in capsys.readouterr().err


def test_admin_at_an_address_that_is_no_router_says_what_it_may_be(capsys):
    """A worker's port (a server without RouterAdmin) answered "Method not found!" alone."""
    import concurrent.futures

    from engine.cli import main as cli_main

    server = grpc.server(concurrent.futures.ThreadPoolExecutor(2))  # no services at all
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        assert cli_main(["admin", "--router", f"127.0.0.1:{port}", "workers"]) == 1
    finally:
        server.stop(None)
    err = capsys.readouterr().err
    assert "pdserve admin: UNIMPLEMENTED: Method not found!" in err
    assert "is the address a pdserve router's (not a worker's)" in err
