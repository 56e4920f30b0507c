"""A prefill or decode worker's Prometheus metrics (engine/metrics.py serves them at
``--metrics-port``): its KV cache, queues, prefix cache and KV transfers, from the engine's
stats after its last step. Every sample is labelled with the worker's id, role and model."""
from __future__ import annotations

from engine.metrics import MetricFamily
from protos import common_pb2

_GAUGES = (
    ("kv_cache_blocks_free", "num_free_blocks", "Free KV blocks (cached ones count as free)."),
    ("kv_cache_blocks_total", "num_total_blocks", "KV blocks."),
    ("requests_running", "num_running", "Requests in the running batch."),
    ("requests_waiting", "num_waiting", "Requests queued for their first step."),
    ("requests_in_flight", "num_inflight", "Requests admitted and not finished (all RPCs)."),
    ("kv_leases", "num_leased", "Requests whose KV this prefill worker holds for a reader."),
    ("kv_quarantined", "num_quarantined",
     "Failed pulls whose blocks are held back until a late write cannot land."),
    ("kv_peers_connected", "kv_peers_connected",
     "Prefill workers' KV agents this decode worker is connected to."),
)

_COUNTERS = (
    ("prefix_cache_queries_total", "prefix_cache_queries", "Prompt tokens looked up."),
    ("prefix_cache_hits_total", "prefix_cache_hits", "Prompt tokens found cached."),
    ("prefix_cache_partial_hits_total", "prefix_cache_partial_hits",
     "Of the hits: tokens copied from cached blocks a prompt shared only in part."),
    ("prefix_cache_evictions_total", "prefix_cache_evictions",
     "Cached blocks evicted to make room for other tokens."),
    ("preemptions_total", "num_preemptions", "Requests preempted for lack of KV blocks."),
    ("kv_leases_expired_total", "num_expired_leases",
     "KV leases freed by expiry, never released by a reader."),
    ("kv_transfer_bytes_total", "kv_bytes_transferred", "KV bytes this worker pulled."),
    ("kv_transfer_failures_total", "kv_transfer_failures", "KV pulls that failed."),
    ("kv_leases_forgotten_total", "leases_forgotten",
     "Leases a router's ForgetLease found unread here (freed at once, refused from then on)."),
    ("kv_leases_forget_reading_total", "leases_forget_reading",
     "ForgetLease questions answered 'may be reading' (the read's end tells the owner)."),
    ("kv_leases_forget_no_room_total", "leases_forget_no_room",
     "ForgetLease questions for unread leases answered 'may be reading' because the worker "
     "had as many forgotten leases as it keeps (left to a late reader or the expiry)."),
)


def worker_metrics(info: common_pb2.WorkerInfo) -> list[MetricFamily]:
    labels = dict(worker_id=info.worker_id, role=info.role, model=info.model)
    fams = [MetricFamily(f"pdserve_worker_{name}", "gauge", doc).add(getattr(info, attr),
                                                                      **labels)
            for name, attr, doc in _GAUGES]
    usage = 1.0 - info.num_free_blocks / info.num_total_blocks if info.num_total_blocks else 0.0
    fams.append(MetricFamily("pdserve_worker_kv_cache_usage_ratio", "gauge",
                             "Share of KV blocks in use (0-1).").add(usage, **labels))
    fams.append(MetricFamily("pdserve_worker_draining", "gauge",
                             "1 once the worker is stopping (SIGTERM): it takes no new "
                             "requests while the running ones finish.")
                .add(int(info.draining), **labels))
    fams += [MetricFamily(f"pdserve_worker_{name}", "counter", doc).add(getattr(info, attr),
                                                                        **labels)
             for name, attr, doc in _COUNTERS]
    return fams
