"""``pdserve router``: the Router and RouterAdmin services."""
from __future__ import annotations

import asyncio

from engine.config import EngineConfig
from client.keepalive import keepalive_options
from engine.grpc_server import GRPC_OPTIONS, GrpcServer, run, serve
from protos import router_pb2, router_pb2_grpc
from router.admin import RouterAdminServicer
from router.auth import ApiKeyInterceptor
from router.config import RouterConfig
from router.directory import WorkerDirectory
from router.metrics import router_metrics
from router.registry import Registry
from router.service import RouterServicer
from router.stats import RouterStats

SERVICE_NAMES = [router_pb2.DESCRIPTOR.services_by_name[n].full_name
                 for n in ("Router", "RouterAdmin")]


def _load_tokenizer(model: str):
    """The workers' tokenizer and vocabulary size (the router validates against them)."""
    from engine.model_config import ModelConfig
    from engine.presets import resolve_model
    from engine.tokenizer import load_tokenizer

    path = resolve_model(EngineConfig(model=model).model)
    return load_tokenizer(path), ModelConfig.from_pretrained(path).vocab_size


async def serve_router(config: RouterConfig) -> None:
    tokenizer, vocab = await asyncio.to_thread(_load_tokenizer, config.model)
    directory = WorkerDirectory(Registry.from_url(config.redis_url, config.namespace),
                                config.block_size, config.refresh_interval_s,
                                GRPC_OPTIONS + keepalive_options(config.keepalive_time_s,
                                                                 config.keepalive_timeout_s),
                                config.liveness)
    await directory.start()
    stats = RouterStats(config.max_inflight_requests)
    try:
        interceptors = [ApiKeyInterceptor(config.api_key)] if config.api_key else None
        server = GrpcServer(config.server, SERVICE_NAMES, interceptors)
        router_pb2_grpc.add_RouterServicer_to_server(
            RouterServicer(config, directory, tokenizer, vocab, stats), server.server)
        router_pb2_grpc.add_RouterAdminServicer_to_server(
            RouterAdminServicer(directory, stats), server.server)

        async def started() -> None:
            print(f"pdserve router serving on {server.address}", flush=True)

        await serve(server, lambda: stats.requests_in_flight, on_started=started,
                    metrics=lambda: router_metrics(stats, directory))
    finally:
        await directory.stop()


def main(config: RouterConfig) -> None:
    run(lambda: serve_router(config))
