"""``pdserve bench serve``: the metric definitions on synthetic timestamps, argument checks, and
one tiny run end to end through a real cluster (keys and counts only; no timing asserts)."""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os

import grpc
import pytest
import torch

from bench import serve
from bench.serve_metrics import BREAKDOWN_FIELDS, RequestRecord, Stats, percentile, summarize
from engine.cli import main as cli_main
from protos import router_pb2, router_pb2_grpc


def _record(start, chunks, end, error=None, finish_reason="length") -> RequestRecord:
    rec = RequestRecord(start=start, prompt_len=10, error=error, finish_reason=finish_reason)
    for t, n in chunks:
        rec.add_chunk(t, n)
    rec.end = end
    return rec


def test_request_metrics_follow_vllm_definitions():
    # Tokens at 0.1 (1), 0.15 (1), 0.25 (2); an empty final chunk at 0.3 ends the stream.
    rec = _record(0.0, [(0.1, 1), (0.15, 1), (0.25, 2), (0.3, 0)], 0.3)
    assert rec.output_tokens == 4
    assert rec.ttft == pytest.approx(0.1)
    assert rec.e2e == pytest.approx(0.3)
    assert rec.tpot == pytest.approx((0.3 - 0.1) / 3)
    assert rec.itls == pytest.approx([0.05, 0.1])  # the empty chunk is no token gap
    assert _record(1.0, [(1.2, 1)], 1.2).tpot is None


def test_percentile_interpolates_like_numpy():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 50) == pytest.approx(2.5)
    assert percentile(xs, 90) == pytest.approx(3.7)
    assert percentile(xs, 99) == pytest.approx(3.97)
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile(xs, 101)
    s = Stats.of_seconds([0.001, 0.002, 0.003])
    assert (s.mean, s.p50) == pytest.approx((2.0, 2.0))


def test_summarize_pools_itl_and_counts_failures():
    a = _record(0.0, [(0.1, 1), (0.2, 1), (0.4, 1)], 0.4)
    b = _record(0.0, [(0.3, 2), (0.5, 2)], 0.5)
    b.breakdown = {f: 0.01 for f in BREAKDOWN_FIELDS}
    failed = _record(0.0, [], None, error="UNAVAILABLE: gone")
    res = summarize("disagg", "concurrency", 2, [a, b, failed], duration_s=2.0)
    assert (res.num_requests, res.completed, res.failed) == (3, 2, 1)
    assert res.output_tokens == 7
    assert res.output_tok_s == pytest.approx(3.5)
    assert res.request_s == pytest.approx(1.0)
    # vLLM's total token throughput: prompt and output tokens of the completed requests only.
    assert res.input_tokens == 20
    assert res.total_tok_s == pytest.approx((20 + 7) / 2.0)
    assert res.ttft.mean == pytest.approx(200.0)  # (100 + 300) / 2 ms
    # TPOT per request: a (0.4-0.1)/2 = 150 ms, b (0.5-0.3)/3 ~ 66.7 ms.
    assert res.tpot.mean == pytest.approx((150.0 + 200.0 / 3) / 2)
    # ITL pooled over requests: 100, 200 (a) and 200 (b) ms.
    assert sorted([res.itl.p50, res.itl.mean]) == pytest.approx([166.666666, 200.0])
    assert res.breakdown_ms == pytest.approx({f: 10.0 for f in BREAKDOWN_FIELDS})
    # A point where nothing completed has no mean (it read 0.0 cached tokens; JSON: null).
    nothing = summarize("disagg", "concurrency", 1, [failed], duration_s=1.0)
    assert math.isnan(nothing.mean_cached_tokens) and math.isnan(nothing.ttft.mean)


class _CutShort(router_pb2_grpc.RouterServicer):
    """Streams a token, then the final chunk, except for prompts that begin with 0: those end
    OK after the token, without a finish reason (cut short)."""

    def Generate(self, request, context):
        yield router_pb2.GenerateChunk(request_id="r", token_ids=[7])
        if request.token_ids.ids[0] != 0:
            yield router_pb2.GenerateChunk(request_id="r", token_ids=[8], finish_reason="length",
                                           usage=router_pb2.Usage(completion_tokens=2))


