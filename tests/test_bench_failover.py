"""``pdserve bench failover``: the stall metrics on synthetic timestamps, argument checks, and a
tiny run end to end through a real cluster (counts and parity only; no timing asserts)."""
from __future__ import annotations

import argparse
import json

import pytest

from bench import failover
from bench.failover import Stream
from engine.cli import main as cli_main


def test_stream_stall_metrics():
    s = Stream(start=1.0, times=[1.05, 1.06, 1.26, 1.27])
    assert s.ttft_ms == pytest.approx(50.0)
    assert s.max_gap_ms == pytest.approx(200.0)
    assert Stream(start=0.0, times=[0.1]).max_gap_ms == 0.0


@pytest.mark.parametrize("argv", [["--streams", "0"], ["--max-tokens", "4"],
                                  ["--health-check-interval-s", "0.01"]])
def test_bad_arguments_are_refused(argv):
    p = argparse.ArgumentParser()
    failover.add_args(p)
    with pytest.raises(ValueError):
        failover.main(p.parse_args(argv))


# The tool end to end runs in the slow tier (27 s on the 2-core VM); the faults themselves are
# tested in tests/test_serving_migration.py, the tool's metrics and flags above.
@pytest.mark.parametrize("role, metric, fault", [
    pytest.param("decode", "max_gap", "kill", marks=pytest.mark.slow),
    pytest.param("prefill", "ttft", "kill", marks=pytest.mark.slow),
    pytest.param("decode", "max_gap", "hang", marks=pytest.mark.slow)])
def test_a_failed_worker_moves_its_streams_with_the_same_tokens(capsys, role, metric, fault):
    """A crash, or a hang the router's health checks find (SIGSTOP)."""
    assert cli_main(["bench", "failover", "--kill", role, "--fault", fault, "--streams", "4",
                     "--max-tokens", "24", "--health-check-interval-s", "0.5", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["kill"] == role and r["fault"] == fault and r["streams"] == 4
    assert r["migrated"] >= 1  # the killed worker held at least one stream
    assert r["identical"] == 4  # every stream, moved or not, equals the in-process engine
    assert r["stall_metric"] == metric and r["stall_ms_max"] >= r["stall_ms_mean"] > 0
