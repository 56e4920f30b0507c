"""Per-request timing records and their summary, with vLLM's serving-benchmark definitions.

TTFT: request start to the first token. TPOT: (e2e - TTFT) / (output tokens - 1), one value
per request with more than one token. ITL: every gap between consecutive token-carrying chunks,
pooled over all requests. E2E: request start to the arrival of its final chunk (the one with
the finish reason), not to the call's close after it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

# The router's per-request phase timings (client.Timings fields), in the order they happen.
BREAKDOWN_FIELDS = ("router_queue_s", "prefill_queue_s", "prefill_compute_s", "kv_transfer_s",
                    "decode_queue_s", "first_decode_step_s")


@dataclass
class RequestRecord:
    """One request as the client saw it; times are ``time.perf_counter()`` seconds."""

    start: float
    prompt_len: int
    # (arrival time, tokens in the chunk) of every chunk that carried tokens.
    chunks: list[tuple[float, int]] = field(default_factory=list)
    # When the final chunk arrived; None for a stream that never sent one.
    end: float | None = None
    # The router's phase timings (seconds) from the final chunk's usage; empty in-process.
    breakdown: dict[str, float] = field(default_factory=dict)
    cached_tokens: int = 0
    # The final chunk's: a stream without one was cut short, not completed.
    finish_reason: str | None = None
    error: str | None = None

    def add_chunk(self, t: float, num_tokens: int) -> None:
        if num_tokens > 0:
            self.chunks.append((t, num_tokens))

    @property
    def ok(self) -> bool:
        return (self.error is None and self.end is not None and self.finish_reason is not None
                and bool(self.chunks))

    @property
    def output_tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def ttft(self) -> float:
        return self.chunks[0][0] - self.start

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        n = self.output_tokens
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else None

    @property
    def itls(self) -> list[float]:
        times = [t for t, _ in self.chunks]
        return [b - a for a, b in zip(times, times[1:])]


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default, which vLLM uses)."""
    if not values:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class Stats:
    """Milliseconds."""

    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of_seconds(cls, values: list[float]) -> Stats:
        ms = [v * 1e3 for v in values]
        mean = sum(ms) / len(ms) if ms else math.nan
        return cls(mean, percentile(ms, 50), percentile(ms, 90), percentile(ms, 99))


@dataclass
class PointResult:
    """One load point: a closed loop at a concurrency, or Poisson arrivals at a rate."""

    system: str  # "disagg" or "inprocess"
    mode: str  # "concurrency" or "poisson"
    load: float  # the concurrency, or the rate in requests/s
    num_requests: int
    completed: int
    failed: int
    duration_s: float
    output_tokens: int
    output_tok_s: float
    request_s: float
    # Prompt tokens of the completed requests, and (prompt + output) tokens over the duration:
    # vLLM's "Total Token throughput".
    input_tokens: int
    total_tok_s: float
    ttft: Stats
    tpot: Stats
    itl: Stats
    e2e: Stats
    # Mean milliseconds per router phase (disaggregated only).
    breakdown_ms: dict[str, float] = field(default_factory=dict)
    mean_cached_tokens: float = 0.0
    # Distinct failure messages ("STATUS: details"), so a failed point says why.
    errors: list[str] = field(default_factory=list)
    # Cores in use while the point ran (closed loops): "machine" (every process on the host)
    # and each service's processes ("router", "prefill", "decode", "client"; "engine" for the
    # in-process engine). Empty where not measured.
    cpu_cores: dict[str, float] = field(default_factory=dict)
    # Poisson points: the rate the requests were actually sent at (requests after the first
    # over the time to the last one). A few dozen exponential gaps stray from the nominal
    # rate, and a client too busy to send on time lowers it: the latencies belong to this one.
    sent_rate: float = math.nan


def summarize(system: str, mode: str, load: float, records: list[RequestRecord],
              duration_s: float) -> PointResult:
    done = [r for r in records if r.ok]
    tokens = sum(r.output_tokens for r in done)
    input_tokens = sum(r.prompt_len for r in done)
    tpots = [r.tpot for r in done if r.tpot is not None]
    breakdown = {}
    timed = [r for r in done if r.breakdown]
    if timed:
        breakdown = {f: 1e3 * sum(r.breakdown[f] for r in timed) / len(timed)
                     for f in BREAKDOWN_FIELDS}
    return PointResult(
        system=system, mode=mode, load=load, num_requests=len(records), completed=len(done),
        failed=len(records) - len(done), duration_s=duration_s, output_tokens=tokens,
        output_tok_s=tokens / duration_s if duration_s > 0 else math.nan,
        request_s=len(done) / duration_s if duration_s > 0 else math.nan,
        input_tokens=input_tokens,
        total_tok_s=(input_tokens + tokens) / duration_s if duration_s > 0 else math.nan,
        ttft=Stats.of_seconds([r.ttft for r in done]), tpot=Stats.of_seconds(tpots),
        itl=Stats.of_seconds([x for r in done for x in r.itls]),
        e2e=Stats.of_seconds([r.e2e for r in done]), breakdown_ms=breakdown,
        mean_cached_tokens=(sum(r.cached_tokens for r in done) / len(done) if done
                            else math.nan),
        errors=sorted({r.error for r in records if r.error})[:5],
        sent_rate=sent_rate(records) if mode == "poisson" else math.nan)


def sent_rate(records: list[RequestRecord]) -> float:
    """Requests per second between the first request's start and the last's (NaN for fewer
    than two, or all at once)."""
    starts = [r.start for r in records]
    span = max(starts) - min(starts) if len(starts) > 1 else 0.0
    return (len(starts) - 1) / span if span > 0 else math.nan