def test_a_stream_cut_short_counts_as_failed_not_completed():
    """A request is done only with its final chunk's finish reason: one whose stream ended OK
    before it counted as completed, its partial output as throughput."""
    from concurrent.futures import ThreadPoolExecutor

    from bench.serve_load import one_request
    from client import AsyncClient, FailoverPolicy

    assert not _record(0.0, [(0.1, 1)], 0.2, finish_reason=None).ok
    server = grpc.server(ThreadPoolExecutor(2))
    router_pb2_grpc.add_RouterServicer_to_server(_CutShort(), server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    policy = FailoverPolicy(max_retries=0, health_check_interval_s=0)

    async def requests():
        async with AsyncClient(address, timeout=30, failover=policy) as c:
            return [await one_request(c, prompt, 2) for prompt in ([1, 2], [0, 2])]

    try:
        done, cut = asyncio.run(requests())
    finally:
        server.stop(None)
    assert (done.finish_reason, cut.finish_reason) == ("length", None)
    res = summarize("disagg", "concurrency", 1, [done, cut], 1.0)
    assert (res.completed, res.failed, res.output_tokens) == (1, 1, 2)
    assert res.errors == ["UNAVAILABLE: the stream ended without a finish reason (cut short)"]


def test_e2e_ends_at_the_final_chunk_not_at_the_calls_close(monkeypatch):
    """vLLM's E2EL (and so TPOT) ends when the last chunk arrives; the call's closing status
    after it (the router's clean-up, the trailers) was counted, which the in-process baseline
    never pays. A clock that ticks once per reading stands for the arrival times."""
    from concurrent.futures import ThreadPoolExecutor
    from itertools import count
    from types import SimpleNamespace

    from bench import serve_load
    from client import AsyncClient, FailoverPolicy

    server = grpc.server(ThreadPoolExecutor(2))
    router_pb2_grpc.add_RouterServicer_to_server(_CutShort(), server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    ticks = count()
    monkeypatch.setattr(serve_load, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))

    policy = FailoverPolicy(max_retries=0, health_check_interval_s=0)

    async def request():
        async with AsyncClient(address, timeout=30, failover=policy) as c:
            return await serve_load.one_request(c, [1, 2], 2)

    try:
        rec = asyncio.run(request())
    finally:
        server.stop(None)
    # Readings: the start (0), the first token (1), the final chunk (2).
    assert rec.ok and rec.chunks == [(1, 1), (2, 1)]
    assert (rec.end, rec.e2e, rec.tpot) == (2, 2, 1)


def test_a_poisson_point_reports_the_rate_its_requests_were_sent_at():
    from bench.serve_report import latency_table

    recs = [_record(t, [(t + 0.1, 2)], t + 0.2) for t in (10.0, 10.5, 11.0, 12.0, 12.0)]
    res = summarize("disagg", "poisson", 2.0, recs, duration_s=2.2)
    assert res.sent_rate == pytest.approx(4 / 2.0)  # 4 gaps over 2 s
    assert "| 2 req/s (sent at 2.00) |" in latency_table([res])
    assert math.isnan(summarize("disagg", "poisson", 2.0, recs[:1], 1.0).sent_rate)
    assert math.isnan(summarize("disagg", "concurrency", 8, recs, 2.2).sent_rate)


def test_ratios_compare_each_concurrency_against_the_baselines_that_ran():
    def point(system, load, tokens, mode="concurrency"):
        rec = _record(0.0, [(0.1, tokens)], 0.2)
        return summarize(system, mode, load, [rec], duration_s=1.0)

    points = [point("disagg", 1, 8), point("disagg", 8, 30), point("disagg", 2, 5, "poisson"),
              point("agg", 1, 10), point("agg", 8, 40), point("inprocess", 8, 60)]
    r1, r8 = serve.throughput_ratios(points)  # the Poisson point has no baseline: no row
    assert (r1.concurrency, r1.disagg_tok_s, r1.agg_tok_s) == (1, 8.0, 10.0)
    assert r1.ratio_vs_agg == pytest.approx(0.8)
    assert r1.inprocess_tok_s is None and r1.ratio is None
    assert (r8.ratio_vs_agg, r8.ratio) == pytest.approx((0.75, 0.5))
    assert serve.throughput_ratios([point("disagg", 1, 8)]) == []
    # Round by round, where the rounds' figures are given.
    [r1, _] = serve.throughput_ratios(points, {("disagg", 1): [8.0, 6.0], ("agg", 1): [10.0, 4.0]})
    assert r1.ratio_vs_agg_rounds == pytest.approx([0.8, 1.5]) and r1.ratio_rounds == []


def test_the_markdown_report_says_what_ran_and_what_it_measured():
    from bench.serve_report import markdown

    def point(system, tokens):
        return summarize(system, "concurrency", 8, [_record(0.0, [(0.1, tokens)], 0.2)], 1.0)

    points = [point("disagg", 30), point("agg", 40), point("inprocess", 60)]
    report = serve.ServeReport(serve.ServeConfig(), 2, 1, 2, 512, 2048, 2048, 2,
                               "-event_engine_client,-event_engine_listener", points,
                               serve.throughput_ratios(points), None)
    text = markdown(report)
    assert ("gRPC experiments: -event_engine_client,-event_engine_listener "
            "(GRPC_EXPERIMENTS)") in text
    assert "| 8 | 30.0 | 40.0 | 60.0 | 0.75 | 0.50 |" in text
    assert "1 thread(s) per worker" in text and "2 for the in-process engine, on 2 CPUs" in text
    report.grpc_experiments = ""
    assert "gRPC experiments: gRPC defaults" in markdown(report)


@pytest.mark.parametrize("flag, value", [("--concurrency", "0"), ("--concurrency", "a,b"),
                                         ("--request-rates", "-1"), ("--prompt-len", "50-10"),
                                         ("--output-len", "x"), ("--num-prompts", "0"),
                                         ("--max-local-prefill-length", "-1"),
                                         ("--rounds", "0"), ("--stream-interval", "0")])
def test_bad_arguments_are_value_errors(flag, value):
    p = argparse.ArgumentParser()
    serve.add_args(p)
    with pytest.raises(ValueError):
        serve.config_from_args(p.parse_args([flag, value]))


# The slow tier (11 s): a benchmark's whole run; its parts (metrics, percentiles, failures,
# ratios, the report) are unit-tested above and below.
@pytest.mark.slow
def test_tiny_run_end_to_end(capsys):
    rc = cli_main(["bench", "serve", "--json", "--concurrency", "2", "--request-rates", "50",
                   "--rounds", "2",
                   "--num-prompts", "4", "--prompt-len", "16-48", "--output-len", "6",
                   "--num-gpu-blocks", "128", "--prefix-requests", "2", "--prefix-len", "64",
                   "--unique-len", "8", "--prefix-output-len", "2", "--stream-interval", "4"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)  # stdout holds the one object alone
    assert report["config"]["stream_interval"] == 4
    assert set(report) == {"config", "torch_threads", "worker_threads",
                           "aggregated_worker_threads", "prefill_step_tokens",
                           "inprocess_step_tokens", "aggregated_step_tokens", "cpu_count",
                           "grpc_experiments", "points", "ratios", "shared_prefix"}
    # What the run's processes had: `pdserve`'s default unless the environment set its own.
    assert report["grpc_experiments"] == os.environ["GRPC_EXPERIMENTS"]
    assert report["inprocess_step_tokens"] == report["aggregated_step_tokens"] == 2048
    shared_cpu = "OMP_NUM_THREADS" not in os.environ and not torch.cuda.is_available()
    assert report["prefill_step_tokens"] == (512 if shared_cpu else 2048)
    # What the launcher chose where the run left it the choice: workers on a GPU step their
    # engine in a process of their own and share no cores; on a CPU, the reverse.
    assert report["config"]["engine_process"] is torch.cuda.is_available()
    assert report["config"]["share_cores"] is shared_cpu
    loads = [(p["system"], p["mode"]) for p in report["points"]]
    assert loads == [("disagg", "concurrency"), ("disagg", "poisson"), ("agg", "concurrency"),
                     ("inprocess", "concurrency")]
    for p in report["points"]:
        # Closed loops pool both rounds' requests; the Poisson point runs once.
        n = 4 if p["mode"] == "poisson" else 8
        assert (p["num_requests"], p["completed"], p["failed"]) == (n, n, 0)
        assert p["output_tokens"] == n * 6  # ignore_eos: exactly what was asked
        assert p["output_tok_s"] > 0 and p["request_s"] > 0
        for metric in ("ttft", "tpot", "itl", "e2e"):
            assert set(p[metric]) == {"mean", "p50", "p90", "p99"}
            assert 0 < p[metric]["p50"] <= p[metric]["p99"]
        assert p["ttft"]["mean"] <= p["e2e"]["mean"]
        assert set(p["breakdown_ms"]) == (set() if p["system"] == "inprocess"
                                          else set(BREAKDOWN_FIELDS))
    # Where the cores went in each closed loop: every service of each system, none for the
    # Poisson point (not measured).
    services = {"disagg": {"router", "prefill", "decode", "client"},
                "agg": {"router", "decode", "client"}, "inprocess": {"engine"}}
    for p in report["points"]:
        cpu = p["cpu_cores"]
        if p["mode"] == "poisson":
            assert cpu == {} and p["sent_rate"] > 0
            continue
        assert set(cpu) == services[p["system"]] | {"machine"}
        assert all(v >= 0 for v in cpu.values())
        assert cpu["decode" if p["system"] != "inprocess" else "engine"] > 0
    [ratio] = report["ratios"]
    by_system = {p["system"]: p["output_tok_s"] for p in report["points"]
                 if p["mode"] == "concurrency"}
    assert ratio["concurrency"] == 2
    assert ratio["ratio"] == pytest.approx(by_system["disagg"] / by_system["inprocess"])
    assert ratio["ratio_vs_agg"] == pytest.approx(by_system["disagg"] / by_system["agg"])
    assert len(ratio["ratio_rounds"]) == len(ratio["ratio_vs_agg_rounds"]) == 2
    assert all(x > 0 for x in ratio["ratio_rounds"] + ratio["ratio_vs_agg_rounds"])
    pre = report["shared_prefix"]
    assert pre["num_requests"] == 2
    assert pre["cold_cached_tokens"] == 0 and pre["warm_cached_tokens"] == 64
    assert pre["ratio"] > 0


def test_poisson_arrivals_are_scheduled_ahead_from_exponential_gaps():
    import random

    from bench.serve_load import arrival_times

    times = arrival_times(200, 4.0, seed=7)
    rng = random.Random(7)
    want = [0.0]
    for _ in range(199):
        want.append(want[-1] + rng.expovariate(4.0))
    assert times == want  # the first at once, then seeded exponential gaps of mean 1/rate
    assert arrival_times(1, 4.0, 7) == [0.0] and arrival_times(0, 4.0, 7) == []


def test_the_in_process_baseline_hands_out_tokens_at_the_clusters_stream_interval(preset_path):
    """The baseline engine groups its outputs as the cluster's decode engine does, so the
    two compare the same engine setting."""
    from bench.serve_load import LoadRequests, inprocess_closed_loop
    from engine import LLM

    with LLM(str(preset_path("tiny-llama")), num_gpu_blocks=64) as llm:
        reqs = LoadRequests([[11, 12, 13, 14], [21, 22, 23]], [9, 9])
        run = inprocess_closed_loop(llm.engine, reqs, 2, stream_interval=4)
    for rec in run.records:
        assert [n for _, n in rec.chunks] == [1, 4, 4]  # the first token at once


def test_a_request_count_of_zero_is_refused_not_read_as_unset():
    from bench.workloads import WORKLOADS, make_requests

    w = WORKLOADS["tiny"]
    assert len(make_requests(w, 512).prompts) == w.num_requests
    assert len(make_requests(w, 512, 3).prompts) == 3
    with pytest.raises(ValueError, match="--num-requests must be >= 1, got 0"):
        make_requests(w, 512, 0)  # ran the workload's own count
