"""``pdserve bench streams``: argument checks and a tiny run of both decode-stream modes through
real clusters (counts and shape only; no timing asserts)."""
from __future__ import annotations

import argparse
import json
import math

import pytest

from bench import streams
from engine.cli import main as cli_main


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--concurrency", "0"],
                                  ["--output-len", "9-3"], ["--stream-interval", "0"]])
def test_bad_arguments_are_refused(argv):
    p = argparse.ArgumentParser()
    streams.add_args(p)
    with pytest.raises(ValueError):
        streams.main(p.parse_args(argv))


@pytest.mark.slow  # ~35 s; the decode-stream modes themselves: tests/test_decode_mux.py
def test_every_setting_serves_the_same_load(capsys):
    assert cli_main(["bench", "streams", "--rounds", "1", "--concurrency", "4",
                     "--num-prompts", "8", "--output-len", "8-16", "--stream-interval", "4",
                     "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    settings = ["multiplexed", "multiplexed, interval 4", "per-request"]
    assert sorted(run["mode"] for run in r["runs"]) == settings
    for run in r["runs"]:
        assert run["failed"] == 0 and run["tok_s"] > 0
        assert set(run["cpu_ms_per_token"]) == {"router", "prefill", "decode"}
        assert all(v > 0 for v in run["cpu_ms_per_token"].values())
    assert set(r["tok_s_ratio"]) == set(r["cpu_ratio"]) == set(settings) - {"per-request"}
    assert all(v > 0 for v in r["tok_s_ratio"].values())


def test_a_baseline_whose_requests_all_failed_gives_undefined_ratios_not_a_crash():
    runs = [streams.StreamRun("multiplexed", 0, 120.0, 0, {"router": 0.2}),
            streams.StreamRun(streams.BASELINE, 0, 0.0, 8, {"router": 0.0})]
    report = streams._report(argparse.Namespace(concurrency=8, num_prompts=8), runs)
    assert math.isnan(report.tok_s_ratio["multiplexed"])
    assert math.isnan(report.cpu_ratio["multiplexed"]["router"])
    assert "nan" in streams._format(report)
    # A run without a token has no CPU per token (it read as the run's whole CPU).
    assert math.isnan(streams.per_token_ms(2.0, 0))
    assert streams.per_token_ms(2.0, 4) == pytest.approx(500.0)


def test_a_workers_cpu_counts_its_engine_process_and_ranks():
    """On a GPU host each worker steps its engine in a process of its own: a count of the
    worker's process alone left the step's CPU out of the per-token figures."""
    import os
    import signal
    import subprocess
    import sys

    from tests.proc_signals import wait_until

    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.run("
                               "[sys.executable, '-c', 'while True: pass'])"],
                              start_new_session=True)
    try:
        assert wait_until(lambda: streams.role_cpu_s("decode", parent.pid)
                          > streams.role_cpu_s("router", parent.pid) + 0.05, 60)
    finally:
        os.killpg(parent.pid, signal.SIGKILL)  # the busy child too
        parent.wait()
