"""Markdown tables for ``pdserve bench serve``."""
from __future__ import annotations

import math

from bench.serve_metrics import BREAKDOWN_FIELDS, PointResult, Stats


def _f(x: float, digits: int = 1) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _stats(s: Stats) -> str:
    return f"{_f(s.mean)} / {_f(s.p50)} / {_f(s.p90)} / {_f(s.p99)}"


def _load(p: PointResult) -> str:
    if p.mode == "concurrency":
        return f"c={int(p.load)}"
    if math.isnan(p.sent_rate):
        return f"{p.load:g} req/s"
    return f"{p.load:g} req/s (sent at {p.sent_rate:.2f})"


def latency_table(points: list[PointResult]) -> str:
    rows = ["| system | load | done | out tok/s | total tok/s | req/s | TTFT ms | TPOT ms | "
            "ITL ms | E2E ms |", "|---|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        rows.append(f"| {p.system} | {_load(p)} | {p.completed}/{p.num_requests} | "
                    f"{_f(p.output_tok_s)} | {_f(p.total_tok_s)} | {_f(p.request_s, 2)} | "
                    f"{_stats(p.ttft)} | {_stats(p.tpot)} | {_stats(p.itl)} | {_stats(p.e2e)} |")
    return "\n".join(rows) + "\n\nLatencies: mean / p50 / p90 / p99."


_CPU_COLUMNS = ("machine", "router", "prefill", "decode", "client", "engine")


def cpu_table(points: list[PointResult], num_cpus: int) -> str:
    measured = [p for p in points if p.cpu_cores]
    cols = [c for c in _CPU_COLUMNS if any(c in p.cpu_cores for p in measured)]
    rows = ["| system | load | " + " | ".join(cols) + " |", "|---" * (len(cols) + 2) + "|"]
    for p in measured:
        cells = " | ".join(_f(p.cpu_cores[c], 2) if c in p.cpu_cores else "" for c in cols)
        rows.append(f"| {p.system} | {_load(p)} | {cells} |")
    return ("\n".join(rows) + f"\n\nCores in use while each closed loop ran (of {num_cpus}), "
            "pooled over the rounds: the whole machine, and each service with the processes "
            "it started. On shared cores a service's share also stalls the engine's "
            "multi-threaded steps it preempts (docs/benchmarks.md, session 34).")


def _with_rounds(pooled: float | None, rounds: list[float]) -> str:
    cell = _f(pooled, 2)
    return f"**{cell}** ({', '.join(_f(x, 2) for x in rounds)})" if len(rounds) > 1 else cell


def ratio_table(ratios) -> str:
    rows = ["| concurrency | disagg out tok/s | aggregated out tok/s | in-process out tok/s | "
            "disagg / aggregated | disagg / in-process |",
            "|---|---|---|---|---|---|"]
    for r in ratios:
        vs_agg = _with_rounds(r.ratio_vs_agg, r.ratio_vs_agg_rounds)
        vs_inproc = _with_rounds(r.ratio, r.ratio_rounds)
        rows.append(f"| {r.concurrency} | {_f(r.disagg_tok_s)} | {_f(r.agg_tok_s)} | "
                    f"{_f(r.inprocess_tok_s)} | {vs_agg} | {vs_inproc} |")
    return "\n".join(rows) + ("\n\nAggregated: the same router and client in front of one "
                              "decode worker that prefills every prompt itself. In-process: "
                              "the engine stepped directly, no gRPC, router or client. Pooled "
                              "over the rounds, each round's own ratio in brackets.")


def _breakdown_rows(labelled) -> list[str]:
    """``labelled``: (row label, mean TTFT ms, breakdown ms by field)."""
    names = [f.removesuffix("_s").replace("_", " ") for f in BREAKDOWN_FIELDS]
    rows = ["| load | TTFT | " + " | ".join(names) + " |",
            "|---" * (len(names) + 2) + "|"]
    for label, ttft, breakdown in labelled:
        if breakdown:
            cells = " | ".join(_f(breakdown[f]) for f in BREAKDOWN_FIELDS)
            rows.append(f"| {label} | {_f(ttft)} | {cells} |")
    return rows


