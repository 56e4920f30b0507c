"""gRPC core's socket I/O for pdserve's processes: the poller that wakes one thread a message.

Since grpcio 1.6x, C-core moves bytes through its EventEngine on POSIX: a message that arrives
wakes an EventEngine poller thread, which hands the read to an EventEngine worker thread, which
completes the call and wakes grpc.aio's completion-queue thread, which wakes the event loop.
With the ``event_engine_client`` and ``event_engine_listener`` experiments off, the
completion-queue thread polls the sockets itself, so the same message wakes two threads instead
of four. Streaming one small message every 5 ms through a relay process (one stream in, one out:
the router's place on the request path), grpcio 1.85 on the 2-core VM, ad hoc: the relay went
from 9.6 to 5.0 context switches a message and the reading client from 6.1 to 2.4; their CPU
from 0.38-0.41 to 0.27-0.30 ms and 0.26-0.28 to 0.17-0.20 ms a message. On a host whose cores
the engine's own threads fill, each of those wakeups preempts a step (docs/benchmarks.md,
session 34), so the cluster streams more tokens a second (session 37).

``engine.cli.main`` applies it before any channel or server exists (C-core reads the variable
when it first starts, not at ``import grpc``), so every service ``pdserve`` starts, and every
process those start, runs with it. A ``GRPC_EXPERIMENTS`` already in the environment wins,
an empty one included: ``GRPC_EXPERIMENTS= pdserve up`` runs gRPC's own defaults. The client
SDK leaves a user's process alone; the README says how to set it there.
"""
from __future__ import annotations

import os
from collections.abc import MutableMapping

ENV = "GRPC_EXPERIMENTS"
# Both named: the listener's experiment covers the sockets a server accepts, the client's the
# ones a channel opens; a router has both.
LEGACY_POLLER = "-event_engine_client,-event_engine_listener"


def apply_grpc_experiments(environ: MutableMapping[str, str] = os.environ) -> str:
    """Sets ``GRPC_EXPERIMENTS`` to :data:`LEGACY_POLLER` unless ``environ`` already has it;
    returns the value in effect."""
    return environ.setdefault(ENV, LEGACY_POLLER)
