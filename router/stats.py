"""The router's counters (served by RouterAdmin.GetClusterStats) and latency histograms
(with the counters, at ``--metrics-port``: router/metrics.py)."""
from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field

from protos import router_pb2

import grpc

from engine.metrics import LATENCY_BUCKETS, TOKEN_LATENCY_BUCKETS, Histogram
from router.errors import RouterRejectError

# RequestTimings fields observed per finished request, by their metric label.
PHASES = ("router_queue", "prefill_queue", "prefill_compute", "kv_transfer", "decode_queue",
          "first_decode_step")


@dataclass(frozen=True)
class SequenceEnd:
    """One of a finished request's sequences (n of them with parallel sampling)."""

    usage: router_pb2.Usage  # its final usage
    # Output tokens this call streamed for it: not the ones a resumed request brought along.
    tokens_streamed: int


def _latency() -> Histogram:
    return Histogram(LATENCY_BUCKETS)


@dataclass
class RouterStats:
    max_inflight: int
    requests_total: int = 0
    requests_in_flight: int = 0
    requests_failed: int = 0
    # The failed ones by gRPC status code name: a client's cancel or deadline is no failure of
    # the cluster's, an overload (RESOURCE_EXHAUSTED) or an INTERNAL is.
    failed: Counter = field(default_factory=Counter)
    prompt_tokens_routed: int = 0
    prefix_tokens_matched: int = 0
    # Where prompts ran: on a decode worker (conditional disaggregation) or a prefill worker.
    requests_prefilled_locally: int = 0
    requests_prefilled_remotely: int = 0
    # Of the local ones: those sent to the decode worker because it held more of the prompt.
    requests_prefilled_on_decode_cache: int = 0
    # Migrations after a worker failed under a request, and requests failed once
    # --migration-limit was spent.
    requests_migrated: int = 0
    migrations_exhausted: int = 0
    # Requests a worker refused before any work, sent to another at no migration's cost.
    requests_rerouted: int = 0
    # Prefilled requests that waited for room on a decode worker (router/decode_wait.py).
    decode_waits: int = 0
    # Output tokens streamed to clients, and the chunks decode workers sent them in (one per
    # --stream-interval tokens after a request's first: protos/stream_interval.py).
    generation_tokens: int = 0
    decode_chunks_received: int = 0
    # Finished requests by finish reason, and their latencies (seconds).
    finished: Counter = field(default_factory=Counter)
    ttft: Histogram = field(default_factory=_latency)
    tpot: Histogram = field(default_factory=lambda: Histogram(TOKEN_LATENCY_BUCKETS))
    e2e: Histogram = field(default_factory=_latency)
    phases: dict[str, Histogram] = field(
        default_factory=lambda: {p: _latency() for p in PHASES})

    @contextlib.contextmanager
    def admit(self):
        """Counts a valid request in flight while it runs; refuses it at once when the router
        is full. (``requests_total`` counts every request received, valid or not.)"""
        if self.requests_in_flight >= self.max_inflight:
            raise RouterRejectError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"the router has {self.requests_in_flight} requests in "
                                    f"flight (max_inflight_requests={self.max_inflight})")
        self.requests_in_flight += 1
        try:
            yield
        finally:
            self.requests_in_flight -= 1

    def request_failed(self, code: grpc.StatusCode) -> None:
        self.requests_failed += 1
        self.failed[code.name] += 1

    def first_token(self, ttft_s: float) -> None:
        """A request's first token (sequence 0's) on its way to the client: its TTFT is
        observed then, once, whether or not the request finishes well. Observed at its end,
        the histogram lagged by whole generations and left out the requests a deadline or a
        cancel ended after their first token (the slowest ones, often)."""
        self.ttft.observe(ttft_s)

    def routed(self, prompt_tokens: int, matched_tokens: int) -> None:
        self.prompt_tokens_routed += prompt_tokens
        self.prefix_tokens_matched += matched_tokens

    def prefilled(self, local: bool, on_decode_cache: bool = False) -> None:
        if local:
            self.requests_prefilled_locally += 1
            self.requests_prefilled_on_decode_cache += on_decode_cache
        else:
            self.requests_prefilled_remotely += 1

    def request_finished(self, finish_reason: str, seqs: list[SequenceEnd]) -> None:
        """A request that ended well (sequence 0's finish reason). Request-level figures
        count it once, as vLLM's do, whatever its n: the end the last sequence's, the phases
        sequence 0's (the one that ran the prompt). Token spacing (TPOT) is each sequence's
        own. (TTFT was observed at the first token: ``first_token``.)"""
        t = seqs[0].usage.timings
        self.finished[finish_reason] += 1
        self.e2e.observe(max(s.usage.timings.e2e_s for s in seqs))
        for phase in PHASES:
            self.phases[phase].observe(getattr(t, f"{phase}_s"))
        for s in seqs:
            if s.tokens_streamed > 1:
                st = s.usage.timings
                self.tpot.observe((st.e2e_s - st.ttft_s) / (s.tokens_streamed - 1))
