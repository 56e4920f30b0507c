"""Starts a prefill or decode worker: engine, gRPC server, Redis presence, graceful stop."""
from __future__ import annotations

import logging
from collections.abc import Callable

from engine.grpc_server import GrpcServer, serve
from engine.process_exit import stop_asked
from engine.worker_metrics import worker_metrics
from engine.worker_runtime import WorkerConfig, WorkerRuntime
from router.redis_database import check_redis_database

logger = logging.getLogger(__name__)


async def run_worker(config: WorkerConfig, service_name: str,
                     make_servicer: Callable[[WorkerRuntime], object],
                     add_to_server: Callable[[object, object], None]) -> None:
    """Serves until SIGTERM/SIGINT, or until its engine dies; then leaves the registry, drains,
    drops its transfer-ledger entries and stops. A dead engine ends the process with a
    non-zero status; a stop asked while the model loaded, with 0, never having served."""
    if config.redis_url is not None:  # before the model loads (minutes, for a large one)
        await check_redis_database(config.redis_url)
    rt = await WorkerRuntime.create(config)
    if rt.engine_failure is not None:  # it died as the worker started: nothing to serve with
        rt.shutdown()
        raise SystemExit(f"pdserve {config.role} worker {rt.worker_id}: the engine died as "
                         f"the worker started: {rt.engine_failure!r}")
    if stop_asked.is_set():  # SIGTERM/SIGINT while the model loaded
        logger.info("pdserve %s worker: stopped while loading its model; exiting without "
                    "serving", config.role)
        rt.shutdown()
        return
    try:
        server = GrpcServer(config.server, [service_name])
        rt.bind(server.address)
        add_to_server(make_servicer(rt), server.server)

        async def started() -> None:
            await rt.start_presence()
            # The launcher (pdserve up) and tests wait for this line.
            print(f"pdserve {config.role} worker {rt.worker_id} serving on {rt.address}",
                  flush=True)

        rt.on_fatal = server.stopping.set
        rt.database_refusal.stop_with(server.stopping.set)
        # stop_presence leaves routing before the drain; finish_presence, after it, drops
        # the ledger entries of the leases the drain waited for.
        await serve(server, lambda: _num_in_flight(rt), on_started=started,
                    on_stopping=rt.stop_presence,
                    metrics=lambda: worker_metrics(rt.worker_info()))
    finally:
        try:
            await rt.finish_presence()
        finally:
            rt.shutdown()
    rt.database_refusal.raise_if_refused()
    if rt.engine_failure is not None:
        # A non-zero exit: `pdserve up`, compose and orchestrators restart the worker.
        raise SystemExit(f"pdserve {config.role} worker {rt.worker_id}: the engine died: "
                         f"{rt.engine_failure!r}")


def _num_in_flight(rt: WorkerRuntime) -> int:
    """What a drain waits for: calls running, and on a prefill worker the KV it leased. A
    request whose Prefill answered is not done: its client has the first token, and its
    decode worker has yet to pull the KV (later still while the decode tier is full). A
    worker that stopped under it failed the pull, and the request lost its first token or
    started over elsewhere."""
    leased = rt.engine.num_leased if rt.config.role == "prefill" else 0
    return rt.inflight + leased
