"""``pdserve router``: the Router and RouterAdmin services."""
from __future__ import annotations

import asyncio
import logging

from client.keepalive import keepalive_options
from client.tasks import stop_task
from engine.grpc_server import GrpcServer, run, serve
from protos import router_pb2, router_pb2_grpc
from protos.limits import message_size_options
from router.admin import RouterAdminServicer
from router.auth import ApiKeyInterceptor
from router.config import RouterConfig
from router.directory import WorkerDirectory
from router.metrics import router_metrics
from router.prompts import load_served_model
from router.redis_database import DatabaseRefusal, check_redis_database
from router.registry import Registry
from router.router_peers import RouterPeers
from router.router_presence import TTL_S, RouterPresence, default_router_id
from router.service import RouterServicer
from router.stats import RouterStats
from router.template_sandbox import TemplateSandbox

logger = logging.getLogger(__name__)

SERVICE_NAMES = [router_pb2.DESCRIPTOR.services_by_name[n].full_name
                 for n in ("Router", "RouterAdmin")]


async def serve_router(config: RouterConfig) -> None:
    await check_redis_database(config.redis_url)
    model = await asyncio.to_thread(load_served_model, config.model, config.generation_config,
                                    config.chat_template_text, config.served_model_name,
                                    config.tokenizer, config.trust_request_chat_template)
    if model.sampling_defaults:
        logger.info("sampling defaults from the model's generation config: %s",
                    model.sampling_defaults)
    # Redis not answering at the check above, its refusal of the database comes later.
    refusal = DatabaseRefusal()
    registry = Registry.from_url(config.redis_url, config.namespace,
                                 on_database_missing=refusal)
    router_id = config.router_id or default_router_id(config.server.host, config.server.port)
    peers = RouterPeers(registry.r, config.namespace, router_id, TTL_S)
    presence = RouterPresence(registry.ledger, router_id, peers)
    await presence.claim()
    await presence.beat_peers()
    directory = WorkerDirectory(registry, config.block_size, config.refresh_interval_s,
                                message_size_options()
                                + keepalive_options(config.keepalive_time_s,
                                                    config.keepalive_timeout_s),
                                config.liveness, model=config.model_name,
                                model_fingerprint=model.fingerprint,
                                tie_seed=router_id, router_place=lambda: peers.place)
    await directory.start()
    presence.start()
    stats = RouterStats(config.max_inflight_requests)
    reclaim = None
    try:
        if config.trust_request_chat_template:
            model.sandbox = TemplateSandbox(config.request_chat_template)
            await model.sandbox.start()
        keyed = config.api_key is not None or config.admin_api_key is not None
        interceptors = [ApiKeyInterceptor(config.api_key, config.admin_api_key)] if keyed \
            else None
        # The router pings its clients too: a client gone without closing its connection has
        # its calls cancelled, and their requests with them.
        server = GrpcServer(config.server, SERVICE_NAMES, interceptors,
                            keepalive_options(config.keepalive_time_s,
                                              config.keepalive_timeout_s))
        refusal.stop_with(server.stopping.set)
        # After the bind: a router that cannot take its port releases nobody's leases.
        reclaim = asyncio.create_task(presence.reclaim(directory.prefill_stub))
        router = RouterServicer(config, directory, model, stats, presence.router_id,
                                presence.incarnation)
        router_pb2_grpc.add_RouterServicer_to_server(router, server.server)
        router_pb2_grpc.add_RouterAdminServicer_to_server(
            RouterAdminServicer(directory, stats, router.inflight), server.server)

        async def started() -> None:
            print(f"pdserve router serving on {server.address}", flush=True)

        async def stopping() -> None:
            router.draining = True

        await serve(server, router.num_inflight, on_started=started,
                    on_stopping=stopping, metrics=lambda: router_metrics(stats, directory))
    finally:
        if model.sandbox is not None:
            await model.sandbox.close()
        if reclaim is not None:
            await stop_task(reclaim, 1.0)
        await presence.stop()
        await directory.stop()
    refusal.raise_if_refused()


def main(config: RouterConfig) -> None:
    run(lambda: serve_router(config))
