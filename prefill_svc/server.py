"""``pdserve prefill``: one prefill worker (its TP ranks are the engine's worker processes)."""
from __future__ import annotations

from engine.grpc_server import run
from engine.worker_runtime import WorkerConfig
from engine.worker_server import run_worker
from prefill_svc.service import PrefillServicer
from protos import worker_pb2, worker_pb2_grpc

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].full_name


async def serve_prefill(config: WorkerConfig) -> None:
    await run_worker(config, SERVICE_NAME, PrefillServicer,
                     worker_pb2_grpc.add_PrefillWorkerServicer_to_server)


def main(config: WorkerConfig) -> None:
    run(lambda: serve_prefill(config))
