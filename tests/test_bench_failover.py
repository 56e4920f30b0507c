"""``pdserve bench failover``: the stall metrics on synthetic timestamps, argument checks, and a
tiny run end to end through a real cluster (counts and parity only; no timing asserts)."""
from __future__ import annotations

import argparse
import json

import pytest

from bench import failover
from bench.failover import Run, Stream
from engine.cli import main as cli_main


def test_stream_stall_metrics():
    s = Stream(start=1.0, times=[1.05, 1.06, 1.26, 1.27])
    assert s.ttft_ms == pytest.approx(50.0)
    assert s.max_gap_ms == pytest.approx(200.0)
    assert Stream(start=0.0, times=[0.1]).max_gap_ms == 0.0


@pytest.mark.parametrize("argv", [["--streams", "0"], ["--max-tokens", "4"],
                                  ["--late-streams", "-1"],
                                  ["--health-check-interval-s", "0.01"],
                                  ["--keepalive-timeout-s", "0"]])
def test_bad_arguments_are_refused(argv):
    p = argparse.ArgumentParser()
    failover.add_args(p)
    with pytest.raises(ValueError):
        failover.main(p.parse_args(argv))


def _args(**kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    failover.add_args(p)
    return p.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in kw.items()])


def test_a_stop_reports_the_streams_the_stopping_worker_served():
    """Nothing moves after a SIGTERM: the affected streams are those whose usage names the
    stopped worker (here the decode worker "d1"); a failed stream counts, with its error."""
    base = [Stream(0.0, times=[0.1, 0.2, 0.3]) for _ in range(3)]
    hit = [Stream(0.0, times=[0.1, 0.2, 0.6], workers=("p0", "d1")),
           Stream(0.0, times=[0.1, 0.2, 0.3], workers=("p0", "d0")),
           Stream(0.0, error="UnavailableError: gone")]
    want = [[], [], [1]]
    calm = Run(base, 1.0)
    r = failover._report(_args(fault="stop"), calm, Run(hit, 1.5, "d1", 0, rerouted=2), want)
    assert (r.failed, r.migrated, r.rerouted, r.affected, r.victim_exit) == (1, 0, 2, 1, 0)
    assert r.identical == 2 and r.errors == ["UnavailableError: gone"]
    assert r.stall_ms_mean == pytest.approx(400.0) and r.baseline_ms_mean == pytest.approx(100.0)
    # After a crash the affected streams are the moved ones, whoever served them.
    hit[1].migrations = 1
    r = failover._report(_args(fault="kill"), calm, Run(hit, 1.5, "d1"), want)
    assert (r.migrated, r.affected) == (1, 1) and r.stall_ms_mean == pytest.approx(100.0)
    assert (r.duration_s, r.baseline_duration_s) == (1.5, 1.0)
    assert "streams failed: 1" in failover._format(r)


def test_late_streams_are_reported_beside_the_baselines():
    """The streams started right after the fault: TTFT against the baseline's late ones,
    failures, parity, and whether any reached the failed worker."""
    base = [Stream(0.0, times=[0.1])]
    calm = Run(base, 1.0, late=[Stream(0.5, times=[0.55]), Stream(0.5, times=[0.57])])
    late = [Stream(0.5, times=[0.6, 0.7], token_ids=[7, 8], workers=("p0", "d0")),
            Stream(0.5, times=[0.8], token_ids=[9], workers=("p0", "d1")),
            Stream(0.5, error="UnavailableError: gone")]
    hit = Run([Stream(0.0, times=[0.1], token_ids=[1])], 1.5, "d1", 0, late=late)
    r = failover._report(_args(fault="stop"), calm, hit, [[1], [7, 8], [9, 9], [5]])
    assert (r.late, r.late_failed, r.late_on_victim, r.late_identical) == (3, 1, 1, 1)
    assert r.identical == 1  # the late streams are counted on their own
    assert r.late_ttft_ms_mean == pytest.approx(200.0)
    assert r.baseline_late_ttft_ms_mean == pytest.approx(60.0)
    assert r.late_ttft_ratio == pytest.approx(200 / 60)
    assert "served by the failed worker: 1" in failover._format(r)
    assert failover._report(_args(fault="stop"), calm, Run(hit.streams, 1.5, "d1"),
                            [[1]]).late == 0


