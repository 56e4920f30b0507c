"""``pdserve bench chaos``: argument checks, the report's verdict, and a short run end to end
through a supervised cluster of two routers whose workers and routers are killed, hung and
stopped (counts and parity only; no timing asserts)."""
from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import pytest

from bench import chaos
from bench.chaos import ChaosReport, Fault
from bench.soak import SoakReport


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    chaos.add_args(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize("argv", [["--faults", "kill,explode"], ["--faults", ","],
                                  ["--num-prefill", "1"], ["--num-decode", "1"],
                                  ["--num-routers", "0"],
                                  ["--duration", "0"], ["--fault-every", "0"], ["--hang-s", "-1"],
                                  ["--settle-s", "0"], ["--kv-lease-timeout-s", "0"],
                                  ["--settle-s", "30", "--kv-lease-timeout-s", "30"],
                                  ["--settle-s", "30", "--kv-quarantine-s", "40"],
                                  ["--kv-quarantine-s", "0"],
                                  ["--concurrency", "0"],
                                  ["--cancel-fraction", "1.5"], ["--pool-candidates", "0"]])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(ValueError):
        chaos.main(_args(*argv))


def test_the_faults_asked_for_are_parsed():
    assert chaos.check_args(_args("--faults", " hang , kill")) == ["hang", "kill"]


def test_the_verdict_fails_on_any_wrong_token_failure_or_leftover():
    def report(**kw) -> ChaosReport:
        traffic = SoakReport(1.0, 1, finished=5, wrong=kw.pop("wrong", 0),
                             failed=kw.pop("failed", 0))
        return ChaosReport(traffic, faults=[Fault(1.0, "kill", "decode-1")], **kw)

    assert report().ok and chaos.format_report(report()).endswith("OK")
    for bad in (report(wrong=1), report(failed=1), report(gave_up=1),
                report(held=["decode-2: 3 blocks in use"]),
                report(error="RuntimeError: decode-3 not healthy")):
        assert not bad.ok and chaos.format_report(bad).endswith("FAILED")
    held = chaos.format_report(report(held=["router: 1 requests in flight"], settle_s=9.0))
    assert "still held after 9 s: router: 1 requests in flight" in held
    assert "faults: 1 (kill 1)" in chaos.format_report(report())


def test_a_failure_of_the_faults_driver_is_reported_and_fails_the_run():
    report = ChaosReport(SoakReport(1.0, 1, finished=3))
    driver = chaos._Chaos(SimpleNamespace(procs=[], redis=None), ["kill"], _args(), report, 0.0)

    def not_healthy() -> None:
        raise RuntimeError("decode-3 was not healthy within 120 s")

    driver._guarded(not_healthy)
    assert report.error == "RuntimeError: decode-3 was not healthy within 120 s"
    assert not report.ok
    assert "the faults' driver failed: RuntimeError" in chaos.format_report(report)


# The slow tier (~60 s): what each fault does is checked on every run by the migration,
# rolling-stop and supervisor tests; this is their mix under continuous traffic.
@pytest.mark.slow
def test_a_short_chaos_run_through_a_cluster(capsys):
    rc = chaos.main(_args("--model", "micro-llama", "--duration", "24", "--concurrency", "4",
                          "--num-routers", "2",
                          "--fault-every", "4", "--hang-s", "8", "--max-tokens", "12",
                          "--kv-lease-timeout-s", "10", "--kv-quarantine-s", "10",
                          "--settle-s", "40",
                          "--pool-candidates", "24", "--cancel-fraction", "0.2", "--json"))
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and rc == 0, report
    traffic = report["traffic"]
    assert traffic["finished"] > 0 and traffic["cancelled"] > 0
    assert traffic["wrong"] == traffic["failed"] == 0 and report["held"] == []
    # Each kind once a round: every kind happened, the hang long enough to be found.
    assert {f["kind"] for f in report["faults"]} == {"kill", "hang", "stop"}
    assert report["worker_hangs"] >= 1
