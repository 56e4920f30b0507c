"""PDSERVE_SWITCH_INTERVAL_MS: parsed and checked, and applied by every service process."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.switch_interval import ENV, switch_interval_s

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("raw, seconds", [("", None), ("  ", None), ("1", 0.001),
                                          ("0.5", 0.0005), (" 2.5 ", 0.0025), ("100", 0.1)])
def test_values_in_milliseconds(raw, seconds):
    assert switch_interval_s({ENV: raw}) == seconds


def test_unset_leaves_cpython_alone():
    assert switch_interval_s({}) is None


@pytest.mark.parametrize("raw", ["fast", "0", "-1", "0.01", "101", "nan", "inf"])
def test_bad_values_name_the_variable(raw):
    with pytest.raises(ValueError, match=ENV):
        switch_interval_s({ENV: raw})


def _python(code: str, value: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env=dict(os.environ, **{ENV: value}))


def test_a_service_process_runs_with_it():
    # engine.grpc_server.run is what `pdserve router|prefill|decode` run their service under.
    code = ("import sys\nfrom engine.grpc_server import run\n"
            "async def main():\n    print(sys.getswitchinterval())\nrun(main)")
    done = _python(code, "0.5")
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.split()[-1]) == pytest.approx(0.0005)
    # Without it, CPython's own.
    done = _python(code, "")
    assert float(done.stdout.split()[-1]) == pytest.approx(0.005)


def test_a_worker_refuses_a_bad_value_before_it_starts():
    done = subprocess.run([sys.executable, "-m", "engine.cli", "decode", "--model", "micro-llama",
                           "--port", "0"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, **{ENV: "fast"}))
    assert done.returncode == 2
    assert f"pdserve: error: {ENV} must be a number of milliseconds, got 'fast'" in done.stderr