def test_figures_with_nothing_to_measure_are_not_reported_as_zero():
    """No stream moved, every late stream failed, a baseline stream failed before its first
    token: those figures and their ratios are n/a in the table and null in the JSON (they read
    0.0, as if the fault had cost nothing)."""
    def stream() -> Stream:
        return Stream(0.0, times=[0.01 * i for i in range(1, 9)], token_ids=list(range(8)))

    calm = Run([stream(), stream()], 1.0, late=[Stream(0.5, times=[0.55])])
    late = [Stream(0.5, error="UnavailableError: gone")]
    hit = Run([stream(), stream()], 1.1, "d1", late=late)
    r = failover._report(_args(), calm, hit, [list(range(8))] * 3)
    assert (r.affected, r.stall_ms_mean, r.baseline_ms_mean, r.stall_ms_max,
            r.baseline_ms_max, r.stall_ratio) == (0, None, None, None, None, None)
    assert (r.late_ttft_ms_mean, r.late_ttft_ratio) == (None, None)
    assert r.baseline_late_ttft_ms_mean == pytest.approx(50.0)
    table = failover._format(r)
    assert "| mean ms | n/a | n/a | n/a |" in table and "| max ms | n/a | n/a | n/a |" in table
    assert "| late streams' TTFT, mean ms | n/a | 50.0 | n/a |" in table
    out = json.loads(failover._json(r))
    assert [out[k] for k in ("stall_ms_mean", "baseline_ms_mean", "stall_ratio",
                             "late_ttft_ms_mean", "late_ttft_ratio")] == [None] * 5
    # A moved stream whose baseline slot failed before its first token: no baseline figure.
    hit.streams[0].migrations = 1
    calm.streams[0] = Stream(0.0, error="UnavailableError: gone")
    r = failover._report(_args(), calm, hit, [list(range(8))] * 3)
    assert r.affected == 1 and r.stall_ms_mean == pytest.approx(10.0)
    assert (r.baseline_ms_mean, r.baseline_ms_max, r.stall_ratio) == (None, None, None)


# The tool end to end runs in the slow tier (27 s on the 2-core VM); the faults themselves are
# tested in tests/test_serving_migration.py, the tool's metrics and flags above.
@pytest.mark.parametrize("role, metric, fault", [
    pytest.param("decode", "max_gap", "kill", marks=pytest.mark.slow),
    pytest.param("prefill", "ttft", "kill", marks=pytest.mark.slow),
    pytest.param("decode", "max_gap", "hang", marks=pytest.mark.slow)])
def test_a_failed_worker_moves_its_streams_with_the_same_tokens(capsys, role, metric, fault):
    """A crash, or a hang the router's health checks find (SIGSTOP)."""
    assert cli_main(["bench", "failover", "--kill", role, "--fault", fault, "--streams", "4",
                     "--late-streams", "2", "--max-tokens", "24",
                     "--health-check-interval-s", "0.5", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["kill"] == role and r["fault"] == fault and r["streams"] == 4
    assert r["migrated"] >= 1  # the killed worker held at least one stream
    assert r["identical"] == 4  # every stream, moved or not, equals the in-process engine
    # Requests arriving right after the fault are served elsewhere, with the same tokens.
    assert (r["late"], r["late_failed"], r["late_identical"], r["late_on_victim"]) == (2, 0, 2, 0)
    assert r["stall_metric"] == metric and r["stall_ms_max"] >= r["stall_ms_mean"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_a_stopped_worker_drains_its_streams_and_exits(capsys, role):
    """A rolling restart's stop (SIGTERM): no stream fails or moves, every one has the
    in-process engine's tokens, and the worker exits 0 once drained."""
    assert cli_main(["bench", "failover", "--kill", role, "--fault", "stop", "--streams", "4",
                     "--late-streams", "2", "--max-tokens", "24", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["fault"], r["failed"], r["migrated"], r["victim_exit"]) == ("stop", 0, 0, 0)
    assert r["identical"] == 4
    # None arriving during the drain reaches the stopping worker.
    assert (r["late"], r["late_failed"], r["late_identical"], r["late_on_victim"]) == (2, 0, 2, 0)
    if role == "decode":  # the busiest decode worker was stopped: it served some to the end
        assert r["affected"] >= 1
