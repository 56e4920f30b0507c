"""One line per request on the ``pdserve.access`` logger: who served it, what it cost, how it
ended. On by default; ``--disable-log-requests`` turns it off.

    request req-1f2e status=OK finish=length n=1 prompt=123 cached=64 output=32
    ttft_ms=45.1 e2e_ms=812.0 prefill=prefill-41003 decode=decode-40127 migrations=0

(one line), or ``status=UNAVAILABLE error="no prefill worker is available"`` and what was known
by then (no ``ttft_ms`` before a first token). Token counts of n > 1 sequences add up; timings
and workers are sequence 0's.
"""
from __future__ import annotations

import json
import logging
import time

from engine.call_abort import capped
from router.inflight import MAX_REQUEST_ID_CHARS
from router.migration import RequestRun

logger = logging.getLogger("pdserve.access")


# A request id is the client's text: one that could break the line (or forge another) is
# quoted, and a refused overlong one cut. An error may quote the client's text too (a chat
# role, what its template said): cut as the status the client reads is (router/errors.py), so
# one request never writes megabytes to the log.
MAX_ERROR_CHARS = 1024


def _id_field(request_id: str) -> str:
    if request_id.isprintable() and not any(c.isspace() or c == '"' for c in request_id) \
            and 0 < len(request_id) <= MAX_REQUEST_ID_CHARS:
        return request_id
    return json.dumps(request_id[:MAX_REQUEST_ID_CHARS])


def request_line(request_id: str, runs: list[RequestRun], status: str, error: str = "",
                 finish: str = "") -> str:
    fields = [f"request {_id_field(request_id)}", f"status={status}"]
    if finish:
        fields.append(f"finish={finish}")
    if runs:
        first = runs[0]
        u, t = first.usage, first.timings
        fields += [f"n={len(runs)}", f"prompt={len(first.prompt_token_ids)}",
                   f"cached={u.cached_tokens}",
                   f"output={sum(len(r.output_so_far) for r in runs)}"]
        if t.ttft_s:  # none without a first token: 0 would read as an instant one
            fields.append(f"ttft_ms={t.ttft_s * 1e3:.1f}")
        fields.append(f"e2e_ms={(time.monotonic() - first.t0) * 1e3:.1f}")
        if u.prefill_worker_id:
            fields.append(f"prefill={u.prefill_worker_id}")
        if u.decode_worker_id:
            fields.append(f"decode={u.decode_worker_id}")
        fields.append(f"migrations={sum(r.migrations for r in runs)}")
    if error:
        fields.append(f"error={json.dumps(capped(error, MAX_ERROR_CHARS))}")
    return " ".join(fields)


def log_request(request_id: str, runs: list[RequestRun], status: str, error: str = "",
                finish: str = "") -> None:
    logger.info("%s", request_line(request_id, runs, status, error, finish))
