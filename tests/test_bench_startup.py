"""``pdserve bench startup`` (bench/startup.py): real clusters started cold and warm."""
from __future__ import annotations

import json
import os

import pytest

from bench.startup import StartupRun, _report


def test_medians_and_ratios_are_per_setting():
    runs = [StartupRun("cold", 0, 10.0, 5.0, 0.5, 30.0),
            StartupRun("warm", 0, 6.0, 2.0, 0.5, 15.0),
            StartupRun("warm", 1, 4.0, 4.0, 0.3, 17.0),
            StartupRun("cold", 1, 12.0, 7.0, 0.7, 34.0)]
    r = _report("m", runs)
    assert r.median["cold"] == {"start_s": 11.0, "scale_out_s": 6.0, "stop_s": 0.6, "cpu_s": 32.0}
    assert r.median["warm"] == {"start_s": 5.0, "scale_out_s": 3.0, "stop_s": 0.4, "cpu_s": 16.0}
    assert r.ratio == pytest.approx({"start_s": 5 / 11, "scale_out_s": 0.5, "stop_s": 0.4 / 0.6,
                                     "cpu_s": 0.5})


@pytest.mark.slow
def test_one_round_starts_and_stops_real_clusters(capsys, monkeypatch, tmp_path):
    from engine.cli import main

    monkeypatch.setenv("PDSERVE_TOKENIZER_CACHE", str(tmp_path / "untouched"))
    assert main(["bench", "startup", "--rounds", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["setting"] for r in report["runs"]] == ["cold", "warm"]
    for run in report["runs"]:
        assert all(run[f] > 0 for f in ("start_s", "scale_out_s", "stop_s", "cpu_s"))
    assert set(report["ratio"]) == {"start_s", "scale_out_s", "stop_s", "cpu_s"}
    # The bench's caches were its own, and the caller's setting is back.
    assert not (tmp_path / "untouched").exists()
    assert os.environ["PDSERVE_TOKENIZER_CACHE"] == str(tmp_path / "untouched")
