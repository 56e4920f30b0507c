"""The router's counters (served by RouterAdmin.GetClusterStats)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import grpc


@dataclass
class RouterStats:
    max_inflight: int
    requests_total: int = 0
    requests_in_flight: int = 0
    requests_failed: int = 0
    prompt_tokens_routed: int = 0
    prefix_tokens_matched: int = 0
    # Where prompts ran: on a decode worker (conditional disaggregation) or a prefill worker.
    requests_prefilled_locally: int = 0
    requests_prefilled_remotely: int = 0
    # Migrations after a worker failed under a request, and requests failed once
    # --migration-limit was spent.
    requests_migrated: int = 0
    migrations_exhausted: int = 0

    @contextlib.contextmanager
    def track(self):
        """Counts a request; refuses it at once when the router is full."""
        from router.service import RouterRejectError

        if self.requests_in_flight >= self.max_inflight:
            raise RouterRejectError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"the router has {self.requests_in_flight} requests in "
                                    f"flight (max_inflight_requests={self.max_inflight})")
        self.requests_total += 1
        self.requests_in_flight += 1
        try:
            yield
        finally:
            self.requests_in_flight -= 1

    def routed(self, prompt_tokens: int, matched_tokens: int) -> None:
        self.prompt_tokens_routed += prompt_tokens
        self.prefix_tokens_matched += matched_tokens

    def prefilled(self, local: bool) -> None:
        if local:
            self.requests_prefilled_locally += 1
        else:
            self.requests_prefilled_remotely += 1
