"""Idle liveness pings of tensor-parallel workers (rank 0's side; engine.tp_executor).

A worker that dies is seen at once (its pidfd, its closed socket). One that is stopped
(SIGSTOP, a debugger) or wedged in a syscall stays connected and silent: between steps nothing
asks it anything, and the next request's step only times out minutes later. While the engine
is idle rank 0 pings each worker down the same control pipe its steps take, one message each,
and reads the answer; the executor makes sure no step or other request shares the pipe then.
"""
from __future__ import annotations

import time
from multiprocessing.connection import wait

from engine import tp_comm


class PingFailed(RuntimeError):
    """A worker answered a ping with something else than its answer (its error report)."""


def ping(workers: list, timeout_s: float):
    """Pings every worker (engine.tp_executor._Worker) at once; the first that has not
    answered within ``timeout_s`` of the sends, or None when all did.

    EOFError or OSError when a worker's pipe ended or it exited (it died: the caller names
    how); PingFailed when it answered with an error."""
    deadline = time.monotonic() + timeout_s
    for w in workers:
        try:
            # An idle worker's pipe is empty, so this tiny message fits it; the deadline
            # covers a pipe filled by something else all the same.
            tp_comm.send_by(w.conn, tp_comm.OP_PING, b"", deadline)
        except TimeoutError:
            return w
    for w in workers:
        ready = wait([w.conn, w.sentinel], max(0.0, deadline - time.monotonic()))
        if not ready:
            return w
        if w.conn not in ready:  # exited without a last word
            raise EOFError(f"tensor-parallel rank {w.rank} exited")
        op, payload = tp_comm.recv(w.conn)
        if op != tp_comm.OP_OK or payload:
            text = payload.decode(errors="replace").strip() if op == tp_comm.OP_ERROR \
                else f"tensor-parallel rank {w.rank} answered a ping with op {op!r}"
            raise PingFailed(text)
    return None