def breakdown_table(points: list[PointResult]) -> str:
    rows = _breakdown_rows((_load(p), p.ttft.mean, p.breakdown_ms) for p in points)
    return ("\n".join(rows) + "\n\nMean ms per request from the router's usage timings. The "
            "first token leaves after prefill compute; KV transfer, decode queue and the first "
            "decode step come after it (they delay the second token).")


def prefix_table(pr) -> str:
    rows = ["| prompts | requests | cached tokens (mean) | TTFT ms mean / p50 / p90 / p99 |",
            "|---|---|---|---|",
            f"| cold (fresh {pr.prefix_len}-token prefix) | {pr.num_requests} | "
            f"{_f(pr.cold_cached_tokens)} | {_stats(pr.cold_ttft)} |",
            f"| warm (cached {pr.prefix_len}-token prefix) | {pr.num_requests} | "
            f"{_f(pr.warm_cached_tokens)} | {_stats(pr.warm_ttft)} |"]
    return (f"Prompts: a {pr.prefix_len}-token prefix + {pr.unique_len} unique tokens, "
            f"{pr.output_len} output tokens, one request at a time.\n\n" + "\n".join(rows)
            + f"\n\nTTFT warm / cold (means) = {_f(pr.ratio, 3)}\n\n"
            + "\n".join(_breakdown_rows([("cold", pr.cold_ttft.mean, pr.cold_breakdown_ms),
                                         ("warm", pr.warm_ttft.mean, pr.warm_breakdown_ms)])))


def markdown(report) -> str:
    c = report.config
    parts = [f"### pdserve bench serve: {c.model}, {c.num_prefill} prefill + {c.num_decode} "
             f"decode worker(s)\n\nPrompts {c.prompt_len[0]}-{c.prompt_len[1]} tokens, outputs "
             f"{c.output_len[0]}-{c.output_len[1]} tokens (uniform, greedy, ignore_eos), seed "
             f"{c.seed}; closed loops in {c.rounds} round(s), the systems alternating; "
             f"{report.worker_threads} thread(s) per worker"
             f"{' (all cores while the others idle: core share)' if c.share_cores else ''}"
             f"{', each engine in a process of its own' if c.engine_process else ''}, "
             f"{report.aggregated_worker_threads} for the aggregated cluster's worker, "
             f"{report.torch_threads} for the in-process engine, on {report.cpu_count} CPUs. "
             f"Steps of up to {report.prefill_step_tokens} tokens on the prefill workers, "
             f"{report.inprocess_step_tokens} on the in-process engine, "
             f"{report.aggregated_step_tokens} on the aggregated worker. Routers stream "
             f"{'every token' if c.stream_interval == 1 else f'{c.stream_interval} tokens a chunk'}"
             f" (--stream-interval). gRPC experiments: "
             f"{report.grpc_experiments or 'gRPC defaults'} (GRPC_EXPERIMENTS).",
             "#### Latency and throughput\n\n" + latency_table(report.points)]
    if any(p.cpu_cores for p in report.points):
        parts.append("#### CPU use\n\n" + cpu_table(report.points, report.cpu_count))
    if report.ratios:
        parts.append("#### Disaggregated vs aggregated and in-process (same requests, closed "
                     "loop)\n\n"
                     + ratio_table(report.ratios))
    disagg = [p for p in report.points if p.system == "disagg"]
    parts.append("#### TTFT breakdown (disaggregated)\n\n" + breakdown_table(disagg))
    if report.shared_prefix is not None:
        parts.append("#### Shared prefix: TTFT warm vs cold\n\n"
                     + prefix_table(report.shared_prefix))
    return "\n\n".join(parts)
