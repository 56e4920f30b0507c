"""``pdserve decode``: one decode worker."""
from __future__ import annotations

from decode_svc.service import DecodeServicer
from engine.grpc_server import run
from engine.worker_runtime import WorkerConfig
from engine.worker_server import run_worker
from protos import worker_pb2, worker_pb2_grpc

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name


async def serve_decode(config: WorkerConfig) -> None:
    await run_worker(config, SERVICE_NAME, DecodeServicer,
                     worker_pb2_grpc.add_DecodeWorkerServicer_to_server)


def main(config: WorkerConfig) -> None:
    run(lambda: serve_decode(config))
