"""Starts a prefill or decode worker: engine, gRPC server, Redis presence, graceful stop."""
from __future__ import annotations

import logging
from collections.abc import Callable

from engine.grpc_server import GrpcServer, serve
from engine.worker_metrics import worker_metrics
from engine.worker_runtime import WorkerConfig, WorkerRuntime

logger = logging.getLogger(__name__)


async def run_worker(config: WorkerConfig, service_name: str,
                     make_servicer: Callable[[WorkerRuntime], object],
                     add_to_server: Callable[[object, object], None]) -> None:
    """Serves until SIGTERM/SIGINT; then leaves the registry, drains and stops."""
    rt = await WorkerRuntime.create(config)
    try:
        server = GrpcServer(config.server, [service_name])
        rt.bind(server.address)
        add_to_server(make_servicer(rt), server.server)

        async def started() -> None:
            await rt.start_presence()
            # The launcher (pdserve up) and tests wait for this line.
            print(f"pdserve {config.role} worker {rt.worker_id} serving on {rt.address}",
                  flush=True)

        await serve(server, lambda: rt.inflight, on_started=started,
                    on_stopping=rt.stop_presence,
                    metrics=lambda: worker_metrics(rt.worker_info()))
    finally:
        rt.shutdown()
