"""The router's Prometheus metrics (engine/metrics.py serves them at ``--metrics-port``).

Its own counters and latency histograms, and the cluster as the router sees it: every worker's
KV blocks and queues from its last heartbeat, plus the requests this router has in flight to
it. One scrape of the router is enough to tell which role needs more workers; each worker can
also be scraped itself (engine/worker_metrics.py) for figures taken at its own step.
"""
from __future__ import annotations

from engine.metrics import MetricFamily
from router.directory import WorkerDirectory
from router.stats import PHASES, RouterStats

_COUNTERS = (
    ("requests_total", "requests_total", "Requests received (Generate and Complete)."),
    ("prompt_tokens_total", "prompt_tokens_routed", "Prompt tokens routed."),
    ("prefix_tokens_matched_total", "prefix_tokens_matched",
     "Prompt tokens the worker that ran the prompt already held in its prefix cache, as the "
     "index showed them."),
    ("generation_tokens_total", "generation_tokens", "Output tokens streamed to clients."),
    ("decode_chunks_received_total", "decode_chunks_received",
     "Chunks received from decode workers (a message each; --stream-interval groups tokens)."),
    ("requests_migrated_total", "requests_migrated",
     "Moves of a running request to other workers after its worker failed."),
    ("migrations_exhausted_total", "migrations_exhausted",
     "Requests failed once --migration-limit was spent."),
    ("requests_rerouted_total", "requests_rerouted",
     "Requests a worker refused before doing any of them (draining, engine dead, gone), sent "
     "to another without spending a migration."),
    ("decode_waits_total", "decode_waits",
     "Prefilled requests that waited for room on a decode worker, then went on."),
    ("requests_prefilled_on_decode_cache_total", "requests_prefilled_on_decode_cache",
     "Local prefills sent to the decode worker that held more of the prompt than any prefill "
     "worker (a chat's next turn)."),
)

_WORKER_GAUGES = (
    ("kv_cache_blocks_free", "num_free_blocks", "Free KV blocks (cached ones count as free)."),
    ("kv_cache_blocks_total", "num_total_blocks", "KV blocks."),
    ("requests_running", "num_running", "Requests in the running batch."),
    ("requests_waiting", "num_waiting", "Requests queued for their first step."),
    ("kv_leases", "num_leased", "Requests whose KV a prefill worker holds for a reader."),
)


def router_metrics(stats: RouterStats, directory: WorkerDirectory) -> list[MetricFamily]:
    fams = [MetricFamily(f"pdserve_router_{name}", "counter", doc).add(getattr(stats, attr))
            for name, attr, doc in _COUNTERS]
    fams.append(MetricFamily("pdserve_router_requests_in_flight", "gauge",
                             "Requests this router is serving now.")
                .add(stats.requests_in_flight))
    prefilled = MetricFamily("pdserve_router_requests_prefilled_total", "counter",
                             "Requests by where their prompt ran: a prefill worker (remote) or "
                             "the decode worker (local, conditional disaggregation).")
    prefilled.add(stats.requests_prefilled_remotely, where="remote")
    prefilled.add(stats.requests_prefilled_locally, where="local")
    failed = MetricFamily("pdserve_router_requests_failed_total", "counter",
                          "Requests that ended with an error status, by its gRPC code (a "
                          "client's CANCELLED and DEADLINE_EXCEEDED among them).")
    for code, n in sorted(stats.failed.items()):
        failed.add(n, code=code)
    finished = MetricFamily("pdserve_router_requests_finished_total", "counter",
                            "Requests that streamed their last token, by finish reason.")
    for reason, n in sorted(stats.finished.items()):
        finished.add(n, finish_reason=reason)
    fams += [
        prefilled, failed, finished,
        MetricFamily("pdserve_router_time_to_first_token_seconds", "histogram",
                     "Time to first token, from arrival at the router; observed as it is "
                     "sent, whether the request then finishes or not.").add(stats.ttft),
        MetricFamily("pdserve_router_time_per_output_token_seconds", "histogram",
                     "Mean time between output tokens, per request.").add(stats.tpot),
        MetricFamily("pdserve_router_e2e_request_latency_seconds", "histogram",
                     "Arrival to last token.").add(stats.e2e),
    ]
    phases = MetricFamily("pdserve_router_request_phase_seconds", "histogram",
                          "Per request: the TTFT breakdown's phases (usage timings).")
    for phase in PHASES:
        phases.add(stats.phases[phase], phase=phase)
    fams.append(phases)
    return fams + _cluster_metrics(directory)


def _cluster_metrics(directory: WorkerDirectory) -> list[MetricFamily]:
    workers = sorted(directory.workers.values(), key=lambda w: w.worker_id)
    count = MetricFamily("pdserve_router_workers", "gauge",
                         "Workers in the registry, by role and state.")
    for role in ("prefill", "decode"):
        mine = [w for w in workers if w.info.role == role]
        down = [w for w in mine if directory.is_down(w)]
        draining = [w for w in mine if w.info.draining and w not in down]
        routable = len(directory.candidates(role))
        count.add(routable, role=role, state="routable")
        count.add(len(draining), role=role, state="draining")
        count.add(len(down), role=role, state="down")
        # Up and not draining, but of another --block-size: listed, never sent a request.
        count.add(len(mine) - len(down) - len(draining) - routable, role=role,
                  state="other_block_size")
    fams = [count, MetricFamily("pdserve_router_worker_hangs_total", "counter",
                                "Times a worker with calls on it stopped answering health "
                                "checks and had its calls cut.").add(directory.worker_hangs)]
    for name, attr, doc in _WORKER_GAUGES:
        fam = MetricFamily(f"pdserve_router_worker_{name}", "gauge",
                           f"{doc} From the worker's last heartbeat.")
        for w in workers:
            fam.add(getattr(w.info, attr), worker_id=w.worker_id, role=w.info.role)
        fams.append(fam)
    inflight = MetricFamily("pdserve_router_worker_requests_in_flight", "gauge",
                            "This router's calls in flight to the worker.")
    for w in workers:
        inflight.add(w.inflight, worker_id=w.worker_id, role=w.info.role)
    fams.append(inflight)
    return fams
