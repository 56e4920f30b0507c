"""The router's access log (router/access_log.py): the line's fields, and real router processes
(no workers: every request fails, each way it can) logging one line per request, or none with
--disable-log-requests."""
from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time

import pytest

from client import Client, FailoverPolicy, InvalidArgumentError, UnavailableError
from protos import router_pb2
from router.access_log import request_line
from router.migration import RequestRun
from router.redis_server import free_port


def test_the_line_names_the_request_its_outcome_and_costs():
    runs = [RequestRun("r/0", [1, 2, 3], time.monotonic() - 0.5),
            RequestRun("r/1", [1, 2, 3], time.monotonic() - 0.5)]
    runs[0].usage.cached_tokens = 2
    runs[0].usage.prefill_worker_id = "prefill-1"
    runs[0].usage.decode_worker_id = "decode-2"
    runs[0].timings.CopyFrom(router_pb2.RequestTimings(ttft_s=0.0451))
    runs[0].emitted.extend([5, 6])
    runs[1].emitted.extend([7])
    runs[1].migrations = 1
    line = request_line("r", runs, "OK", finish="length")
    assert line.startswith("request r status=OK finish=length n=2 prompt=3 cached=2 output=3 "
                           "ttft_ms=45.1 e2e_ms=")
    assert line.endswith("prefill=prefill-1 decode=decode-2 migrations=1")
    assert float(line.split("e2e_ms=")[1].split()[0]) >= 500
    assert request_line("q", [], "INVALID_ARGUMENT", 'bad "x"') == \
        'request q status=INVALID_ARGUMENT error="bad \\"x\\""'
    # No first token, no ttft_ms (0.0 read as an instant first token).
    failed = request_line("f", [RequestRun("f", [1, 2], time.monotonic())], "UNAVAILABLE",
                          "no prefill worker")
    assert "ttft_ms" not in failed and " output=0 e2e_ms=" in failed


def test_a_request_id_cannot_break_or_forge_a_line():
    forged = "x status=OK\nrequest y status=OK"
    line = request_line(forged, [], "INVALID_ARGUMENT", "request_id has control characters")
    assert "\n" not in line
    assert line.startswith('request "x status=OK\\nrequest y status=OK" status=INVALID_ARGUMENT')
    assert request_line("a b", [], "OK").startswith('request "a b" status=OK')
    assert len(request_line("z" * 10_000, [], "INVALID_ARGUMENT")) < 400


def test_a_long_error_is_cut():
    """An error may quote the client's text (a template's refusal of its message): one request
    must not write megabytes to the log."""
    line = request_line("r", [], "INVALID_ARGUMENT", "e" * 2_000_000)
    assert len(line) < 1200
    kept, more = line.split('error="', 1)[1].split("\\u2026(")
    assert set(kept) == {"e"} and more == f'{2_000_000 - len(kept)} more characters)"'


def _router(redis_url: str, *flags: str):
    port = free_port()
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "router", "--redis-url",
                             redis_url, "--port", str(port), *flags], stdout=log,
                            stderr=subprocess.STDOUT)
    return proc, log, f"127.0.0.1:{port}"


def _access_lines(proc, log) -> list[str]:
    proc.send_signal(signal.SIGTERM)
    try:
        # Generous: the suite's first router may start from a venv with no bytecode yet.
        rc = proc.wait(90)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
    log.seek(0)
    text = log.read().decode()
    assert rc == 0, f"the router exited {rc}; its log ends:\n{text[-3000:]}"
    return [line.split("pdserve.access ", 1)[1] for line in text.splitlines()
            if "pdserve.access " in line]


@pytest.mark.parametrize("flags, logged", [
    ([], True), pytest.param(["--disable-log-requests"], False, marks=pytest.mark.slow)])
def test_a_router_logs_each_request_once(redis_url, flags, logged):
    proc, log, address = _router(redis_url, "--namespace", f"access-{logged}", *flags)
    try:
        with Client(address, timeout=30, failover=FailoverPolicy(max_retries=0)) as c:
            c.wait_ready(30)
            with pytest.raises(UnavailableError, match="no prefill worker"):
                c.complete("hello there", request_id="no-worker", max_tokens=4)
            with pytest.raises(InvalidArgumentError, match="temperature"):
                c.complete("hello", request_id="bad-temp", temperature=-1.0)
            with pytest.raises(InvalidArgumentError, match="empty"):
                list(c.generate("", request_id="empty"))
    finally:
        lines = _access_lines(proc, log)
    if not logged:
        assert lines == []
        return
    assert len(lines) == 3
    no_worker, bad, empty = lines
    assert no_worker.startswith("request no-worker status=UNAVAILABLE n=1 prompt=")
    assert 'error="no prefill worker is available"' in no_worker
    assert bad.startswith("request bad-temp status=INVALID_ARGUMENT error=")
    assert empty.startswith('request empty status=INVALID_ARGUMENT error="prompt text is empty"')
